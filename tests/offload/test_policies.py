"""Offload policies ("hidden_states", "sac", "all", callables) and the layer budget: bitwise parity with the same
training without offload on tiny real models, counters that prove what moved, and the errors and logs around them."""

from __future__ import annotations

import functools
import logging
import warnings

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from support import hf_tiny as H
import hsoffload
from hsoffload._logging import forget_logged
from hsoffload.targets import enable_checkpointing

FAMILIES = ("llama", "qwen3", "mistral")
aten = torch.ops.aten
# What SAC keeps in these tests: matmul outputs (Axolotl's and torchtitan's usual choice); the rest is recomputed.
SAC_OPS = [aten.mm.default, aten.bmm.default, aten.addmm.default]


def _kwargs(**extra: object) -> dict:
    return {"offload_cpu_tensors": True, "min_offload_size": 0, **extra}


def _sac_checkpointing(model: torch.nn.Module, counter: list | None = None) -> None:
    """Non-reentrant checkpointing with a selective context_fn; `counter` collects the tensors SAC saves."""
    H.enable_sac(model, set(SAC_OPS), counter)


def _parity(model: torch.nn.Module, **scope_kwargs: object) -> list[hsoffload.OffloadStats]:
    twin = H.twin(model)
    data = H.batches(3)
    ours = H.train_steps(model, data, offload=True, scope_kwargs=_kwargs(**scope_kwargs))
    ref = H.train_steps(twin, data, offload=False)
    H.assert_bitwise_equal(ours, ref)
    return ours[2]


# ------------------------------------------------------------------------------------------------ validation


def test_bad_policy_and_budget_values_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="policy must be one of 'hidden_states', 'sac', 'all', 'auto' or a callable"):
        hsoffload.OffloadConfig(policy="everything")
    with pytest.raises(ValueError, match=r"offload_fraction must be a number in \[0, 1\]"):
        hsoffload.OffloadConfig(offload_fraction=1.5)
    with pytest.raises(ValueError, match="keep_last_layers must be a non-negative int"):
        hsoffload.OffloadConfig(keep_last_layers=-1)


def test_layer_budget_without_the_model_says_to_pass_it():
    scope = hsoffload.OffloadScope(keep_last_layers=1)
    with pytest.raises(ValueError, match=r"offload_hidden_states\(model, \.\.\.\) or call scope.bind_model"):
        with scope:
            pass


# ------------------------------------------------------------------------------------------------ policy "all"


