"""DeepSpeed as an engine hidden-state offload runs under (issue 28).

End to end: 2 CPU ranks under torchrun (`DS_ACCELERATOR=cpu`, gloo), a tiny Llama from a local config, every case of
tests/support/deepspeed_worker.py in one launch (process start and DeepSpeed's setup are most of the cost). Each case
trains twice, offload off and on; the worker compares losses, full gradients before each step and full fp32
parameters after it with `torch.equal` and these tests assert on what it wrote.

In process (no DeepSpeed needed): the rules issue 28 added for DeepSpeed's tensors, on tensors built the way ZeRO-3
builds them.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import hsoffload
from hsoffload.targets import enable_checkpointing

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "deepspeed_worker.py"
from support import launch
from support import deepspeed_worker as W  # the case list and sizes (importing it does not import DeepSpeed)

# Every test here launches processes (tests/durations.json: the measured seconds).
pytestmark = pytest.mark.slow


def _deepspeed_missing() -> str:
    """Why the DeepSpeed tests cannot run here ("" when they can). Found without importing it: the torch 2.14 and
    twin legs have no DeepSpeed; an installed one that fails to import fails its tests instead of skipping them."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed in this environment (`make install` pins it: requirements/deepspeed.txt)"
    return ""


needs_deepspeed = pytest.mark.skipif(bool(_deepspeed_missing()), reason=_deepspeed_missing() or "deepspeed present")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("deepspeed")
    t0 = time.perf_counter()
    proc = launch.two_ranks(WORKER, ["--out-dir", str(out)], timeout=480)
    assert proc.returncode == 0, launch.tail(proc)
    r0 = json.loads((out / "rank0.json").read_text())
    r0["_wall_s"] = time.perf_counter() - t0
    return r0


def _case(results: dict[str, Any], name: str) -> dict[str, Any]:
    res = results[name]
    assert "error" not in res, f"case {name} raised on rank 0:\n{res['error']}"
    return res


ALL_CASES = [c.name for c in W.CASES] + ["trainer_zero3"]


@needs_deepspeed
@pytest.mark.parametrize("name", ALL_CASES)
def test_offload_is_bit_identical(results: dict[str, Any], name: str) -> None:
    """Losses, full gradients before every step and full fp32 parameters after it: equal bit for bit."""
    res = _case(results, name)
    n_params = 39  # 4 layers x 9 + embed_tokens + norm + lm_head
    micro = W.STEPS * next((c.accumulation for c in W.CASES if c.name == name), 1)
    assert res["compared"] == {"losses": micro, "grads": W.STEPS * n_params, "params": W.STEPS * n_params}
    assert res["diffs"] == [], f"{name}: offload changed the training:\n" + "\n".join(res["diffs"][:20])


@needs_deepspeed
@pytest.mark.parametrize("name", [c.name for c in W.CASES])
def test_runs_are_not_trivial(results: dict[str, Any], name: str) -> None:
    """The comparison could fail: every parameter got a gradient and the optimizer moved the weights."""
    res = _case(results, name)
    assert res["nonzero_grads"] and res["params_moved"]


@needs_deepspeed
@pytest.mark.parametrize("name", [c.name for c in W.CASES])
def test_offloads_happen_in_forward_only(results: dict[str, Any], name: str) -> None:
    """One offload per decoder layer per micro-batch (policy "all": every saved activation), all of them during
    forward: backward restores them and offloads nothing."""
    case = next(c for c in W.CASES if c.name == name)
    res = _case(results, name)
    fwd, bwd = res["after_forward"], res["after_backward"]
    assert len(fwd) == len(bwd) == W.STEPS * case.accumulation
    for i, (f, b) in enumerate(zip(fwd, bwd)):
        before = bwd[i - 1]["offloaded_tensors"] if i else 0
        in_forward = f["offloaded_tensors"] - before
        if case.policy == "hidden_states":
            assert in_forward == W.LAYERS, f"micro-batch {i}: {in_forward} offloads in forward"
        else:
            assert in_forward > W.LAYERS
        assert b["offloaded_tensors"] == f["offloaded_tensors"], f"micro-batch {i}: offloads during backward"
        assert b["offloaded_bytes"] == f["offloaded_bytes"]
        assert b["skipped_marked_tensors"] == 0
    assert bwd[-1]["restored_tensors"] >= bwd[-1]["offloaded_tensors"] > 0


