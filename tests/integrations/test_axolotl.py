"""The Axolotl drop-in (`hsoffload.axolotl`) and plugin (`hsoffload.axolotl_plugin`), without Axolotl installed."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from support import hf_tiny as H
import hsoffload
from hsoffload.axolotl import (
    CheckpointActivationOffloadStats,
    CheckpointHiddenStatesOffload,
    get_checkpoint_hidden_states_offloading_ctx_manager,
    patch_gradient_checkpointing_layer_marker,
)
from hsoffload.axolotl_plugin import HsOffloadPlugin, is_enabled, offload_config, validate_config

AXOLOTL_DEFAULTS = {
    "use_pin_memory": True,
    "use_streams": True,
    "min_offload_size": 1024,
    "max_fwd_stash_size": 2,
    "max_cpu_buffer_pool_size": 64,
}
STAT_FIELDS = [
    "saved_tensors_seen",
    "marked_tensors",
    "offloaded_tensors",
    "restored_tensors",
    "skipped_marked_tensors",
    "offloaded_bytes",
    "restored_bytes",
]
SPILL_FIELDS = ["spilled_tensors", "spilled_bytes", "spill_read_wait_ns", "kept_on_device_tensors"]
ON_ACCELERATOR = torch.cuda.is_available()
DEVICE = "cuda" if ON_ACCELERATOR else "cpu"


def tiny_layer(reentrant: bool = False) -> torch.nn.Module:
    return H.tiny_layer(reentrant, width=64).to(DEVICE)


def hidden(requires_grad: bool = True) -> torch.Tensor:
    return torch.randn(8, 64, device=DEVICE, requires_grad=requires_grad) * 1.0  # a non-leaf, like a real one


def _params(fn: Any) -> dict[str, Any]:
    return {n: p.default for n, p in inspect.signature(fn).parameters.items() if n != "self"}


def test_signatures_and_defaults_match_axolotl() -> None:
    assert _params(CheckpointHiddenStatesOffload.__init__) == AXOLOTL_DEFAULTS
    assert _params(get_checkpoint_hidden_states_offloading_ctx_manager) == AXOLOTL_DEFAULTS
    assert _params(patch_gradient_checkpointing_layer_marker) == {}
    assert issubclass(CheckpointHiddenStatesOffload, torch.autograd.graph.saved_tensors_hooks)


def test_stats_dataclass() -> None:
    # Axolotl's fields first, in its order; then the spill tier's.
    assert [f.name for f in dataclasses.fields(CheckpointActivationOffloadStats)] == STAT_FIELDS + SPILL_FIELDS
    stats = CheckpointActivationOffloadStats()
    assert all(getattr(stats, f) == 0 for f in STAT_FIELDS)
    stats.marked_tensors += 1  # mutable, like Axolotl's
    offload = CheckpointHiddenStatesOffload()
    assert isinstance(offload.stats, CheckpointActivationOffloadStats)


def test_factory_passes_every_keyword() -> None:
    offload = get_checkpoint_hidden_states_offloading_ctx_manager(
        use_pin_memory=False, use_streams=False, min_offload_size=7, max_fwd_stash_size=3, max_cpu_buffer_pool_size=5
    )
    assert isinstance(offload, CheckpointHiddenStatesOffload)
    assert (offload.use_pin_memory, offload.use_streams, offload.min_tensor_size_bytes) == (False, False, 7)
    assert (offload.max_fwd_stash_size, offload.max_cpu_buffer_pool_size) == (3, 5)
    assert offload.config == hsoffload.OffloadConfig(min_offload_size=7, pin_memory=False, use_streams=False)
    with pytest.raises(ValueError, match="max_fwd_stash_size"):
        CheckpointHiddenStatesOffload(max_fwd_stash_size=-1)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("keyword", [False, True])
def test_one_mark_per_checkpointed_layer_call(reentrant: bool, keyword: bool) -> None:
    hsoffload.unpatch()
    layer = tiny_layer(reentrant)
    x = hidden()
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_size=0)
    with offload:  # entering installs the marker
        assert hsoffload.is_patched()
        loss = (layer(hidden_states=x) if keyword else layer(x)).sum()
        loss.backward()
    stats = offload.stats
    assert stats.marked_tensors == 1
    assert stats.saved_tensors_seen >= stats.marked_tensors
    if ON_ACCELERATOR:
        assert (stats.offloaded_tensors, stats.restored_tensors, stats.skipped_marked_tensors) == (1, 1, 0)
        assert stats.offloaded_bytes == stats.restored_bytes == x.numel() * x.element_size()
    else:  # Axolotl's CPU semantics: a marked CPU tensor is kept and counted as skipped
        assert (stats.offloaded_tensors, stats.restored_tensors, stats.skipped_marked_tensors) == (0, 0, 1)


def test_unmarked_saved_tensors_pass_through() -> None:
    linear = torch.nn.Linear(8, 8).to(DEVICE)
    x = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_size=0)
    with offload:
        linear(x).square().sum().backward()
    assert x.grad is not None
    assert offload.stats.saved_tensors_seen > 0
    assert offload.stats.marked_tensors == 0
    assert offload.stats.offloaded_tensors == 0


def test_enter_resets_stats_and_reset_zeroes() -> None:
    layer = tiny_layer()
    offload = CheckpointHiddenStatesOffload(min_offload_size=0)
    for _ in range(3):
        with offload:
            layer(hidden()).sum().backward()
        assert offload.stats.marked_tensors == 1  # per entry, not accumulated
    with offload:
        layer(hidden()).sum().backward()
        offload.reset()
        assert offload.stats == CheckpointActivationOffloadStats()


def test_stats_is_one_mutable_object_that_can_be_assigned() -> None:
    """As in Axolotl's module: `ctx.stats = ...` works and in-place changes to it are kept."""
    layer = tiny_layer()
    offload = CheckpointHiddenStatesOffload(min_offload_size=0)
    with offload:
        layer(hidden()).sum().backward()
        stats = offload.stats
        assert offload.stats is stats and stats.marked_tensors == 1
        stats.marked_tensors += 10  # a caller's own bookkeeping
        layer(hidden()).sum().backward()
        assert offload.stats.marked_tensors == 12
        offload.stats = CheckpointActivationOffloadStats(marked_tensors=100)
        layer(hidden()).sum().backward()
        assert offload.stats.marked_tensors == 101
    with pytest.raises(TypeError, match="CheckpointActivationOffloadStats"):
        offload.stats = {"marked_tensors": 0}  # type: ignore[assignment]