def _saved_activation_bytes(model: torch.nn.Module, batch: dict) -> int:
    """Bytes of every distinct storage autograd saves in one step, parameters, buffers and their views excepted."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        ptr = x.untyped_storage().data_ptr()
        if ptr not in params and x.numel() > 0:
            seen[ptr] = max(seen.get(ptr, 0), x.untyped_storage().nbytes())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_all_without_checkpointing_is_bitwise_and_offloads_95_percent_of_saved_bytes(family):
    model = H.tiny_model(family)
    total = _saved_activation_bytes(H.twin(model), H.batches(1)[0])
    stats = _parity(model, policy="all", offload_output_head=True)
    assert all(s.offloaded_bytes >= 0.95 * total for s in stats), (stats[0].offloaded_bytes, total)
    assert all(s.restored_tensors >= s.offloaded_tensors for s in stats)
    assert stats[0].prefetch_hits > 0


def test_all_leaves_the_output_head_on_the_device_unless_asked():
    model = H.tiny_model("llama")
    without = _parity(H.twin(model), policy="all")[0]
    with_head = _parity(model, policy="all", offload_output_head=True)[0]
    # The head saves the final hidden states (B*S*H fp32) and the logits' softmax (B*S*V fp32) at least.
    head_bytes = H.BATCH * H.SEQ * (32 + H.VOCAB) * 4
    assert with_head.offloaded_bytes - without.offloaded_bytes >= head_bytes


@pytest.mark.parametrize("reentrant", [False, True])
def test_all_with_checkpointing_offloads_the_checkpoint_inputs(reentrant):
    model = H.tiny_model("llama")
    H.enable_checkpointing(model, reentrant)
    stats = _parity(model, policy="all")
    # Checkpointing keeps only each layer's tensor inputs: its hidden states (cos/sin come as keywords, which the
    # checkpoint closes over); outside the layers the embedding saves its input_ids. Nothing is offloaded while
    # backward recomputes.
    assert all(s.offloaded_tensors == H.LAYERS + 1 for s in stats), stats[0]


def test_all_never_selects_parameters_buffers_or_their_views():
    model = H.tiny_model("llama")
    scope = hsoffload.offload_hidden_states(model, **_kwargs(policy="all"))
    select = scope._selector
    weight = model.model.layers[0].mlp.up_proj.weight
    buffer = next(model.buffers())
    with scope:  # the selector decides during an entry (the bound model's storages are read at entry)
        assert not select(weight) and not select(weight.t()) and not select(weight[0])
        assert not select(buffer) and not select(buffer[None])
        assert select(torch.randn(4, 32)) and select(torch.randn(4, 32, requires_grad=True) * 2)
        select(torch.randn(8, 8).to_sparse())  # no storage to compare: decided without raising (the engine skips it)
        # the storages are re-read at entry: a moved parameter's old address is forgotten
        model.model.layers[0].mlp.up_proj.weight.data = weight.data.clone()
    with scope:
        assert not select(model.model.layers[0].mlp.up_proj.weight.data)
    small = hsoffload.offload_hidden_states(model, policy="all", offload_cpu_tensors=True, min_offload_size=1024)
    assert not small._selector(torch.randn(255)) and small._selector(torch.randn(256))
    cpu_off = hsoffload.offload_hidden_states(model, policy="all", min_offload_size=0)
    assert not cpu_off._selector(torch.randn(256))  # CPU tensors only with offload_cpu_tensors


def test_all_skips_parameter_views_with_lora():
    peft = pytest.importorskip("peft")
    model = H.tiny_model("llama")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    stats = _parity(model, policy="all", offload_output_head=True)
    assert stats[0].offloaded_tensors > 0


# ------------------------------------------------------------------------------------------------ policy "sac"


@pytest.mark.parametrize("family", FAMILIES)
def test_sac_offloads_what_sac_keeps_plus_the_hidden_states_bitwise(family):
    model = H.tiny_model(family)
    saved: list[int] = []
    _sac_checkpointing(model, saved)
    stats = _parity(model, policy="sac")
    per_step = len(saved) // 6  # 3 steps of the model and of its twin (a deepcopy shares the policy function)
    assert per_step > H.LAYERS
    # The first step offloads every tensor SAC keeps; the recompute's early stop ends before each layer's last SAC op
    # (down_proj: autograd saves its inputs before it runs), so that entry is never read ...
    assert stats[0].offloaded_tensors == per_step + H.LAYERS, (stats[0].offloaded_tensors, per_step)
    assert stats[0].restored_tensors == per_step
    # ... and from the second step on it is recomputed instead of copied: every copy is read back (not on torch 2.11,
    # which asks the policy again in the recompute and needs the same answer: there it is copied every step).
    learns = hsoffload.offload.sac.recomputes_unread_entries()
    for s in stats[1:]:
        offloaded = per_step if learns else per_step + H.LAYERS
        assert (s.offloaded_tensors, s.restored_tensors) == (offloaded, per_step), (s.offloaded_tensors, per_step)
    assert all(s.prefetch_hits > 0 for s in stats)
    down_proj = {(aten.mm.default, 6)}
    assert all(hsoffload.offload.sac.layer_memory(layer).unread == down_proj for layer in model.model.layers)


def test_sac_entries_learned_unread_are_recomputed_bitwise_when_a_recompute_reaches_them():
    """What a layer's recompute left unread is recomputed from then on; with early stop off the recompute reaches
    those ops again and recomputes them: still bitwise, and nothing copied goes unread."""
    model = H.tiny_model("llama")
    _sac_checkpointing(model)
    twin = H.twin(model)
    data = H.batches(3)
    first = H.train_steps(model, data[:1], offload=True, steps=1, scope_kwargs=_kwargs(policy="sac"))
    H.assert_bitwise_equal(first, H.train_steps(twin, data[:1], offload=False, steps=1))
    if not hsoffload.offload.sac.recomputes_unread_entries():
        pytest.skip("this torch asks the SAC policy again in the recompute (2.11): unread entries are copied")
    assert all(hsoffload.offload.sac.layer_memory(layer).unread for layer in model.model.layers)

    def without_early_stop(m: torch.nn.Module, batch: dict) -> torch.Tensor:
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            return m(**batch).loss

    ours = H.train_steps(model, data, offload=True, forward=without_early_stop, scope_kwargs=_kwargs(policy="sac"))
    H.assert_bitwise_equal(ours, H.train_steps(twin, data, offload=False, forward=without_early_stop))
    assert all(s.offloaded_tensors == s.restored_tensors == first[2][0].restored_tensors for s in ours[2])


def test_sac_entry_mutated_in_place_raises_under_hidden_states_too():
    """Under "hidden_states" the kept tensors stay on the device (on torch 2.14 they pass through the scope's hook):
    a cached tensor changed in place still raises, by torch's check or by the engine's."""
    x = torch.randn(8, 16, requires_grad=True)
    layer = _mutating_layer()
    hsoffload.patch()
    with pytest.raises(RuntimeError, match="mutated|modified by an inplace operation"):
        with hsoffload.OffloadScope(**_kwargs()) as scope:
            layer(x).sum().backward()
    assert scope.stats.offloaded_tensors == 1  # the input only


def test_sac_with_lora_is_bitwise():
    peft = pytest.importorskip("peft")
    model = H.tiny_model("qwen3")
    _sac_checkpointing(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"]))
    model.enable_input_require_grads()
    stats = _parity(model, policy="sac")
    assert stats[0].offloaded_tensors > H.LAYERS


def test_sac_under_full_checkpointing_offloads_hidden_states_and_says_why(caplog):
    forget_logged()
    model = H.tiny_model("llama")
    H.enable_checkpointing(model, reentrant=False)
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        stats = _parity(model, policy="sac")
    assert all(s.offloaded_tensors == H.LAYERS for s in stats)
    assert any("without a selective context_fn" in r.getMessage() for r in caplog.records)


def _future_warnings(caught: list) -> list:
    return [w for w in caught if issubclass(w.category, FutureWarning) and "saved_tensors_hooks" in str(w.message)]


@pytest.mark.parametrize("policy", ["hidden_states", "sac", "all"])
def test_sac_inside_a_scope_warns_nothing_and_routes_kept_tensors_through_the_hooks_where_torch_can(policy):
    """torch >= 2.14 warns once per SAC-kept tensor when hooks are in scope and respect_saved_tensors_hooks is not
    given (27 a step here before this change); the scope passes True there, so the kept tensors reach its pack hook:
    counted as seen, offloaded only under "sac". Older torch: the storage route, no warning to silence."""
    model = H.tiny_model("llama")
    saved: list[int] = []
    _sac_checkpointing(model, saved)
    full = H.tiny_model("llama")
    H.enable_checkpointing(full, reentrant=False)
    baseline = _parity(full, policy="hidden_states")[0].saved_tensors_seen  # full checkpointing: nothing kept
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = _parity(model, policy=policy)
    assert not _future_warnings(caught), [str(w.message) for w in _future_warnings(caught)][:1]
    kept = len(saved) // 6
    if policy == "hidden_states":
        assert all(s.offloaded_tensors == s.restored_tensors == H.LAYERS for s in stats)
        assert all(s.saved_tensors_seen == baseline + (kept if hsoffload.offload.sac.HOOKS_ROUTE else 0) for s in stats)
    elif policy == "sac":
        assert stats[0].offloaded_tensors == kept + H.LAYERS
    else:  # "all" picks among autograd's saves; what SAC keeps follows the SAC policy alone (as on older torch)
        assert all(s.offloaded_tensors == H.LAYERS + 1 for s in stats)


def test_sac_with_respect_saved_tensors_hooks_false_keeps_the_storage_route():
    if not hsoffload.offload.sac.HOOKS_ROUTE:
        pytest.skip("this torch's checkpoint has no respect_saved_tensors_hooks (the storage route is the only one)")
    model = H.tiny_model("llama")
    saved: list[int] = []
    _sac_checkpointing(model, saved)
    for layer in model.model.layers:
        func = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = functools.partial(
            func.func, *func.args, **func.keywords, respect_saved_tensors_hooks=False
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = _parity(model, policy="sac")
    assert not _future_warnings(caught)
    kept = len(saved) // 6
    assert stats[0].offloaded_tensors == kept + H.LAYERS
    assert all(s.offloaded_tensors == s.restored_tensors == kept for s in stats[1:])


def test_a_model_copied_after_a_sac_step_trains_bitwise_and_carries_no_hsoffload_state():
    model = H.tiny_model("llama")
    _sac_checkpointing(model)
    original = model.model.layers[0]._gradient_checkpointing_func
    with hsoffload.offload_hidden_states(model, **_kwargs(policy="sac")):
        model(**H.batches(1)[0]).loss.backward()
    model.zero_grad(set_to_none=True)
    assert model.model.layers[0]._gradient_checkpointing_func is not original
    copy = H.twin(model)  # a reference model, EMA: copy.deepcopy
    assert copy.model.layers[0]._gradient_checkpointing_func.func is original.func
    stats = _parity(copy, policy="sac")
    assert stats[0].offloaded_tensors > H.LAYERS


# ------------------------------------------------------------------------------------------------ *_CPU_OFFLOAD


def _cpu_offload_checkpointing(model: torch.nn.Module, offload: set, save: set, moved: list) -> None:
    """SAC that asks CheckpointPolicy.MUST_CPU_OFFLOAD for the outputs of `offload`, MUST_SAVE for `save`, recompute
    for the rest; `moved` collects the bytes of each output asked to offload (in forward)."""

    def policy(ctx, op, *args, **kwargs):  # noqa: ANN001, ANN202
        if op in offload:
            if not ctx.is_recompute:
                a, b = args[0], args[1]
                moved.append(a.shape[0] * b.shape[1] * a.element_size())  # mm's output
            return CheckpointPolicy.MUST_CPU_OFFLOAD
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    enable_checkpointing(
        model, {"use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}
    )
    model.train()


@pytest.mark.parametrize("policy", ["hidden_states", "sac"])
def test_must_cpu_offload_outputs_are_offloaded_by_the_engine_and_nothing_else_moves(policy):
    model = H.tiny_model("llama")
    moved: list[int] = []
    _cpu_offload_checkpointing(model, {aten.mm.default}, {aten.bmm.default}, moved)
    hidden_bytes = H.LAYERS * H.BATCH * H.SEQ * 32 * 4
    stats = _parity(model, policy=policy)  # the twin, outside every scope, recomputes them (torch's eager checkpoint)
    per_step = len(moved) // 6  # 7 matmuls a layer
    mm_bytes = sum(moved) // 6
    assert per_step == 7 * H.LAYERS
    bmm = 0 if policy == "hidden_states" else 2 * H.LAYERS  # MUST_SAVE: stays on the device unless policy "sac"
    assert stats[0].offloaded_tensors == H.LAYERS + per_step + bmm
    if policy == "hidden_states":  # exactly the hidden states and the outputs asked for moved, byte for byte
        assert stats[0].offloaded_bytes == hidden_bytes + mm_bytes
    # each layer's down_proj output is never read (the recompute stops before it): recomputed from the second step
    assert stats[0].restored_tensors == stats[0].offloaded_tensors - H.LAYERS
    unread = 0 if hsoffload.offload.sac.recomputes_unread_entries() else H.LAYERS  # torch 2.11: copied every step
    for s in stats[1:]:
        assert (s.offloaded_tensors, s.restored_tensors) == (per_step + bmm + unread, per_step + bmm)
    assert all(s.prefetch_hits > 0 for s in stats)


def _wrap_layers_with_sac(model: torch.nn.Module, policy_fn: object) -> None:
    """FSDP-style activation checkpointing: torch.distributed's CheckpointWrapper around each decoder layer, with a
    selective context_fn (the layers' own gradient checkpointing stays off)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from transformers.modeling_layers import GradientCheckpointingLayer

    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                context_fn=functools.partial(create_selective_checkpoint_contexts, policy_fn))
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, GradientCheckpointingLayer)
    )
    model.config.use_cache = False  # transformers does not know the layers are checkpointed: a cache would grow
    model.train()


