"""Saved tensors a scope keeps out of the engine's mark matching altogether (issue 28), and their counters.

- Saves made while a backward graph task runs (a reentrant checkpoint's recompute, a tiled MLP's per-shard backward,
  double backward). They are needed at once, so they are never new marked saves, whatever they alias: ZeRO-3's module
  hooks hand a reentrant recompute an alias *with a grad_fn* of the layer input, which the engine's alias rule would
  otherwise take for the marked input itself. Decided by the running graph task, not by the alias's shape. (What
  torch's selective-checkpoint cache keeps is routed before this rule: `sac.state.pending`.)
- Saves inside a decoder layer the layer budget keeps on the device (`keep_last_layers`, `offload_fraction`) under a
  policy that picks saved tensors ("all", "sac", callables): a tensor an earlier layer marked (rotary cos/sin) would
  otherwise get a copy of its own there, since each save copies its own bytes (docs/design.md, "Copy sharing").
- ZeRO-3 parameters (DeepSpeed tags them with `ds_id`) and tensors that alias one: gathered for a module's forward,
  full-shape, and freed after it; a detached alias shares the gathered storage, which the scope's parameter-storage
  set (read at entry, when ZeRO-3 partitions are empty) cannot know. Policies that pick saved tensors ("all", "sac",
  callables) pass them through.

Thread-safety: the hooks run on the thread that saves (forward, or an autograd thread in backward); the counters
take a lock of their own.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Iterable

import torch


def in_backward() -> bool:
    """True while the calling thread runs a node of a backward graph task."""
    return torch._C._current_graph_task_id() != -1


@dataclasses.dataclass(frozen=True)
class PassthroughStats:
    """Saved tensors the scope kept in place without asking the engine (`scope.passthrough_stats`)."""

    backward_saves: int = 0  # saved while a backward graph task ran (never offloaded, never matched as marked)
    zero3_parameters: int = 0  # ZeRO-3 parameters or aliases of one that a policy would have offloaded
    kept_layer_saves: int = 0  # saved inside a layer the layer budget keeps (policies that pick saved tensors)


class PassthroughCounters:
    """The counters behind `PassthroughStats`, safe to bump from autograd's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {f.name: 0 for f in dataclasses.fields(PassthroughStats)}

    def bump(self, name: str) -> None:
        with self._lock:
            self._values[name] += 1

    def snapshot(self) -> PassthroughStats:
        with self._lock:
            return PassthroughStats(**self._values)


class BackwardSave:
    """What the pack hook keeps for a tensor saved during backward: the tensor, in place, and its version (autograd
    no longer checks versions once hooks are installed, so the unpack does)."""

    __slots__ = ("tensor", "version")

    def __init__(self, x: torch.Tensor) -> None:
        # A tensor with a grad_fn may be the output of the node saving it; holding it (and so its grad_fn) from that
        # node would be a reference cycle. detach() shares its storage and version counter.
        self.tensor = x.detach() if x.grad_fn is not None else x
        self.version = x._version

    def unpack(self) -> torch.Tensor:
        now = self.tensor._version
        if now != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation "
                f"(detected by hsoffload's unpack hook for a tensor saved during backward, shape "
                f"{tuple(self.tensor.shape)}, {self.tensor.dtype}): is at version {now}; expected version "
                f"{self.version} instead. Hint: do not modify a tensor in place after autograd saved it, or clone it "
                "first."
            )
        return self.tensor


def is_zero3_parameter(x: torch.Tensor) -> bool:
    """A ZeRO-3 parameter, or a view of one (DeepSpeed sets `ds_id` on the parameters it partitions)."""
    return hasattr(x, "ds_id") or (x._base is not None and hasattr(x._base, "ds_id"))


class Zero3Parameters:
    """The ZeRO-3 parameters of the models a scope serves, to recognise aliases of the gathered ones by storage."""

    def __init__(self) -> None:
        self._params: "list[weakref.ref[torch.Tensor]]" = []

    def bind(self, parameters: Iterable[torch.Tensor]) -> None:
        """Replace the tracked parameters by those of `parameters` that ZeRO-3 partitions."""
        self._params = [weakref.ref(p) for p in parameters if hasattr(p, "ds_id")]

    def __bool__(self) -> bool:
        return bool(self._params)

    def aliases(self, x: torch.Tensor) -> bool:
        """Whether `x` is, views or shares the storage of a ZeRO-3 parameter gathered now (a partition outside a
        gather is a 0-element tensor: nothing can alias it). O(parameters) per call: asked only of tensors a policy
        would otherwise offload."""
        if is_zero3_parameter(x):
            return True
        if not self._params or x.layout != torch.strided or x.is_nested:
            return False
        ptr = x.untyped_storage().data_ptr()
        for ref in self._params:
            p = ref()
            if p is not None and p.numel() > 0 and p.layout == torch.strided and p.untyped_storage().data_ptr() == ptr:
                return True
        return False


def is_zero3_model(model: Any) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions any parameter of `model`."""
    return isinstance(model, torch.nn.Module) and any(hasattr(p, "ds_id") for p in model.parameters())
