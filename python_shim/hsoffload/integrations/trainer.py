"""Hidden-state offload for `transformers.Trainer` and its subclasses (TRL's `SFTTrainer`, Axolotl's).

One line on an existing trainer::

    trainer = hsoffload.integrations.enable_hidden_state_offload(SFTTrainer(...), min_offload_size=1 << 20)

or, when defining a trainer class, the mixin (keyword `hsoffload_config` on the constructor)::

    class MyTrainer(HiddenStateOffloadMixin, Trainer): ...
    MyTrainer = with_hidden_state_offload(Trainer)  # the same, generated and cached

Why a mixin over `training_step` rather than a `TrainerCallback`: `Trainer.training_step` runs the
forward *and* the backward of one micro-batch, so a `with scope:` around it covers exactly what
must be covered, exits on exceptions, and works unchanged with gradient accumulation and with
subclasses that wrap `training_step` themselves (TRL, Axolotl). Callbacks only see
`on_step_begin`/`on_step_end` around a whole optimizer step and cannot hold a context manager open
safely. `log` is overridden too, so the counters are in `state.log_history` and reach every
reporting callback (a callback's `on_log` runs after `log_history` was written).

Logged keys (added to every training log, each a delta since the previous log except `pool_gib`):
`hsoffload/offloaded_gib`, `hsoffload/restored_gib`, `hsoffload/marked_tensors`,
`hsoffload/offloaded_tensors`, `hsoffload/skipped_marked_tensors`, `hsoffload/prefetch_hits`,
`hsoffload/wait_ms` and `hsoffload/pool_gib` (host pool held now).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from typing import Any, Optional

import torch

from ..offload.patch import check_model, patch, rebind_compiled_layers
from ..offload.config import OffloadConfig
from ..offload.scope import OffloadScope
from ..stats import OffloadStats, is_snapshot
from ..offload.policy import policy_name
from .deepspeed import leave_room_for_zero_offload, trainer_deepspeed_config, zero_offload_host_bytes

logger = logging.getLogger("hsoffload")

_GIB = float(1 << 30)
_STATE_ATTR = "_hsoffload_trainer_state"


def offload_log_values(now: OffloadStats, since: OffloadStats) -> dict[str, float]:
    """The `hsoffload/*` log entries for the counters accumulated between `since` and `now`: one per counter of
    `OffloadStats` (derived from its fields: `*_bytes` in GiB as `*_gib`, `*_ns` in ms as `*_ms`; snapshot counters
    such as `pool_bytes` are the value now, the others the change since the last log)."""
    values: dict[str, float] = {}
    for field in dataclasses.fields(OffloadStats):
        value = getattr(now, field.name) if is_snapshot(field) else getattr(now, field.name) - getattr(since, field.name)
        if field.name.endswith("_bytes"):
            values[f"hsoffload/{field.name[: -len('_bytes')]}_gib"] = value / _GIB
        elif field.name.endswith("_ns"):
            values[f"hsoffload/{field.name[: -len('_ns')]}_ms"] = value / 1e6
        else:
            values[f"hsoffload/{field.name}"] = float(value)
    return values


@dataclasses.dataclass
class _TrainerOffload:
    """Per-trainer offload state: one scope entered once per training step."""

    scope: OffloadScope
    logged: OffloadStats = dataclasses.field(default_factory=OffloadStats)
    checked: bool = False
    reported: bool = False
    layers: Optional[int] = None
    auto_reported: int = 0  # policy auto: the decisions already said in transformers' log

    def first_step(self, trainer: Any) -> None:
        if self.checked:
            return
        self.checked = True
        patch()
        model = getattr(trainer, "model", None)
        layers = None
        if isinstance(model, torch.nn.Module):
            rebind_compiled_layers(model)  # layers compiled at prepare time, before patch()
            layers = check_model(model, policy=self.scope.config.policy)
            self.scope.bind_model(model)
            _keep_auto_state(self.scope, trainer)
        self.scope.report_layers = False  # the trainer logs the per-layer line itself, after the first step
        ds_config = trainer_deepspeed_config(trainer)
        if ds_config is not None and isinstance(model, torch.nn.Module) and zero_offload_host_bytes(ds_config, model):
            leave_room_for_zero_offload(ds_config, model)  # ZeRO-Offload's host states: out of the auto budget
        _report_competing_offload(trainer)
        self.layers = layers

    def after_step(self, trainer: Any) -> None:
        """Once per run, after the first step: what is on, and what each decoder layer offloaded (one line); policy
        auto: each new decision's table."""
        auto = self.scope.auto
        if auto is not None and auto.decisions > self.auto_reported:
            self.auto_reported = auto.decisions
            main = getattr(trainer, "is_world_process_zero", lambda: True)()
            if main:  # the ranks make one decision: said once
                logging.getLogger("transformers.hsoffload").warning("hsoffload: %s: %s", type(trainer).__name__,
                                                                     auto.report())
        if self.reported:
            return
        self.reported = True
        c = self.scope.config
        # Where the trainer's users look: transformers' own logger (its handler and verbosity), at WARNING, the
        # level transformers shows by default.
        logging.getLogger("transformers.hsoffload").warning(
            "hsoffload: offload on for %s (policy=%s, %s decoder layers; min_offload_size=%d, "
            "prefetch_depth=%d, max_host_bytes=%s, spill_dir=%s); first step per layer: %s; counters in the logs "
            "as hsoffload/*",
            type(trainer).__name__,
            policy_name(c.policy),
            self.layers if self.layers is not None else "?",
            c.min_offload_size,
            c.prefetch_depth,
            c.max_host_bytes,
            c.spill_dir,
            self.scope.layer_summary() or "no decoder layer ran",
        )

    def log_values(self) -> dict[str, float]:
        now = self.scope.stats
        values = offload_log_values(now, self.logged)
        self.logged = now
        if self.scope.auto is not None:
            values.update({f"hsoffload/{k}": v for k, v in self.scope.auto.log_values().items()})
        return values