@pytest.mark.parametrize("policy", ["hidden_states", "sac"])
def test_checkpoint_wrapper_with_a_selective_context_is_handled_as_the_layers_own(policy):
    """The same SAC, once through transformers' gradient checkpointing and once through CheckpointWrapper: the same
    tensors move (MUST_CPU_OFFLOAD's mm outputs; under "sac" also what MUST_SAVE keeps), bitwise, no FutureWarning."""
    moved: list[int] = []
    layer_ckpt = H.tiny_model("llama")
    _cpu_offload_checkpointing(layer_ckpt, {aten.mm.default}, {aten.bmm.default}, moved)
    wrapped = H.tiny_model("llama")

    def sac(ctx, op, *args, **kwargs):  # noqa: ANN001, ANN202
        if op == aten.mm.default:
            return CheckpointPolicy.MUST_CPU_OFFLOAD
        return CheckpointPolicy.MUST_SAVE if op == aten.bmm.default else CheckpointPolicy.PREFER_RECOMPUTE

    _wrap_layers_with_sac(wrapped, sac)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        via_layers = _parity(layer_ckpt, policy=policy)
        via_wrapper = _parity(wrapped, policy=policy)
    for a, b in zip(via_layers, via_wrapper):
        assert (a.offloaded_tensors, a.offloaded_bytes, a.restored_tensors) == (
            b.offloaded_tensors, b.offloaded_bytes, b.restored_tensors), (a, b)
    assert via_wrapper[0].offloaded_tensors > 7 * H.LAYERS  # the mm outputs moved, not only the hidden states


