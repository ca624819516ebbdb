"""Offload policies: which saved tensors a scope hands to the engine as marked.

Every policy ends in the same two engine calls (`mark`, then the pack op), so there is one copy path:

- ``"hidden_states"``: the input of each checkpointed decoder layer (marked by the transformers patch);
- ``"sac"``: that input, plus the tensors `torch.utils.checkpoint.create_selective_checkpoint_contexts` keeps for
  the layer (whatever the user's SAC policy saves);
- ``"all"``: every saved activation of at least `min_offload_size` bytes (never parameters, buffers or views of
  them); the output head's (saved after a decoder layer ran, outside every layer) only with `offload_output_head`;
- a callable ``(tensor, module_qualified_name) -> bool``.

Layer budget: `keep_last_layers` leaves the last k decoder layers' tensors on the device, `offload_fraction` offloads
only the first share of the others. Each decoder layer is one prefetch group of the engine (`begin_group`), so
backward brings back whole layers `prefetch_depth` layers ahead.

This module only decides; it knows nothing of how copies are made. Thread-safety: a `LayerTracker` belongs to one
scope and is used on the thread that entered it (forward); SAC entries are restored on autograd's threads through
the engine, which is thread-safe.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import threading
import weakref
from typing import Any, Callable, Optional, Union

import torch

from ._logging import log_once

logger = logging.getLogger("hsoffload")

PolicyFn = Callable[[torch.Tensor, str], bool]
Policy = Union[str, PolicyFn]
POLICIES = ("hidden_states", "sac", "all")


def validate_policy(policy: Any) -> Policy:
    """`policy` if it names a policy or is callable; a ValueError that lists the choices otherwise."""
    if callable(policy) or (isinstance(policy, str) and policy in POLICIES):
        return policy
    raise ValueError(
        f"hsoffload: policy must be one of {', '.join(repr(p) for p in POLICIES)} or a callable "
        f"(tensor, module_qualified_name) -> bool, got {policy!r}"
    )


def policy_name(policy: Policy) -> str:
    return policy if isinstance(policy, str) else getattr(policy, "__qualname__", "callable")


def marks_layer_inputs(policy: Policy) -> bool:
    """Policies under which the patch marks a decoder layer's hidden_states (and checkpointing is expected)."""
    return policy in ("hidden_states", "sac")


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
    s = engine.stats()
    return int(s["offloaded_tensors"]), int(s["offloaded_bytes"])


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


# Guards _head_reset_models and _tracked_models: module hooks are installed once per model, process-wide (a model's
# hooks are process-wide by nature).
_tracked_lock = threading.Lock()
_head_reset_models: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()
# Layers whose checkpoint function wrap_context_fn replaced: layer -> (original, replacement).
_wrapped_layers: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, Any]]" = weakref.WeakKeyDictionary()


def reset_head_state_on_forward(model: torch.nn.Module, tracker_of_current_scope: Callable[[], Any]) -> None:
    """Install (once per model) a forward pre-hook on `model` that starts a new forward for the head rule of policy
    "all" (saves outside decoder layers count as the head only after a layer of *this* forward ran), so several
    forwards in one scope entry (gradient accumulation) offload each one's embedding saves."""
    with _tracked_lock:
        if model in _head_reset_models:
            return

        def pre(_m: torch.nn.Module, _args: Any) -> None:
            # Only training forwards start a new forward for the head rule (an eval or no_grad forward in between,
            # such as a reference pass, runs no offloaded layer and must not reset it).
            if not torch.compiler.is_compiling() and torch.is_grad_enabled() and _m.training:
                tracker = tracker_of_current_scope()
                if tracker is not None and tracker.current is None:
                    tracker.layer_ran = False

        _head_reset_models[model] = model.register_forward_pre_hook(pre)


# ---------------------------------------------------------------------------------------------------------------
# Module names for callable policies

_names_tls = threading.local()  # per thread: the stack of qualified names of modules running forward


def current_module_name() -> str:
    stack = getattr(_names_tls, "stack", None)
    return stack[-1] if stack else ""


_tracked_models: "weakref.WeakKeyDictionary[torch.nn.Module, list[Any]]" = weakref.WeakKeyDictionary()