def test_nested_entry_of_one_instance_is_accepted() -> None:
    layer = tiny_layer()
    offload = CheckpointHiddenStatesOffload(min_offload_size=0)
    with offload:
        with offload:  # Axolotl's module accepts this; the inner entry does nothing
            layer(hidden()).sum().backward()
        assert offload.active  # the outer entry is still in charge
        layer(hidden()).sum().backward()
    assert not offload.active
    assert offload.stats.marked_tensors == 2
    from hsoffload.offload.current import current_scope

    assert current_scope() is None


def test_a_manual_mark_counts_once_however_often_it_is_saved() -> None:
    x = hidden().requires_grad_()
    offload = CheckpointHiddenStatesOffload(min_offload_size=0)
    with offload:
        h = offload.mark(x * 2)
        (h * h.sin() * h.cos()).sum().backward()  # h is saved by several nodes
    assert offload.stats.marked_tensors == 1, offload.stats


def test_parameters_are_never_marked() -> None:
    weight = torch.nn.Parameter(torch.randn(64, 64, device=DEVICE))
    offload = CheckpointHiddenStatesOffload(min_offload_size=0)
    with offload:
        assert offload.mark(weight) is weight
        (hidden() @ weight).sum().backward()
    assert offload.stats.marked_tensors == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_tiny_llama_bitwise_with_drop_in(reentrant: bool) -> None:
    model = H.tiny_model("llama")
    H.enable_checkpointing(model, reentrant)
    reference = H.twin(model)
    data = H.batches(2)
    offload = get_checkpoint_hidden_states_offloading_ctx_manager(min_offload_size=0)

    def step(m: torch.nn.Module, ctx: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with ctx:
            loss = m(**batch).loss
            loss.backward()
        return loss.detach()

    for batch in data:
        assert torch.equal(step(model, offload, batch), step(reference, contextlib.nullcontext(), batch))
        assert offload.stats.marked_tensors == H.LAYERS
        assert offload.stats.skipped_marked_tensors == (0 if ON_ACCELERATOR else H.LAYERS)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_fsdp_loading_patch_is_reexported() -> None:
    fsdp = pytest.importorskip("hsoffload.fsdp")
    from hsoffload.axolotl import patch_initialize_missing_keys_for_fsdp

    assert patch_initialize_missing_keys_for_fsdp is fsdp.patch_initialize_missing_keys_for_fsdp


# --- plugin -----------------------------------------------------------------


class Cfg(dict):
    """Axolotl's DictDefault in miniature: attribute access, None for missing keys."""

    def __getattr__(self, key: str) -> Any:
        return self.get(key)


class AxolotlLikeTrainer(transformers.Trainer):
    """What Axolotl's ActivationOffloadingMixin does: enter `activation_offload_context` around each step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.activation_offload_context = get_checkpoint_hidden_states_offloading_ctx_manager()
        self.entered = 0

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.activation_offload_context:
            self.entered += 1
            return super().training_step(*args, **kwargs)


def _trainer(tmp_path: Path) -> AxolotlLikeTrainer:
    from test_trainer import TokenDataset, training_args

    args = training_args(tmp_path, max_steps=2, logging_steps=1, gradient_accumulation_steps=1)
    return AxolotlLikeTrainer(model=H.tiny_model("llama"), args=args, train_dataset=TokenDataset())


def test_plugin_imports_without_axolotl() -> None:
    if importlib.util.find_spec("axolotl") is not None:
        pytest.skip("axolotl is installed here")
    module = importlib.import_module("hsoffload.axolotl_plugin")
    assert module.BasePlugin.__module__ == "hsoffload.integrations.axolotl_plugin"
    assert "axolotl" not in sys.modules


def test_plugin_config_keys() -> None:
    plugin = HsOffloadPlugin()
    module_name, cls_name = plugin.get_input_args().rsplit(".", 1)
    schema = getattr(importlib.import_module(module_name), cls_name)
    parsed = schema(hsoffload_min_offload_size=4096, hsoffload_prefetch_depth=2)
    assert parsed.hsoffload_min_offload_size == 4096
    cfg = Cfg(activation_offloading="hidden_states", hsoffload_min_offload_size=4096, hsoffload_max_pool_bytes=1 << 30)
    assert is_enabled(cfg)
    assert offload_config(cfg) == hsoffload.OffloadConfig(min_offload_size=4096, max_pool_bytes=1 << 30)
    assert offload_config(Cfg()) == hsoffload.OffloadConfig()
    assert not is_enabled(Cfg(activation_offloading=True))
    assert not is_enabled(Cfg(activation_offloading="legacy"))
    policy_cfg = Cfg(activation_offloading="hidden_states", hsoffload_policy="all", hsoffload_keep_last_layers=2,
                     hsoffload_offload_fraction=0.5, hsoffload_offload_output_head=True)
    validate_config(policy_cfg)
    assert offload_config(policy_cfg) == hsoffload.OffloadConfig(
        policy="all", keep_last_layers=2, offload_fraction=0.5, offload_output_head=True
    )
    parsed = schema(hsoffload_policy="sac", hsoffload_offload_fraction=0.25)
    assert parsed.hsoffload_policy == "sac"
    for key, bad in (("hsoffload_policy", "everything"), ("hsoffload_offload_fraction", 1.5),
                     ("hsoffload_keep_last_layers", -1)):
        with pytest.raises(ValueError, match=key):
            validate_config(Cfg(**{key: bad}))


def test_plugin_wires_hsoffload_into_the_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin_module = importlib.import_module("hsoffload.axolotl_plugin")

    class AxolotlReentrantOffload(torch.utils.checkpoint.CheckpointFunction):  # stands in for Axolotl's swap
        pass

    monkeypatch.setattr(torch.utils.checkpoint, "CheckpointFunction", AxolotlReentrantOffload)
    cfg = Cfg(
        activation_offloading="hidden_states",
        gradient_checkpointing=True,
        hsoffload_min_offload_size=0,
        hsoffload_offload_cpu_tensors=True,
    )
    plugin = HsOffloadPlugin()
    hsoffload.unpatch()
    plugin.pre_model_load(cfg)
    assert hsoffload.is_patched()
    trainer = _trainer(tmp_path)
    plugin.post_trainer_create(cfg, trainer)

    assert torch.utils.checkpoint.CheckpointFunction is plugin_module._TORCH_CHECKPOINT_FUNCTION
    assert isinstance(trainer.activation_offload_context, contextlib.nullcontext)
    assert isinstance(trainer, AxolotlLikeTrainer)
    assert trainer.hsoffload_scope.config == offload_config(cfg)
    trainer.train()
    assert trainer.entered == 2  # Axolotl's step wrapper still runs, with its context now a no-op
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["hsoffload/offloaded_tensors"] for entry in logs] == [H.LAYERS, H.LAYERS]


def test_plugin_leaves_other_modes_alone(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    context = trainer.activation_offload_context
    HsOffloadPlugin().post_trainer_create(Cfg(activation_offloading=True, gradient_checkpointing=True), trainer)
    assert trainer.activation_offload_context is context
    assert type(trainer) is AxolotlLikeTrainer


def test_plugin_warns_without_checkpointing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        HsOffloadPlugin().post_trainer_create(Cfg(activation_offloading="hidden_states"), _trainer(tmp_path))
    assert "needs gradient_checkpointing: true" in caplog.text


def test_plugin_installs_fsdp_loading_patch_for_ram_efficient_loading() -> None:
    from hsoffload import fsdp
    from hsoffload.axolotl_plugin import HsOffloadPlugin

    assert not fsdp.is_patched()
    HsOffloadPlugin().pre_model_load(Cfg(fsdp_config={"cpu_ram_efficient_loading": False}))
    assert not fsdp.is_patched()
    try:
        HsOffloadPlugin().pre_model_load(Cfg(fsdp_version=2, fsdp_config={"cpu_ram_efficient_loading": True}))
        assert fsdp.is_patched()
    finally:
        fsdp.unpatch()
    assert not fsdp.is_patched()


def test_plugin_installs_zero3_loading_patch_when_asked_with_a_zero3_deepspeed_config(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`hsoffload_zero3_loading: true` with a ZeRO-3 `deepspeed` config (a path, as Axolotl's configs give it, a dict
    as Axolotl holds it after loading, or base64 JSON as transformers accepts) installs hsoffload.zero3_loading before
    the model loads. Not asked, or with ZeRO-2, it does not; asked where it cannot apply, it warns once naming the
    value. What the patch does on 2 ranks: tests/loading/test_zero3_loading.py."""
    pytest.importorskip("deepspeed")
    import base64

    from hsoffload import _logging, zero3_loading
    from hsoffload.axolotl_plugin import deepspeed_zero_stage

    zero3 = tmp_path / "zero3.json"
    zero3.write_text('{"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}')
    zero2 = tmp_path / "zero2.json"
    zero2.write_text('{"zero_optimization": {"stage": 2}}')
    encoded = base64.urlsafe_b64encode(zero3.read_bytes()).decode()
    assert not zero3_loading.is_patched()
    assert deepspeed_zero_stage(Cfg()) is None and deepspeed_zero_stage(Cfg(deepspeed=str(zero2))) == 2
    assert deepspeed_zero_stage(Cfg(deepspeed=encoded)) == 3
    assert deepspeed_zero_stage(Cfg(deepspeed=str(tmp_path / "missing.json"))) is None
    try:
        for cfg in (Cfg(deepspeed=str(zero3)), Cfg(deepspeed=str(zero3), hsoffload_zero3_loading=False),
                    Cfg(deepspeed=str(zero2), hsoffload_zero3_loading=True)):
            HsOffloadPlugin().pre_model_load(cfg)
            assert not zero3_loading.is_patched(), cfg
        for ds in (str(zero3), {"zero_optimization": {"stage": 3}}, encoded):
            HsOffloadPlugin().pre_model_load(Cfg(deepspeed=ds, hsoffload_zero3_loading=True))
            assert zero3_loading.is_patched() and zero3_loading._settings["verify"] is False, ds
            zero3_loading.unpatch()
        HsOffloadPlugin().pre_model_load(Cfg(deepspeed=str(zero3), hsoffload_zero3_loading=True,
                                             hsoffload_zero3_loading_verify=True))
        assert zero3_loading.is_patched() and zero3_loading._settings["verify"] is True
        zero3_loading.unpatch()
    finally:
        zero3_loading.unpatch()
    assert not zero3_loading.is_patched()
    _logging.forget_logged()
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        HsOffloadPlugin().pre_model_load(Cfg(deepspeed=str(tmp_path / "missing.json"), hsoffload_zero3_loading=True))
    assert "hsoffload_zero3_loading: true does nothing here" in caplog.text and "missing.json" in caplog.text
    assert not zero3_loading.is_patched()
    with pytest.raises(ValueError, match="hsoffload_zero3_loading"):
        HsOffloadPlugin().register(Cfg(hsoffload_zero3_loading="yes"))


def test_plugin_refuses_unknown_keys_naming_the_closest() -> None:
    plugin = HsOffloadPlugin()
    with pytest.raises(ValueError, match="unknown Axolotl config key hsoffload_prefetch_dept; did you mean "
                       "hsoffload_prefetch_depth"):
        plugin.register(Cfg(activation_offloading="hidden_states", hsoffload_prefetch_dept=2))
    with pytest.raises(ValueError, match="hsoffload_frobnicate; known keys: hsoffload_min_offload_size"):
        plugin.register(Cfg(hsoffload_frobnicate=1))
    plugin.register(Cfg(activation_offloading="hidden_states", hsoffload_prefetch_depth=2, other_key=3))


@pytest.mark.parametrize(
    "key, value",
    [("hsoffload_prefetch_depth", -1), ("hsoffload_min_offload_size", "1k"), ("hsoffload_max_pool_bytes", -5),
     ("hsoffload_use_streams", "yes"), ("hsoffload_offload_cpu_tensors", 1), ("hsoffload_prefetch_depth", True)],
)
def test_plugin_refuses_invalid_values_before_the_model_loads(key: str, value: Any) -> None:
    plugin = HsOffloadPlugin()
    with pytest.raises(ValueError, match=rf"{key}: .* is not allowed; expected"):
        plugin.register(Cfg(activation_offloading="hidden_states", **{key: value}))
    with pytest.raises(ValueError, match=key):  # and again at pre_model_load, for Axolotls that pass no cfg
        plugin.pre_model_load(Cfg(activation_offloading="hidden_states", **{key: value}))
    module_name, cls_name = plugin.get_input_args().rsplit(".", 1)
    schema = getattr(importlib.import_module(module_name), cls_name)
    with pytest.raises(Exception, match=key):  # Axolotl's own pydantic config check refuses it too
        schema(**{key: value})


def test_plugin_messages_reach_axolotls_log_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Axolotl shows other libraries' records only from WARNING up; the plugin routes hsoffload's INFO lines into
    the `axolotl` logger tree, whose handlers show INFO. WARNING lines are not duplicated."""
    from hsoffload._logging import ForwardInfo

    seen: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    class OnlyAxolotlOrWarnings(logging.Filter):  # what Axolotl's root console handler does
        def filter(self, record: logging.LogRecord) -> bool:
            return record.name.startswith("axolotl") or record.levelno >= logging.WARNING

    root_console = Collect(logging.NOTSET)
    root_console.addFilter(OnlyAxolotlOrWarnings())
    monkeypatch.setattr(logging.getLogger(), "handlers", [root_console])
    axolotl_logger = logging.getLogger("axolotl")
    collect = Collect(logging.INFO)
    old_level, old_propagate = axolotl_logger.level, axolotl_logger.propagate
    axolotl_logger.addHandler(collect)
    axolotl_logger.setLevel(logging.INFO)
    axolotl_logger.propagate = False  # as Axolotl's logging config has it
    hs = logging.getLogger("hsoffload")
    hs_level = hs.level
    try:
        HsOffloadPlugin().register(None)
        HsOffloadPlugin().register(None)  # idempotent: one forwarding handler
        assert sum(isinstance(h, ForwardInfo) for h in hs.handlers) == 1
        hs.info("hsoffload: an info line for the user")
        hs.warning("hsoffload: a warning line")
        # The INFO line once, through Axolotl's logger; the WARNING once, through the root console.
        assert [(r.name, r.getMessage()) for r in seen] == [
            ("axolotl.integrations.hsoffload", "hsoffload: an info line for the user"),
            ("hsoffload", "hsoffload: a warning line"),
        ]
    finally:
        for h in [h for h in hs.handlers if isinstance(h, ForwardInfo)]:
            hs.removeHandler(h)
        hs.setLevel(hs_level)
        axolotl_logger.removeHandler(collect)
        axolotl_logger.setLevel(old_level)
        axolotl_logger.propagate = old_propagate