@needs_deepspeed
@pytest.mark.parametrize("name", [c.name for c in W.CASES if c.stage == 3 and not c.zero_offload])
def test_zero3_16bit_save_has_the_models_own_keys(results: dict[str, Any], name: str) -> None:
    """The consolidated 16-bit save of a ZeRO-3 engine trained with offload: exactly the model's own state_dict keys
    (no wrapper prefixes), its values the full parameters after the last step."""
    saved = _case(results, name)["saved_keys"]
    assert saved["saved"] == saved["own"]
    assert saved["values_equal"]


@needs_deepspeed
def test_trainer_zero3_with_the_trainer_integration(results: dict[str, Any]) -> None:
    """HF Trainer with a ZeRO-3 config dict offloading parameters and optimizer (model built under zero.Init by
    transformers) and hsoffload.integrations.enable_hidden_state_offload: one offload per layer per step, logged, and
    this rank's ZeRO-Offload bytes (16 per parameter in fp32 / 2 ranks) left out of the auto host budget by the
    integration only."""
    res = _case(results, "trainer_zero3")
    assert res["zero_init"]
    assert res["host_room"] == [0, res["expected_room"]] and res["expected_room"] > 0
    assert res["stats"]["offloaded_tensors"] == W.LAYERS * W.STEPS
    assert res["stats"]["restored_tensors"] == res["stats"]["offloaded_tensors"]
    logged = [entry for entry in res["logged"] if entry]
    assert len(logged) == W.STEPS and all(entry["hsoffload/offloaded_tensors"] == W.LAYERS for entry in logged)


@needs_deepspeed
def test_zero3_reentrant_recompute_saves_are_not_marked(results: dict[str, Any]) -> None:
    """Issue 28 item 1. ZeRO-3's module hooks hand a reentrant checkpoint's recompute an alias of the layer input
    with a grad_fn; its saves run while backward's graph task runs and must never count as marked saves. With
    offload_cpu_tensors=False every marked save is skipped, so skipped_marked_tensors counts them: one per layer per
    micro-batch (it was 12 after one step of 4 layers)."""
    res = _case(results, "zero3_reentrant_marks")
    skipped = [s["skipped_marked_tensors"] for s in res["after_backward"]]
    assert skipped == [W.LAYERS * (i + 1) for i in range(W.STEPS)], skipped
    assert res["passthrough"]["backward_saves"] > 0


@needs_deepspeed
def test_zero3_detached_alias_of_a_gathered_weight_passes_through(results: dict[str, Any]) -> None:
    """Issue 28 item 3. Under ZeRO-3 the scope's parameter-storage set is empty (partitions have 0 elements), so a
    detached alias of a gathered weight is recognised by the storages of the ZeRO-3 parameters gathered now: policy
    "all" keeps it in place, counted once per layer per micro-batch, and offloads exactly what it offloads without
    the alias (the hook's matmul input is the MLP's own, already offloaded)."""
    res = _case(results, "zero3_policy_all_weight_alias")
    plain = _case(results, "zero3_policy_all")
    micro = len(res["after_forward"])
    assert res["passthrough"]["zero3_parameters"] == W.LAYERS * micro
    assert plain["passthrough"]["zero3_parameters"] == 0
    offloaded = [(s["offloaded_tensors"], s["offloaded_bytes"]) for s in res["after_backward"]]
    assert offloaded == [(s["offloaded_tensors"], s["offloaded_bytes"]) for s in plain["after_backward"]]


@needs_deepspeed
def test_deepspeed_leg_wall_time(results: dict[str, Any]) -> None:
    """The whole DeepSpeed launch stays within the CI budget issue 28 set (4 minutes on 2 cores)."""
    assert results["_wall_s"] < 240, f"the DeepSpeed launch took {results['_wall_s']:.0f} s"


# --------------------------------------------------------------------------- in process, without DeepSpeed

from support import hf_tiny as H  # noqa: E402


class _Alias(torch.autograd.Function):
    """Returns its input as is: autograd hands out an alias of it whose grad_fn is this node, as ZeRO-3's module
    hooks do with every module's inputs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _alias_inputs(_module: torch.nn.Module, args: tuple) -> tuple:
    return tuple(_Alias.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)


def _zero3_like_aliases(model: torch.nn.Module) -> torch.nn.Module:
    """A forward pre-hook on every module of every decoder layer that aliases its tensor inputs through an autograd
    function: a reentrant checkpoint's recompute then saves aliases *with a grad_fn* of the (kept) layer input."""
    for layer in model.model.layers:
        for module in layer.modules():
            module.register_forward_pre_hook(_alias_inputs)
    return model


