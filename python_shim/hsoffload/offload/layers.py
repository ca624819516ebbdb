"""The decoder layers a scope sees: their order and layer budget, the layer running now, and per-layer counters.

Each decoder-layer call is one `_Visit` and one prefetch group of the engine (`begin_group`/`end_group`), so backward
brings back whole layers `prefetch_depth` layers ahead. The layer budget (`keep_last_layers`, `offload_fraction`)
chooses which layers offload at all. The head rule of policy "all" (saves outside decoder layers after one ran are
the output head's) needs to know when a new forward starts: `reset_head_state_on_forward`.

Thread-safety: a `LayerTracker` belongs to one scope and is used on the thread that entered it (forward). The
module-level hook registry is guarded by its own lock.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from typing import Any, Optional

import torch

from .current import current_scope


def selected_layers(count: int, keep_last_layers: int, offload_fraction: float) -> list[bool]:
    """Which of `count` decoder layers (in forward order) offload: the first ceil(fraction * eligible) of the layers
    before the last `keep_last_layers` (early layers wait longest for backward, so their copies hide best)."""
    eligible = max(count - keep_last_layers, 0)
    chosen = min(eligible, math.ceil(offload_fraction * eligible - 1e-9))
    return [i < chosen for i in range(count)]


@dataclasses.dataclass
class LayerStats:
    """What one decoder layer handed to the host in this scope (summed over its uses)."""

    selected: bool  # chosen by the layer budget (keep_last_layers, offload_fraction) to offload
    calls: int = 0
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0


@dataclasses.dataclass
class _Visit:
    """One decoder-layer call in progress."""

    name: str
    offload: bool
    compiled: bool
    checkpointed: bool
    tensors_before: int
    bytes_before: int
    outer: Optional["_Visit"]


def _stat_pair(engine: Any) -> tuple[int, int]:
    """The scope's offloaded_tensors and offloaded_bytes (the engine's two counters alone: read twice per layer)."""
    tensors, nbytes = engine.offloaded()
    return int(tensors), int(nbytes)


class LayerTracker:
    """Per-scope view of the decoder layers: their order and budget, the layer running now, per-layer counters."""

    def __init__(self, engine: Any, keep_last_layers: int, offload_fraction: float) -> None:
        self._engine = engine
        self._keep_last_layers = keep_last_layers
        self._offload_fraction = offload_fraction
        self._names: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
        self.layers: dict[str, LayerStats] = {}  # by name; `selected` is the layer budget's choice
        self.current: Optional[_Visit] = None
        self.layer_ran = False  # a decoder layer returned in this scope entry: later saves outside layers are "head"
        self.bound = False

    @property
    def budgeted(self) -> bool:
        return self._keep_last_layers > 0 or self._offload_fraction < 1.0

    def bind(self, model: torch.nn.Module, layer_cls: type) -> None:
        # torch.compile(layer) and torch.distributed's checkpoint_wrapper wrap a layer: name it as the layer itself
        layers = [
            (n.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", ""), m)
            for n, m in model.named_modules()
            if isinstance(m, layer_cls)
        ]
        chosen = selected_layers(len(layers), self._keep_last_layers, self._offload_fraction)
        for (name, layer), offload in zip(layers, chosen):
            self._names[layer] = name
            self.layers.setdefault(name, LayerStats(selected=offload))
        self.bound = self.bound or bool(layers)

    def reset_entry(self) -> None:
        """Forget a layer call left open (an exception inside it) and the head state: a new entry or its exit."""
        if self.current is not None:
            self._engine.end_group()
        self.current, self.layer_ran = None, False

    def begin(self, layer: torch.nn.Module, compiled: bool, checkpointed: bool = False) -> _Visit:
        name = self._names.get(layer)
        if name is None:
            if self.budgeted:
                raise RuntimeError(
                    f"hsoffload: keep_last_layers/offload_fraction need the model's layer order, and "
                    f"{type(layer).__name__} is not a layer of a model bound to this scope; pass the model: "
                    "hsoffload.offload_hidden_states(model, ...) or scope.bind_model(model)"
                )
            name = f"{type(layer).__name__}@{id(layer):x}"
            self._names[layer] = name
        stats = self.layers.setdefault(name, LayerStats(selected=True))  # layers of no bound model offload
        stats.calls += 1
        self._engine.begin_group()
        tensors, nbytes = _stat_pair(self._engine)
        self.current = _Visit(name, stats.selected, compiled, checkpointed, tensors, nbytes, self.current)
        return self.current

    def end(self, visit: _Visit) -> None:
        tensors, nbytes = _stat_pair(self._engine)
        stats = self.layers[visit.name]
        stats.offloaded_tensors += tensors - visit.tensors_before
        stats.offloaded_bytes += nbytes - visit.bytes_before
        self.current = visit.outer
        if self.current is not None:  # a nested layer: the outer one's counters exclude what the inner moved
            self.current.tensors_before += tensors - visit.tensors_before
            self.current.bytes_before += nbytes - visit.bytes_before
        if self.current is None:
            self._engine.end_group()
            self.layer_ran = True
        else:
            self._engine.begin_group()  # the rest of the outer layer: a group after the inner one

    def summary(self) -> str:
        """One line: per decoder layer, what went to the host (MiB) or why it stayed."""
        parts = []
        for name, s in self.layers.items():
            if not s.selected:
                parts.append(f"{name}: kept (layer budget)")
            elif s.calls:
                parts.append(f"{name}: {s.offloaded_tensors} tensors {s.offloaded_bytes / 2**20:.2f} MiB")
        return "; ".join(parts)


# The models whose forward pre-hook resets the head rule: installed once per model, process-wide (a model's hooks are
# process-wide by nature); guarded by _hooks_lock and removed by undo().
_hooks_lock = threading.Lock()
_head_reset_models: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()


def reset_head_state_on_forward(model: torch.nn.Module) -> None:
    """Install (once per model) a forward pre-hook on `model` that starts a new forward for the head rule of policy
    "all" (saves outside decoder layers count as the head only after a layer of *this* forward ran), so several
    forwards in one scope entry (gradient accumulation) offload each one's embedding saves."""
    with _hooks_lock:
        if model in _head_reset_models:
            return

        def pre(_m: torch.nn.Module, _args: Any) -> None:
            # Only training forwards start a new forward for the head rule (an eval or no_grad forward in between,
            # such as a reference pass, runs no offloaded layer and must not reset it).
            if not torch.compiler.is_compiling() and torch.is_grad_enabled() and _m.training:
                tracker = getattr(current_scope(), "layer_tracker", None)
                if tracker is not None and tracker.current is None:
                    tracker.layer_ran = False

        _head_reset_models[model] = model.register_forward_pre_hook(pre)


def undo() -> int:
    """Remove every head-rule hook this module installed (`hsoffload.unpatch()`). Returns how many."""
    with _hooks_lock:
        handles = list(_head_reset_models.values())
        _head_reset_models.clear()
    for handle in handles:
        handle.remove()
    return len(handles)