def track_module_names(model: torch.nn.Module) -> None:
    """Install (once per model) forward hooks that keep `current_module_name()` up to date. Inside a compiled region
    the hooks do nothing (the name stays that of the enclosing eager module, such as the decoder layer)."""
    with _tracked_lock:
        if model in _tracked_models:
            return
        handles = []
        for name, module in model.named_modules():

            def pre(_m: torch.nn.Module, _args: Any, name: str = name) -> None:
                if not torch.compiler.is_compiling():
                    _names_tls.__dict__.setdefault("stack", []).append(name)

            def post(_m: torch.nn.Module, _args: Any, _out: Any) -> None:
                if not torch.compiler.is_compiling():
                    stack = getattr(_names_tls, "stack", None)
                    if stack:
                        stack.pop()

            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post, always_call=True))
        _tracked_models[model] = handles


# ---------------------------------------------------------------------------------------------------------------
# Which saved tensors a policy marks


def is_parameter_or_view(x: torch.Tensor, storages: set[int]) -> bool:
    """A parameter, a buffer, or a view or detached alias of one: by Python type, or by storage (the storages of the
    bound models' parameters and buffers at the scope's entry)."""
    if isinstance(x, torch.nn.Parameter) or isinstance(x._base, torch.nn.Parameter):
        return True
    if not storages or x.layout != torch.strided or x.is_nested:
        return False  # sparse and nested tensors have no storage to compare (and are never parameters here)
    return x.untyped_storage().data_ptr() in storages


class Selector:
    """The pack-time decision of a scope whose policy picks saved tensors itself ("all", a callable, and "sac"
    inside compiled layers, whose graph saves what SAC keeps)."""

    def __init__(
        self,
        policy: Policy,
        tracker: LayerTracker,
        min_offload_size: int,
        offload_cpu_tensors: bool,
        offload_output_head: bool,
    ) -> None:
        self._policy = policy
        self._tracker = tracker
        self._min = min_offload_size
        self._cpu = offload_cpu_tensors
        self._head = offload_output_head
        self.storages: set[int] = set()  # storage addresses of bound models' parameters and buffers

    def movable(self, x: torch.Tensor) -> bool:
        """Worth a host copy at all: on the device (or CPU with offload_cpu_tensors), at least min_offload_size
        bytes, not a parameter or buffer. Shared by the pack-hook decision and policy "sac"'s cache."""
        if (x.is_cpu and not self._cpu) or x.numel() * x.element_size() < self._min:
            return False
        return not is_parameter_or_view(x, self.storages)

    def __call__(self, x: torch.Tensor) -> bool:
        if torch._C._current_graph_task_id() != -1:
            return False  # saved during backward (a reentrant checkpoint's recompute): needed at once
        visit = self._tracker.current
        if visit is not None and not visit.offload:
            return False
        if self._policy == "sac":
            # A compiled checkpointed layer saves what its SAC policy keeps through autograd: offload those saves.
            return visit is not None and visit.compiled and visit.checkpointed and self.movable(x)
        if visit is None and self._tracker.layer_ran and not self._head and self._policy == "all":
            return False
        if not self.movable(x):
            return False
        if self._policy == "all":
            return True
        name = "" if visit is not None and visit.compiled else current_module_name()
        return bool(self._policy(x, name or (visit.name if visit is not None else "")))


# ---------------------------------------------------------------------------------------------------------------
# SAC: offload what torch's selective-checkpoint caching mode stores


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
        from .scope import current_scope  # the scope module imports this one

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
        with _tracked_lock:
            _wrapped_layers[layer] = (func, wrapped)
        layer._gradient_checkpointing_func = wrapped
    return True


def undo_model_changes() -> int:
    """Remove every module hook this module installed and put back every checkpoint function it wrapped (what
    `hsoffload.unpatch()` calls). Returns how many changes were undone."""
    undone = 0
    with _tracked_lock:
        for handles in list(_tracked_models.values()):
            for h in handles:
                h.remove()
            undone += 1
        _tracked_models.clear()
        for handle in list(_head_reset_models.values()):
            handle.remove()
            undone += 1
        _head_reset_models.clear()
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
