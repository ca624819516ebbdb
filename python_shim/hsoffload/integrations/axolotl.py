"""Drop-in for Axolotl's `axolotl.monkeypatch.checkpoint_activation_offload`, backed by hsoffload.

Same names, signatures and defaults::

    from hsoffload.axolotl import (
        CheckpointHiddenStatesOffload,
        get_checkpoint_hidden_states_offloading_ctx_manager,
        patch_gradient_checkpointing_layer_marker,
    )

Observable behaviour kept: a `saved_tensors_hooks` context manager that offloads only the marked
inputs of checkpointed `GradientCheckpointingLayer`s; entering it installs the layer marker and
resets `stats`; on an accelerator one marked/offloaded/restored tensor per checkpointed layer call;
on CPU a marked tensor counts as skipped (`skipped_marked_tensors`); parameters and buffers are
never offloaded. Differences (see docs/axolotl.md): keyword `hidden_states` is offloaded too,
marks are counted when autograd saves the tensor (not when `mark()` is called), `stats` is a
snapshot, and the two buffer-count knobs are accepted but the host pool is bounded in bytes.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any

import torch

from ..offload.patch import patch
from ..offload.config import OffloadConfig
from ..offload.current import entered_on_this_thread
from ..offload.scope import OffloadScope
from ..stats import OffloadStats, from_engine

logger = logging.getLogger("hsoffload")

__all__ = [
    "CheckpointActivationOffloadStats",
    "CheckpointHiddenStatesOffload",
    "get_checkpoint_hidden_states_offloading_ctx_manager",
    "patch_gradient_checkpointing_layer_marker",
    "patch_initialize_missing_keys_for_fsdp",
]


@dataclasses.dataclass
class CheckpointActivationOffloadStats:
    """Axolotl's counters (a subset of `hsoffload.OffloadStats`), plus the spill tier's."""

    saved_tensors_seen: int = 0
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0
    # hsoffload's host budget and spill tier (not in Axolotl's module; extra fields keep its code working)
    spilled_tensors: int = 0
    spilled_bytes: int = 0
    spill_read_wait_ns: int = 0
    kept_on_device_tensors: int = 0


_AXOLOTL_FIELDS = tuple(f.name for f in dataclasses.fields(CheckpointActivationOffloadStats))


def patch_gradient_checkpointing_layer_marker() -> None:
    """Install the `GradientCheckpointingLayer.__call__` marker (idempotent; `hsoffload.unpatch()` reverts it)."""
    patch()


class CheckpointHiddenStatesOffload(OffloadScope):
    """Offload only marked checkpoint inputs (decoder-layer hidden states); everything else passes through.

    A `torch.autograd.graph.saved_tensors_hooks` (through `hsoffload.OffloadScope`). Enter it around
    forward and backward of a step; it may be entered again for every step.
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_size: int = 1024,
        max_fwd_stash_size: int = 2,
        max_cpu_buffer_pool_size: int = 64,
    ) -> None:
        super().__init__(
            OffloadConfig(
                min_offload_size=min_offload_size,
                offload_cpu_tensors=False,  # Axolotl: CPU tensors are never copied, they count as skipped
                pin_memory=use_pin_memory,
                use_streams=use_streams,
            )
        )
        for name, value in (
            ("max_fwd_stash_size", max_fwd_stash_size),
            ("max_cpu_buffer_pool_size", max_cpu_buffer_pool_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"hsoffload: {name} must be a non-negative int, got {value!r}")
        self.use_pin_memory = use_pin_memory
        self.use_streams = use_streams
        self.min_tensor_size_bytes = min_offload_size
        # Accepted for signature compatibility. hsoffload keeps no forward stash (the device tensor is
        # released through the allocator's stream tracking once its copy is done) and bounds its host
        # pool in bytes (OffloadConfig.max_pool_bytes), not in buffers.
        self.max_fwd_stash_size = max_fwd_stash_size
        self.max_cpu_buffer_pool_size = max_cpu_buffer_pool_size
        self._stats = CheckpointActivationOffloadStats()
        self._synced = OffloadStats()  # engine counters already added into self._stats
        self._depth = 0  # nested entries of this instance on its thread (Axolotl's module accepts them)

    def _engine_stats(self) -> OffloadStats:
        engine = from_engine(OffloadStats, self._scope.stats())
        # Saves made during backward or in a kept layer stay in the shim (hsoffload.offload.passthrough) and never reach the
        # engine; Axolotl's module counts every tensor its pack hook sees, so they count here too.
        kept = self.passthrough_stats
        seen = engine.saved_tensors_seen + kept.backward_saves + kept.kept_layer_saves
        return dataclasses.replace(engine, saved_tensors_seen=seen)

    @property
    def stats(self) -> CheckpointActivationOffloadStats:  # type: ignore[override]
        """Counters since the last `reset()` (every outermost `__enter__` resets). As in Axolotl's module, one
        mutable object: what the engine counted since the last read is added to it, so the caller's own changes to
        it are kept, and it may be replaced (`ctx.stats = CheckpointActivationOffloadStats()`)."""
        now = self._engine_stats()
        for name in _AXOLOTL_FIELDS:
            setattr(self._stats, name, getattr(self._stats, name) + getattr(now, name) - getattr(self._synced, name))
        self._synced = now
        return self._stats

    @stats.setter
    def stats(self, value: CheckpointActivationOffloadStats) -> None:
        if not isinstance(value, CheckpointActivationOffloadStats):
            raise TypeError(
                f"hsoffload: CheckpointHiddenStatesOffload.stats must be a CheckpointActivationOffloadStats, got "
                f"{type(value).__name__}"
            )
        self._stats = value
        self._synced = self._engine_stats()  # counting continues from here, into the new object

    def mark(self, tensor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Mark `tensor` for offload when autograd saves it in this scope. Parameters and buffers are never marked."""
        if isinstance(tensor, torch.nn.Parameter) or (
            hasattr(torch.nn, "Buffer") and isinstance(tensor, torch.nn.Buffer)
        ):
            return tensor
        return super().mark(tensor)

    def reset(self) -> None:
        """Zero `stats`. Unlike Axolotl's, host copies that an autograd graph still needs are kept."""
        self.stats = CheckpointActivationOffloadStats()

    def __enter__(self) -> "CheckpointHiddenStatesOffload":
        if self._depth > 0 and entered_on_this_thread(self):
            # `with ctx: with ctx:` (Axolotl's module accepts it): the inner entry resets the stats, as Axolotl's
            # does, and the outer entry's scope stays in charge; from another thread the engine refuses it.
            self._depth += 1
            self.reset()
            return self
        patch_gradient_checkpointing_layer_marker()
        super().__enter__()  # raises (touching nothing) if the scope is active on another thread
        self.reset()
        self._depth = 1
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._depth > 1:
            self._depth -= 1
            return
        self._depth = 0
        super().__exit__(exc_type, exc, tb)


def get_checkpoint_hidden_states_offloading_ctx_manager(
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_size: int = 1024,
    max_fwd_stash_size: int = 2,
    max_cpu_buffer_pool_size: int = 64,
) -> CheckpointHiddenStatesOffload:
    """Axolotl's factory: a `CheckpointHiddenStatesOffload` with these settings."""
    return CheckpointHiddenStatesOffload(
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        min_offload_size=min_offload_size,
        max_fwd_stash_size=max_fwd_stash_size,
        max_cpu_buffer_pool_size=max_cpu_buffer_pool_size,
    )


def __getattr__(name: str) -> Any:
    # `patch_initialize_missing_keys_for_fsdp` lives in hsoffload.fsdp; imported on first use so that
    # this module works (and imports fast) without it.
    if name == "patch_initialize_missing_keys_for_fsdp":
        try:
            fsdp = importlib.import_module("hsoffload.fsdp")
        except ImportError as exc:
            raise AttributeError(
                "hsoffload.axolotl.patch_initialize_missing_keys_for_fsdp needs hsoffload.fsdp, which failed to "
                f"import: {exc}"
            ) from exc
        return getattr(fsdp, name)
    raise AttributeError(f"module 'hsoffload.axolotl' has no attribute {name!r}")