def test_cpu_offload_in_a_layer_the_budget_keeps_stays_on_the_device():
    model = H.tiny_model("llama")
    moved: list[int] = []
    _cpu_offload_checkpointing(model, {aten.mm.default}, set(), moved)
    twin = H.twin(model)
    data = H.batches(2)
    ours = H.train_steps(model, data, offload=True, steps=2, scope_kwargs=_kwargs(keep_last_layers=1))
    H.assert_bitwise_equal(ours, H.train_steps(twin, data, offload=False, steps=2))
    with hsoffload.offload_hidden_states(model, **_kwargs(keep_last_layers=1)) as scope:
        model(**data[0]).loss.backward()
    layers = scope.layer_stats
    assert layers["model.layers.2"].offloaded_tensors == 0
    unread = 0 if hsoffload.offload.sac.recomputes_unread_entries() else 1  # torch 2.11: down_proj's output copied too
    assert layers["model.layers.0"].offloaded_tensors == layers["model.layers.1"].offloaded_tensors == 1 + 6 + unread


def test_cpu_offload_outside_a_scope_is_said_once(caplog):
    forget_logged()
    model = H.tiny_model("llama")
    moved: list[int] = []
    _cpu_offload_checkpointing(model, {aten.mm.default}, set(), moved)
    twin = H.twin(model)
    hsoffload.patch()
    data = H.batches(2)
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        ours = H.train_steps(model, data, offload=False, steps=2)
    lines = [r.getMessage() for r in caplog.records if "nothing offloads it" in r.getMessage()]
    assert len(lines) == 1 and "MUST_CPU_OFFLOAD" in lines[0], lines
    hsoffload.unpatch()
    H.assert_bitwise_equal(ours, H.train_steps(twin, data, offload=False, steps=2))