def _keep_auto_state(scope: OffloadScope, trainer: Any) -> None:
    """Policy auto without auto_state_path: its measurements are kept in <output_dir>/hsoffload_auto/ (one file per
    rank). Every run writes them; only a run that resumes (the trainer's state past step 0 at its first step) reads
    them, so that a fresh run in the same folder never decides from an earlier run's file (another model, length or
    attention)."""
    auto = scope.auto
    output_dir = getattr(getattr(trainer, "args", None), "output_dir", None)
    if auto is None or auto.state_path is not None or not output_dir:
        return
    auto.state_path = os.path.join(output_dir, "hsoffload_auto", "rank{rank}.json")
    resumed = int(getattr(getattr(trainer, "state", None), "global_step", 0) or 0) > 0
    auto.restore_state = resumed
    logger.info("hsoffload: policy auto keeps its measurements in %s (auto_state_path): %s", auto.state_path,
                "this run resumes, so they are read (and checked by one step) first" if resumed else
                "a run that resumes from this one reads them; this one does not read an earlier run's")


# Attributes under which TRL (`SFTTrainer`) and Axolotl keep the context of their own activation
# offloading; a `contextlib.nullcontext` there means it is off.
_COMPETING_CONTEXT_ATTRS = ("maybe_activation_offload_context", "activation_offload_context")


def _report_competing_offload(trainer: Any) -> None:
    """TRL's and Axolotl's own activation offloading install inner saved-tensor hooks that take every
    saved tensor before ours: hsoffload would then offload nothing."""
    contexts = [getattr(trainer, a) for a in _COMPETING_CONTEXT_ATTRS if hasattr(trainer, a)]
    if contexts:
        active = any(not isinstance(c, contextlib.nullcontext) for c in contexts)
    else:
        active = bool(getattr(getattr(trainer, "args", None), "activation_offloading", None))
    if not active:
        return
    logger.warning(
        "hsoffload: the trainer also runs its own activation offloading (activation_offloading in its arguments); "
        "its saved-tensor hooks run inside hsoffload's and take the hidden states first. Turn it off, or in "
        "Axolotl use the hsoffload plugin, which replaces it."
    )


def _is_training_log(logs: dict[str, Any]) -> bool:
    """A per-step training log: not evaluation, and not the end-of-training summary (`train_runtime`, ...), whose
    window is the whole run and would get deltas of ~0."""
    return "train_runtime" not in logs and not any(key.startswith(("eval_", "test_")) for key in logs)


def _state(trainer: Any) -> _TrainerOffload:
    state = getattr(trainer, _STATE_ATTR, None)
    if state is None:
        raise RuntimeError(
            "hsoffload: this trainer has no offload state; create it through the HiddenStateOffloadMixin constructor "
            "or call hsoffload.integrations.enable_hidden_state_offload(trainer)"
        )
    return state


def _attach(trainer: Any, config: OffloadConfig) -> None:
    setattr(trainer, _STATE_ATTR, _TrainerOffload(scope=OffloadScope(config)))


class HiddenStateOffloadMixin:
    """Put first in the bases of a `transformers.Trainer` subclass: each `training_step` (forward and
    backward of one micro-batch) runs inside an offload scope, and training logs get `hsoffload/*`
    counters. Constructor keyword: `hsoffload_config` (an `OffloadConfig`; defaults otherwise)."""

    def __init__(self, *args: Any, hsoffload_config: Optional[OffloadConfig] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _attach(self, hsoffload_config if hsoffload_config is not None else OffloadConfig())

    @property
    def hsoffload_scope(self) -> OffloadScope:
        """The offload scope entered around every training step (its `stats` accumulate over the run)."""
        return _state(self).scope

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        state = _state(self)
        state.first_step(self)
        with state.scope:
            out = super().training_step(*args, **kwargs)  # type: ignore[misc]
        state.after_step(self)
        return out

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if _is_training_log(logs):
            logs.update(_state(self).log_values())
        super().log(logs, *args, **kwargs)  # type: ignore[misc]


@functools.lru_cache(maxsize=None)
def with_hidden_state_offload(trainer_cls: type) -> type:
    """`trainer_cls` with `HiddenStateOffloadMixin` in front (one class per input class)."""
    if issubclass(trainer_cls, HiddenStateOffloadMixin):
        return trainer_cls
    return type(f"HiddenStateOffload{trainer_cls.__name__}", (HiddenStateOffloadMixin, trainer_cls), {})


def enable_hidden_state_offload(trainer: Any, config: Optional[OffloadConfig] = None, **kwargs: Any) -> Any:
    """Turn on hidden-state offload for an existing trainer and return it.

    Re-classes `trainer` to `with_hidden_state_offload(type(trainer))` (so every method and attribute it
    had stays as is) and gives it an offload scope built from `config` or the keywords of
    `OffloadConfig`. Calling it again replaces the configuration.
    """
    if config is not None and kwargs:
        raise TypeError("hsoffload: pass either config= or keyword options, not both")
    trainer.__class__ = with_hidden_state_offload(type(trainer))
    _attach(trainer, config if config is not None else OffloadConfig(**kwargs))
    logger.info("hsoffload: hidden-state offload enabled for %s", type(trainer).__name__)
    return trainer
