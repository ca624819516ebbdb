"""Offload policies under torch.compile: regional compilation (each decoder layer compiled, as Accelerate's
`compile_regions` and Axolotl do it, or `layer.compile()`), and whole-model compilation. Offload engages (counters),
gradients are bitwise those of the same compiled model without offload (both run the same compiled kernels, and a
restored tensor holds the same bits), and steps after the first compile nothing new (dynamo's counters)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from support import hf_tiny as H
import hsoffload
from hsoffload._logging import forget_logged

aten = torch.ops.aten


def _kwargs(**extra: object) -> dict:
    return {"offload_cpu_tensors": True, "min_offload_size": 0, **extra}


def _compile_layers(model: torch.nn.Module, backend: str, in_place: bool = False) -> None:
    layers = model.model.layers
    for i in range(len(layers)):
        if in_place:
            layers[i].compile(backend=backend)
        else:
            layers[i] = torch.compile(layers[i], backend=backend)


def _step(model: torch.nn.Module, call: torch.nn.Module, batch: dict, scope_kwargs: dict | None):
    if scope_kwargs is None:
        loss = call(**batch).loss
        loss.backward()
        stats = None
    else:
        with hsoffload.offload_hidden_states(model, **scope_kwargs) as scope:
            loss = call(**batch).loss
            loss.backward()
        stats = scope.stats
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, stats


def _assert_same(a, b) -> None:
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
def test_regional_inductor_every_policy_offloads_bitwise_without_recompiling():
    """One inductor compile of the layer (about 35 s on 2 cores), reused by every policy: the policies differ only
    in the saved-tensor hooks, which run outside the compiled graphs. The layers are compiled before hsoffload
    patches transformers (as Accelerate does at prepare time): offload_hidden_states re-binds them."""
    hsoffload.unpatch()
    model = H.tiny_model("llama")
    H.enable_checkpointing(model, reentrant=False)
    twin = H.twin(model)
    _compile_layers(model, "inductor")
    _compile_layers(twin, "inductor")
    data = H.batches(2)
    names: list[str] = []

    def every_tensor(t: torch.Tensor, name: str) -> bool:
        names.append(name)
        return True

    for policy in ("hidden_states", "all", every_tensor):
        for step, batch in enumerate(data):
            ours = _step(model, model, batch, _kwargs(policy=policy))
            ref = _step(twin, twin, batch, None)
            _assert_same(ours, ref)
            # At least each layer's input; "all" and the callable also take what else the compiled graphs save
            # (weights and their views excepted).
            assert ours[2].offloaded_tensors >= H.LAYERS, (policy, ours[2])
            if policy != "hidden_states":
                assert ours[2].offloaded_tensors > H.LAYERS, (policy, ours[2])
            if step == 0:
                graphs = _graphs()
            else:
                assert _graphs() == graphs, f"{policy}: step {step} compiled new graphs"
    # Inside a compiled layer a callable sees the layer's name (the hooks of its inner modules are traced away).
    assert {f"model.layers.{i}" for i in range(H.LAYERS)} <= set(names)


@pytest.mark.slow
def test_regional_sac_offloads_what_the_compiled_graph_keeps():
    model = H.tiny_model("qwen3")
    H.enable_sac(model, {aten.mm.default, aten.bmm.default})
    twin = H.twin(model)
    hsoffload.patch()
    _compile_layers(model, "aot_eager")
    _compile_layers(twin, "aot_eager")
    for batch in H.batches(2):
        ours = _step(model, model, batch, _kwargs(policy="sac"))
        hidden_only = _step(model, model, batch, _kwargs(policy="hidden_states"))
        ref = _step(twin, twin, batch, None)
        _assert_same(ours, ref)
        _assert_same(hidden_only, ref)
        assert ours[2].offloaded_tensors > 2 * hidden_only[2].offloaded_tensors >= 2 * H.LAYERS


@pytest.mark.slow
def test_layer_compile_in_place_policy_all_bitwise():
    model = H.tiny_model("mistral")
    twin = H.twin(model)
    _compile_layers(model, "aot_eager", in_place=True)
    _compile_layers(twin, "aot_eager", in_place=True)
    for step, batch in enumerate(H.batches(2)):
        ours = _step(model, model, batch, _kwargs(policy="all"))
        _assert_same(ours, _step(twin, twin, batch, None))
        assert ours[2].offloaded_tensors > 3 * H.LAYERS
        if step == 0:
            graphs = _graphs()
    assert _graphs() == graphs


@pytest.mark.slow
def test_whole_model_compile_splits_at_each_layer_and_says_so(caplog):
    forget_logged()
    model = H.tiny_model("llama")
    H.enable_checkpointing(model, reentrant=False)
    twin = H.twin(model)
    hsoffload.patch()
    compiled, compiled_twin = torch.compile(model, backend="aot_eager"), torch.compile(twin, backend="aot_eager")
    with caplog.at_level(logging.INFO, logger="hsoffload"):
        for step, batch in enumerate(H.batches(2)):
            ours = _step(model, compiled, batch, _kwargs())
            _assert_same(ours, _step(twin, compiled_twin, batch, None))
            assert ours[2].offloaded_tensors == H.LAYERS
            if step == 0:
                graphs = _graphs()
    assert _graphs() == graphs
    assert any("graph break at the layer's start" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_regional_compile_with_reentrant_checkpointing_bitwise():
    model = H.tiny_model("mistral")
    H.enable_checkpointing(model, reentrant=True)
    twin = H.twin(model)
    hsoffload.patch()
    _compile_layers(model, "aot_eager")
    _compile_layers(twin, "aot_eager")
    for batch in H.batches(2):
        ours = _step(model, model, batch, _kwargs())
        _assert_same(ours, _step(twin, twin, batch, None))
        assert ours[2].offloaded_tensors == H.LAYERS


def test_fullgraph_layers_compile_without_graph_breaks_while_no_scope_is_active():
    """patch() is process-wide (the Trainer integration calls it): a layer compiled with fullgraph=True must keep
    compiling while no offload scope is active anywhere."""
    hsoffload.patch()
    model = H.tiny_model("llama")
    H.enable_checkpointing(model, reentrant=False)
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = torch.compile(layers[i], backend="aot_eager", fullgraph=True)
    model(**H.batches(1)[0]).loss.backward()
    assert sum(counters["graph_break"].values()) == 0