def test_backward_saves_of_a_layer_input_alias_are_not_marked() -> None:
    """Issue 28 item 1 without DeepSpeed. Kept in place (offload_cpu_tensors=False), the layer input's storage is
    what the reentrant recompute's aliases share, at the same version; their saves run inside backward's graph task
    and must not match the mark: one skipped marked save per layer (it was 3 per layer before the fix)."""
    model = _zero3_like_aliases(H.tiny_model())
    H.enable_checkpointing(model, reentrant=True)
    _, _, stats = H.train_steps(model, H.batches(1), offload=True, steps=1,
                                scope_kwargs={"offload_cpu_tensors": False, "min_offload_size": 0})
    assert stats[0].skipped_marked_tensors == H.LAYERS
    assert stats[0].marked_tensors == H.LAYERS and stats[0].offloaded_tensors == 0


def test_backward_saves_pass_through_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same aliases with offload on: every layer input offloaded once, in forward; backward's saves counted as
    passed through; gradients and losses bit-identical over three AdamW steps."""
    ref = _zero3_like_aliases(H.tiny_model())
    H.enable_checkpointing(ref, reentrant=True)
    model = _zero3_like_aliases(H.tiny_model())
    H.enable_checkpointing(model, reentrant=True)
    data = H.batches(3)
    expected = H.train_steps(ref, data, offload=False)
    scope_seen: list = []
    original = hsoffload.offload_hidden_states

    def remember(*a: Any, **k: Any) -> Any:
        scope_seen.append(original(*a, **k))
        return scope_seen[-1]

    monkeypatch.setattr(hsoffload, "offload_hidden_states", remember)
    got = H.train_steps(model, data, offload=True)
    H.assert_bitwise_equal(expected, got)
    assert [s.offloaded_tensors for s in got[2]] == [H.LAYERS] * 3
    assert all(s.passthrough_stats.backward_saves > 0 for s in scope_seen)


@needs_deepspeed
def test_deepspeed_checkpoint_function_is_named_with_what_to_do(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28 item 2. deepspeed.checkpointing.checkpoint keeps layer inputs on its context, out of every
    saved-tensor hook's sight: the warning names it and says to use torch's checkpoint, and the generic "none was
    marked" advice (mark_hidden_state / patch()), wrong here, is not given."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from hsoffload.offload import diagnostics
    from hsoffload.offload import scope as scope_mod
    from hsoffload._logging import forget_logged

    forget_logged()
    monkeypatch.setattr(diagnostics, "_bypass_reported", threading.Event())
    monkeypatch.setattr(scope_mod, "_warned_unmarked", threading.Event())
    model = H.tiny_model()
    enable_checkpointing(model)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=deepspeed.checkpointing.checkpoint)
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        _, _, stats = H.train_steps(model, H.batches(1), offload=True, steps=1)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    named = [m for m in messages if "deepspeed.runtime.activation_checkpointing" in m]
    assert len(named) == 1, messages
    assert "use_reentrant" in named[0] and "gradient_checkpointing_func" in named[0]
    assert not any("none was marked" in m for m in messages), messages
    assert stats[0].offloaded_tensors == 0


def test_zero3_parameter_aliases_are_recognised_by_storage_while_gathered() -> None:
    """Issue 28 item 3, the rule itself: a tensor tagged `ds_id` (a ZeRO-3 parameter), a view of it, and a detached
    alias of its gathered data are ZeRO-3 parameters; once the partition is freed (0 elements) nothing aliases it,
    and an activation never does."""
    from hsoffload.offload.passthrough import Zero3Parameters

    weight = torch.nn.Parameter(torch.randn(8, 4))
    weight.ds_id = 7  # what deepspeed.zero.Init sets
    params = Zero3Parameters()
    params.bind([weight, torch.nn.Parameter(torch.randn(3))])
    assert params and params.aliases(weight) and params.aliases(weight.t())
    alias = weight.detach()
    assert not hasattr(alias, "ds_id") and alias._base is None
    assert params.aliases(alias) and params.aliases(alias.t()[1:])
    assert not params.aliases(torch.randn(8, 4))
    weight.data = torch.empty(0)  # released after the module's forward, as ZeRO-3 does
    assert not params.aliases(alias)