class _MutatingLayer:
    """A decoder layer whose SAC-cached matmul output is modified in place after SAC cached it."""


def _mutating_layer() -> torch.nn.Module:
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Mutating(GradientCheckpointingLayer):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16, bias=False)

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            y = torch.mm(hidden_states, self.lin.weight)
            y.mul_(2.0)  # the tensor SAC cached changes afterwards
            return torch.sin(y)

    torch.manual_seed(0)
    layer = Mutating()
    layer.gradient_checkpointing = True
    layer._gradient_checkpointing_func = functools.partial(
        torch.utils.checkpoint.checkpoint,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, [aten.mm.default]),
    )
    return layer


def test_sac_entry_mutated_in_place_raises_with_and_without_offload():
    x = torch.randn(8, 16, requires_grad=True)
    layer = _mutating_layer()
    with pytest.raises(RuntimeError, match="mutated"):
        layer(x).sum().backward()
    hsoffload.patch()
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*hsoffload"):
        with hsoffload.OffloadScope(**_kwargs(policy="sac")) as scope:
            layer(x).sum().backward()
    assert scope.stats.offloaded_tensors == 2  # the input and the cached mm output


def test_sac_allow_cache_entry_mutation_is_not_offloaded_and_logged(caplog):
    forget_logged()
    x = torch.randn(8, 16, requires_grad=True)
    layer = _mutating_layer()
    layer._gradient_checkpointing_func = functools.partial(
        torch.utils.checkpoint.checkpoint,
        use_reentrant=False,
        context_fn=functools.partial(
            create_selective_checkpoint_contexts, [aten.mm.default], allow_cache_entry_mutation=True
        ),
    )
    hsoffload.patch()
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        with hsoffload.OffloadScope(**_kwargs(policy="sac")) as scope:
            layer(x).sum().backward()
    assert scope.stats.offloaded_tensors == 1  # only the input
    assert any("allow_cache_entry_mutation=True" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------------ callables


@pytest.mark.parametrize("family", FAMILIES + ("llama-lora",))
def test_callable_policy_sees_module_names_and_offloads_what_it_picks(family):
    model = H.tiny_model(family.split("-")[0])
    if family.endswith("lora"):
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj"]))
    picked: list[str] = []

    def mlp_only(t: torch.Tensor, name: str) -> bool:
        if ".mlp" in name:
            picked.append(name)
            return True
        return False

    stats = _parity(model, policy=mlp_only)
    assert picked and all(".mlp" in n for n in picked)
    prefix = "base_model.model." if family.endswith("lora") else ""
    assert {n.split(".mlp")[0] for n in picked} == {f"{prefix}model.layers.{i}" for i in range(H.LAYERS)}
    assert 0 < stats[0].offloaded_tensors <= len(picked) // 3


# ------------------------------------------------------------------------------------------------ layer budget


def test_keep_last_layers_and_offload_fraction_choose_layers_and_say_so(caplog):
    forget_logged()
    model = H.tiny_model("llama", layers=4)
    H.enable_checkpointing(model, reentrant=False)
    with caplog.at_level(logging.INFO, logger="hsoffload"):
        stats = _parity(model, keep_last_layers=1)
    assert all(s.offloaded_tensors == 3 for s in stats)
    lines = [r.getMessage() for r in caplog.records if "per layer" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "model.layers.3: kept (layer budget)" in lines[0] and "model.layers.0: 1 tensors" in lines[0]

    with hsoffload.offload_hidden_states(model, **_kwargs(offload_fraction=0.5)) as scope:
        model(**H.batches(1)[0]).loss.backward()
    layers = scope.layer_stats
    assert [layers[f"model.layers.{i}"].selected for i in range(4)] == [True, True, False, False]
    assert [layers[f"model.layers.{i}"].offloaded_tensors for i in range(4)] == [1, 1, 0, 0]


def test_layer_budget_applies_to_policy_all_without_checkpointing():
    model = H.tiny_model("mistral", layers=4)
    full = _parity(H.twin(model), policy="all")[0]
    with hsoffload.offload_hidden_states(model, **_kwargs(policy="all", keep_last_layers=2)) as scope:
        model(**H.batches(1)[0]).loss.backward()
    layers = scope.layer_stats
    assert layers["model.layers.3"].offloaded_tensors == 0 and layers["model.layers.2"].offloaded_tensors == 0
    assert layers["model.layers.0"].offloaded_tensors > 0
    assert scope.stats.offloaded_bytes < full.offloaded_bytes


def test_selected_layers_takes_the_first_share_before_the_kept_ones():
    from hsoffload.offload.layers import selected_layers

    assert selected_layers(8, 2, 1.0) == [True] * 6 + [False] * 2
    assert selected_layers(8, 0, 0.5) == [True] * 4 + [False] * 4
    assert selected_layers(8, 2, 0.5) == [True] * 3 + [False] * 5
    assert selected_layers(3, 5, 1.0) == [False] * 3
    assert selected_layers(4, 0, 0.0) == [False] * 4


# ------------------------------------------------------------------------------------------------ prefetch groups


def test_prefetch_groups_bring_back_a_whole_layer_ahead():
    """Backward of a SAC layer reads its cache in forward order; a group prefetch covers the rest of the layer and
    the layer before it, per-tensor prefetch only the tensor packed before."""

    def run(grouped: bool) -> int:
        engine = torch.classes.hsoffload.OffloadScope(0, True, False, False, 1)
        engine.enter()
        try:
            tensors = [torch.randn(64) for _ in range(4)]
            handles = []
            for i, t in enumerate(tensors):
                if grouped and i % 2 == 0:
                    engine.begin_group()  # groups {0, 1} and {2, 3}
                engine.mark(t)
                handles.append(torch.ops.hsoffload.offload_pack(t, engine.id()))
            engine.end_group()
            for i in (2, 3, 0, 1):  # layer 1 then layer 0, each in forward order
                assert torch.equal(torch.ops.hsoffload.offload_unpack(handles[i]), tensors[i])
            return int(engine.stats()["prefetch_hits"])
        finally:
            engine.exit()

    assert run(grouped=True) == 3
    assert run(grouped=False) < 3


def test_sac_cache_entries_serve_the_dict_and_the_list_layouts_of_torch_releases():
    from hsoffload.offload.sac import _OffloadingEntries

    packed: list[object] = []
    entries = _OffloadingEntries(lambda v: packed.append(v) or v)
    entries.append("a")
    entries.append("b")
    assert entries and entries.pop(0) == "a"
    entries.append("c")
    assert entries.pop(0) == "b" and entries.pop(0) == "c" and not entries
    with pytest.raises(IndexError):
        entries.pop(0)
    entries[0] = "x"
    assert entries.get(0) == "x" and entries.get(1) is None
    assert packed == ["a", "b", "c", "x"]


# ------------------------------------------------------------------------------------------------ wrappers, faults


def test_policies_under_torch_distributed_checkpoint_wrapper():
    """FSDP's activation checkpointing wraps each layer from outside: the wrapper opens the layer's visit, so "all"
    offloads each layer's input inside its own layer (not as the head) and the per-layer counters are right."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from transformers.modeling_layers import GradientCheckpointingLayer

    model = H.tiny_model("llama")
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, GradientCheckpointingLayer)
    )
    for policy in ("hidden_states", "all"):
        with hsoffload.offload_hidden_states(model, **_kwargs(policy=policy, keep_last_layers=1)) as scope:
            model(**H.batches(1)[0], use_cache=False).loss.backward()  # a cache would grow in the recompute
        layers = scope.layer_stats
        assert [layers[f"model.layers.{i}"].offloaded_tensors for i in range(H.LAYERS)] == [1] * (H.LAYERS - 1) + [0]


def test_retain_graph_does_not_prefetch_tensors_backward_has_passed():
    """Second backward of a retained graph: restores of a group must not bring back the group's tensors that the
    current pass has already used (they would sit on the device until the graph dies)."""
    model = H.tiny_model("llama")
    twin = H.twin(model)
    batch = H.batches(1)[0]
    with hsoffload.offload_hidden_states(model, **_kwargs(policy="all", prefetch_depth=1)) as scope:
        loss = model(**batch).loss
        loss.backward(retain_graph=True)
        first = scope.stats
        loss.backward()
    ref = twin(**batch).loss
    ref.backward(retain_graph=True)
    ref.backward()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad)
    second = scope.stats
    # Each pass restores every offloaded tensor once; a pass that re-fetched passed tensors would restore more.
    assert second.restored_tensors == 2 * first.restored_tensors
    assert second.restored_bytes == 2 * first.restored_bytes


def test_exception_inside_a_layer_leaves_no_open_group_or_visit():
    model = H.tiny_model("llama")
    layer = model.model.layers[1]
    original = type(layer).forward

    def boom(self, *args, **kwargs):  # noqa: ANN001
        if self is layer:
            raise RuntimeError("boom inside layer 1")
        return original(self, *args, **kwargs)

    scope = hsoffload.offload_hidden_states(model, **_kwargs(policy="all"))
    type(layer).forward = boom
    try:
        with pytest.raises(RuntimeError, match="boom inside layer 1"):
            with scope:
                model(**H.batches(1)[0]).loss.backward()
    finally:
        type(layer).forward = original
    assert scope.layer_tracker.current is None
    twin = H.twin(model)
    stats = _parity(model, policy="all")  # the next steps are bitwise again and offload per layer
    assert stats[0].offloaded_tensors > 0 and scope.tracked_state() == 0
    del twin


def test_all_offloads_every_forward_of_gradient_accumulation_in_one_entry():
    model = H.tiny_model("llama")
    data = H.batches(2)
    with hsoffload.offload_hidden_states(model, **_kwargs(policy="all")) as one:
        model(**data[0]).loss.backward()
    with hsoffload.offload_hidden_states(model, **_kwargs(policy="all")) as two:
        for batch in data:
            model(**batch).loss.backward()
    assert two.stats.offloaded_tensors == 2 * one.stats.offloaded_tensors


def test_callable_without_the_model_logs_once_and_gets_layer_names(caplog):
    forget_logged()
    model = H.tiny_model("llama")
    hsoffload.patch()
    names: list[str] = []
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        with hsoffload.OffloadScope(**_kwargs(policy=lambda t, n: names.append(n) or True)) as scope:
            model(**H.batches(1)[0]).loss.backward()
    assert any("callable policy without the model" in r.getMessage() for r in caplog.records)
    assert scope.stats.offloaded_tensors > 0 and any(n.startswith("LlamaDecoderLayer@") for n in names)


def test_unpatch_removes_module_hooks_and_restores_sac_context_functions():
    model = H.tiny_model("llama")
    _sac_checkpointing(model)
    original = model.model.layers[0]._gradient_checkpointing_func
    with hsoffload.offload_hidden_states(model, **_kwargs(policy="sac")):
        model(**H.batches(1)[0]).loss.backward()
    with hsoffload.offload_hidden_states(model, **_kwargs(policy=lambda t, n: False)):
        model(**H.batches(1)[0]).loss.backward()
    assert model.model.layers[0]._gradient_checkpointing_func is not original
    assert model._forward_pre_hooks and model.model.layers[0].mlp._forward_hooks
    hsoffload.unpatch()
    assert model.model.layers[0]._gradient_checkpointing_func is original
    assert not model._forward_pre_hooks and not model.model.layers[0].mlp._forward_hooks
