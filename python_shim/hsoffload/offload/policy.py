"""Offload policies: which saved tensors a scope hands to the engine as marked.

Every policy ends in the same two engine calls (`mark`, then the pack op), so there is one copy path:

- ``"hidden_states"``: the input of each checkpointed decoder layer (marked by the transformers patch);
- ``"sac"``: that input, plus the tensors `torch.utils.checkpoint.create_selective_checkpoint_contexts` keeps for
  the layer (whatever the user's SAC policy saves); under every policy, the outputs a SAC policy marks
  `CheckpointPolicy.*_CPU_OFFLOAD` (hsoffload.offload.sac);
- ``"all"``: every saved activation of at least `min_offload_size` bytes (never parameters, buffers or views of
  them); the output head's (saved after a decoder layer ran, outside every layer) only with `offload_output_head`;
- a callable ``(tensor, module_qualified_name) -> bool``.

The layer budget and per-layer counters live in `layers`, policy "sac"'s cache in `sac`.

This module only decides; it knows nothing of how copies are made. Thread-safety: a `Selector` belongs to one scope
and runs in its pack hook on the thread that saves (forward); the module-name stack is thread-local.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from ..options import PolicyName
from .passthrough import PassthroughCounters, Zero3Parameters

if TYPE_CHECKING:
    from .layers import LayerTracker


PolicyFn = Callable[[torch.Tensor, str], bool]
Policy = Union[PolicyName, str, PolicyFn]  # a str is one of PolicyName's values (OffloadConfig makes it a PolicyName)

# What a policy does is asked of the policy (hsoffload.options.PolicyName's properties), never compared by name; the
# functions below answer it for callables too.


def policy_name(policy: Policy) -> str:
    return str(PolicyName.parse(policy)) if not callable(policy) else getattr(policy, "__qualname__", "callable")


def marks_layer_inputs(policy: Policy) -> bool:
    """Policies under which the patch marks a decoder layer's hidden_states (and checkpointing is expected)."""
    return not callable(policy) and PolicyName.parse(policy).marks_layer_inputs


def chooses_per_layer(policy: Policy) -> bool:
    """Policy auto: per decoder layer, measured, no checkpointing, the input kept, or offloaded."""
    return not callable(policy) and PolicyName.parse(policy).chooses_per_layer


def picks_saved_tensors(policy: Policy) -> bool:
    """The pack hook chooses among saved tensors (a Selector runs): callables and every named policy but one."""
    return callable(policy) or PolicyName.parse(policy).picks_saved_tensors


def offloads_sac_saves(policy: Policy) -> bool:
    """Every tensor a selective-checkpoint context keeps is offloaded (the layer's checkpoint must be selective)."""
    return not callable(policy) and PolicyName.parse(policy).offloads_sac_saves


def offloads_every_save(policy: Policy) -> bool:
    """Every saved activation worth a copy is offloaded, no checkpointing needed."""
    return not callable(policy) and PolicyName.parse(policy).offloads_every_save


# ---------------------------------------------------------------------------------------------------------------
# Module names for callable policies

_names_tls = threading.local()  # per thread: the stack of qualified names of modules running forward


def current_module_name() -> str:
    stack = getattr(_names_tls, "stack", None)
    return stack[-1] if stack else ""


# Models whose module hooks keep current_module_name() up to date: installed once per model, process-wide (a model's
# hooks are process-wide by nature); guarded by _tracked_lock and removed by undo().
_tracked_lock = threading.Lock()
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
        tracker: "LayerTracker",
        min_offload_size: int,
        offload_cpu_tensors: bool,
        offload_output_head: bool,
    ) -> None:
        self._policy = policy
        self._sac = offloads_sac_saves(policy)
        self._every = offloads_every_save(policy)
        self._tracker = tracker
        self._min = min_offload_size
        self._cpu = offload_cpu_tensors
        self._head = offload_output_head
        self.storages: set[int] = set()  # storage addresses of bound models' parameters and buffers
        self.zero3 = Zero3Parameters()  # bound models' ZeRO-3 parameters (their storages change at every gather)
        self.counters: Optional[PassthroughCounters] = None

    def movable(self, x: torch.Tensor) -> bool:
        """Worth a host copy at all: on the device (or CPU with offload_cpu_tensors), at least min_offload_size
        bytes, not a parameter or buffer. Shared by the pack-hook decision and policy "sac"'s cache."""
        if (x.is_cpu and not self._cpu) or x.numel() * x.element_size() < self._min:
            return False
        if is_parameter_or_view(x, self.storages):
            return False
        if self.zero3 and self.zero3.aliases(x):
            if self.counters is not None:
                self.counters.bump("zero3_parameters")
            return False
        return True

    def __call__(self, x: torch.Tensor) -> bool:
        if torch._C._current_graph_task_id() != -1:
            return False  # saved during backward (a reentrant checkpoint's recompute): needed at once
        visit = self._tracker.current
        if visit is not None and not visit.offload:
            return False
        if self._sac:
            # A compiled checkpointed layer saves what its SAC policy keeps through autograd: offload those saves.
            return visit is not None and visit.compiled and visit.checkpointed and self.movable(x)
        if visit is None and self._tracker.layer_ran and not self._head and self._every:
            return False
        if not self.movable(x):
            return False
        if self._every:
            return True
        name = "" if visit is not None and visit.compiled else current_module_name()
        return bool(self._policy(x, name or (visit.name if visit is not None else "")))


def undo() -> int:
    """Remove the module-name hooks this module installed (`hsoffload.unpatch()`). Returns how many models."""
    with _tracked_lock:
        hooks = list(_tracked_models.values())
        _tracked_models.clear()
    for handles in hooks:
        for h in handles:
            h.remove()
    return len(hooks)
