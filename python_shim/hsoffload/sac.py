"""Policy "sac": offload what torch's selective-checkpoint cache keeps for a layer's recompute.

torch's `create_selective_checkpoint_contexts` returns two dispatch modes sharing one cache: the forward stores the
outputs the user's SAC policy saves, the recompute reads them back. Inside an offloaded layer of a "sac" scope,
`OffloadingContextFn` swaps that cache for one whose entries hold engine handles (packed when stored, restored when
the recompute reads them), so the engine's host copy, budget, spill and prefetch serve SAC too.

Thread-safety: the cache is filled in forward on the scope's thread and read in backward on autograd's threads, one
layer at a time; the engine calls it makes are thread-safe. The registry of wrapped layers has its own lock.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import weakref
from typing import Any, Callable, Optional

import torch

from ._logging import log_once
from .current import current_scope

# Layers whose checkpoint function wrap_context_fn replaced: layer -> (original, replacement); guarded by
# _wrapped_lock, process-wide because the layers are; undone by undo().
_wrapped_lock = threading.Lock()
_wrapped_layers: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, Any]]" = weakref.WeakKeyDictionary()


def _is_version_wrapper(v: Any) -> bool:
    return hasattr(v, "get_val") and hasattr(v, "val") and hasattr(v, "version")


class _OffloadedEntry:
    """A SAC cache entry whose tensors are engine handles until the recompute asks for them."""

    __slots__ = ("tree", "handles")

    def __init__(self, tree: Any, handles: list[tuple[Any, torch.Tensor]]) -> None:
        self.tree, self.handles = tree, handles

    def restore(self) -> Any:
        unpack = torch.ops.hsoffload.offload_unpack
        for wrapper, handle in self.handles:
            wrapper.val = unpack(handle)  # the engine's version check raises if the source was mutated in place
            wrapper.version = wrapper.val._version
        self.handles = []
        return self.tree


class _OffloadingEntries(dict):
    """The per-op entries of a SAC storage (torch keeps a dict by call index, older releases a list): entries are
    packed when stored and restored when the recompute reads them."""

    def __init__(self, pack: Callable[[Any], Any]) -> None:
        super().__init__()
        self._pack = pack
        self._first = 0  # the list form: keys _first .. _end-1 are the list's items, oldest first
        self._end = 0

    def __setitem__(self, idx: Any, value: Any) -> None:
        super().__setitem__(idx, self._pack(value))

    def __getitem__(self, idx: Any) -> Any:
        value = super().__getitem__(idx)
        if isinstance(value, _OffloadedEntry):
            value = value.restore()
            super().__setitem__(idx, value)
        return value

    def get(self, idx: Any, default: Any = None) -> Any:
        return self[idx] if idx in self else default

    def append(self, value: Any) -> None:  # the list form of the storage (torch releases before the dict form)
        self[self._end] = value
        self._end += 1

    def pop(self, idx: int = -1) -> Any:  # the list form: pop(0) takes the oldest
        if self._end == self._first:
            raise IndexError("pop from an empty SAC cache list")
        key = self._first if idx == 0 else self._end - 1
        value = self[key]
        super().__delitem__(key)
        if idx == 0:
            self._first += 1
        else:
            self._end -= 1
        return value


class _OffloadingStorage(collections.defaultdict):
    def __init__(self, pack: Callable[[Any], Any]) -> None:
        super().__init__(lambda: _OffloadingEntries(pack))


class OffloadingContextFn:
    """Wraps a checkpoint `context_fn`: when it returns torch's selective-checkpoint modes inside an offloaded layer
    of a "sac" scope, their shared cache stores engine handles instead of device tensors."""

    def __init__(self, inner: Callable[[], Any]) -> None:
        self.inner = inner
        functools.update_wrapper(self, inner)

    def __call__(self) -> Any:
        contexts = self.inner()
        scope = current_scope()
        if scope is None or scope.config.policy != "sac" or torch.compiler.is_compiling():
            return contexts
        visit = scope.layer_tracker.current
        if visit is None or not visit.offload:
            return contexts
        fwd, rec = contexts
        storage = getattr(fwd, "storage", None)
        if not isinstance(storage, dict) or getattr(rec, "storage", None) is not storage or storage:
            log_once(
                "sac-unknown-context",
                logging.WARNING,
                "hsoffload: policy='sac': the checkpoint context_fn of %s does not return torch's selective-checkpoint "
                "modes (create_selective_checkpoint_contexts); only its hidden_states are offloaded",
                visit.name,
            )
            return contexts
        if getattr(rec, "allow_cache_entry_mutation", False):
            log_once(
                "sac-mutation",
                logging.WARNING,
                "hsoffload: policy='sac': allow_cache_entry_mutation=True lets the SAC cache hold tensors that are "
                "modified in place later; hsoffload does not offload those (a host copy would be stale), only the "
                "hidden_states. Use allow_cache_entry_mutation=False to offload what SAC keeps.",
            )
            return contexts
        shared = _OffloadingStorage(scope.pack_sac_entry)
        fwd.storage = rec.storage = shared
        return contexts


def wrap_context_fn(layer: torch.nn.Module) -> bool:
    """Make `layer._gradient_checkpointing_func` call its `context_fn` through `OffloadingContextFn` (once). Returns
    False when the layer's checkpoint has no context_fn (full checkpointing: SAC keeps nothing)."""
    func = getattr(layer, "_gradient_checkpointing_func", None)
    if not isinstance(func, functools.partial):
        return False
    inner = func.keywords.get("context_fn")
    if inner is None:
        return False
    if not isinstance(inner, OffloadingContextFn):
        wrapped = functools.partial(func.func, *func.args, **{**func.keywords, "context_fn": OffloadingContextFn(inner)})
        with _wrapped_lock:
            _wrapped_layers[layer] = (func, wrapped)
        layer._gradient_checkpointing_func = wrapped
    return True


def undo() -> int:
    """Put back every checkpoint function `wrap_context_fn` replaced (`hsoffload.unpatch()`). Returns how many."""
    undone = 0
    with _wrapped_lock:
        for layer, (original, wrapped) in list(_wrapped_layers.items()):
            if getattr(layer, "_gradient_checkpointing_func", None) is wrapped:
                layer._gradient_checkpointing_func = original
                undone += 1
        _wrapped_layers.clear()
    return undone


def pack_sac_value(value: Any, pack_tensor: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> Any:
    """A SAC cache value (a pytree of torch's _VersionWrapper, or a sentinel) with its tensors packed."""
    leaves, _ = torch.utils._pytree.tree_flatten(value)
    handles = []
    for leaf in leaves:
        if _is_version_wrapper(leaf) and type(leaf.val) is torch.Tensor:
            handle = pack_tensor(leaf.val)
            if handle is not None:
                handles.append((leaf, handle))
    if not handles:
        return value
    for leaf, _ in handles:
        leaf.val = None  # the handle holds the host copy; the device tensor is freed with forward's last use
    return _OffloadedEntry(value, handles)
