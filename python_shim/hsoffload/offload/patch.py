"""Patch `transformers.GradientCheckpointingLayer.__call__` to mark decoder-layer inputs for offload.

While an offload scope is active on this thread and a checkpointed layer is training with grad
enabled, the layer's `hidden_states` input is marked with `torch.ops.hsoffload.mark_hidden_state`
and passed on *positionally*: transformers binds keyword arguments into a `functools.partial`, so
only positional tensors reach the checkpoint's saved tensors (and so the offload hooks). Each call
is one visit of the scope's `LayerTracker` (layer budget, prefetch group, per-layer counters).

Where the mark is applied follows where transformers checkpoints (targets.layer_checkpoints_in_forward):
4.57-5.22 checkpoint in `__call__` itself, module hooks inside the checkpoint, so the input is
marked on entry; >= 5.23 checkpoint inside the wrapped `forward`, after the module's pre-forward
hooks, so the mark is applied to what the layer's checkpoint function receives (a hook may have
replaced the input). Under torch.compile the mark stays on entry (in a graph break).

torch.distributed's `CheckpointWrapper` (FSDP activation checkpointing) checkpoints a decoder layer
from outside its `__call__`; its `forward` is patched the same way when it wraps a
GradientCheckpointingLayer.

Both are `ClassPatch`es (hsoffload.classpatch): they chain through whatever is installed when
`patch()` runs and `unpatch()` restores exactly or turns ours into a pass-through. Why a call does
not offload is logged by hsoffload.offload.diagnostics.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any, Callable, Optional, Sequence

import torch

from . import current
from .. import engine as _engine
from .._logging import log_once
from . import diagnostics
from . import layers as _layers
from . import policy as _policy
from . import sac as _sac
from ..classpatch import PATCH_ATTR, ClassPatch
from .config import OffloadConfig
from .current import current_scope
from .diagnostics import check_model
from .policy import chooses_per_layer, marks_layer_inputs
from .scope import OffloadScope
from ..targets import (
    LAYER_ATTR,
    MarkingWrapper,
    checkpoint_wrapper_class,
    first_param_is_hidden_states,
    layer_checkpoints_in_forward,
    layer_class,
    unwrap_marking,
)

logger = logging.getLogger("hsoffload")

__all__ = ["check_model", "is_patched", "offload_hidden_states", "patch", "rebind_compiled_layers", "unpatch"]

_lock = threading.Lock()  # serialises patch()/unpatch() (the two ClassPatches move together)
# Set on layers a CheckpointWrapper checkpoints: the wrapper marks and counts them; it stays set, since the wrapper's
# checkpoint calls the layer again in backward (its recompute).
_IN_CHECKPOINT_WRAPPER = "_hsoffload_in_checkpoint_wrapper"


def _mark_hidden_state(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Marks a decoder layer's hidden_states (every path that marks one goes through here), warning once past the
    kernels' 32-bit index wall."""
    diagnostics.report_index_wall(layer, x)
    return _engine.mark_hidden_state(x)


def _pass_hidden_states_first(layer: torch.nn.Module, args: tuple, kwargs: dict, mark: bool) -> tuple:
    """Return the positional arguments with `hidden_states` first (and marked when `mark`).

    A keyword `hidden_states` is moved to the front of the positional arguments (only when the
    layer's forward takes it first), since the checkpoint never saves keyword arguments.
    """
    def marker(x: torch.Tensor) -> torch.Tensor:
        return _mark_hidden_state(layer, x) if mark else x

    if args and isinstance(args[0], torch.Tensor):
        return (marker(args[0]),) + args[1:]
    if not args and isinstance(kwargs.get("hidden_states"), torch.Tensor) and first_param_is_hidden_states(
        type(layer)
    ):
        return (marker(kwargs.pop("hidden_states")),)
    if mark:
        diagnostics.report_missing_hidden_states(layer)
    return args


def _begin_layer(scope: OffloadScope, layer: torch.nn.Module, args: tuple, kwargs: dict, compiled: bool,
                 at_checkpoint: bool = False) -> tuple:
    """Start a decoder-layer call in `scope`: open its prefetch group and counters, mark what the policy marks.
    Returns (visit, args, due); `kwargs` may lose its hidden_states to args. With `at_checkpoint` the mark is not
    applied here but left `due` for the layer's checkpoint call (`_call_marking_at_checkpoint`)."""
    visit = scope.layer_tracker.begin(layer, compiled, checkpointed=bool(getattr(layer, "gradient_checkpointing", False)))
    try:
        args, due = _mark_layer_inputs(scope, layer, args, kwargs, visit, compiled, at_checkpoint)
        return visit, args, due
    except BaseException:
        scope.layer_tracker.end(visit)
        raise


def _mark_layer_inputs(scope: OffloadScope, layer: torch.nn.Module, args: tuple, kwargs: dict, visit: Any,
                       compiled: bool, at_checkpoint: bool) -> tuple[tuple, bool]:
    policy = scope.config.policy
    if not marks_layer_inputs(policy):
        return _pass_hidden_states_first(layer, args, kwargs, mark=False), False
    if not visit.offload or getattr(layer, _IN_CHECKPOINT_WRAPPER, False) or diagnostics.report_inactive(layer):
        return args, False
    if _policy.offloads_sac_saves(policy) and not compiled and not _sac.wrap_checkpoint_fn(layer):
        diagnostics.report_sac_without_context(layer)
    args = _pass_hidden_states_first(layer, args, kwargs, mark=not at_checkpoint)
    diagnostics.report_reentrant_without_grad(layer, args)
    return args, at_checkpoint


def _call_marking_at_checkpoint(previous: Callable[..., Any], layer: torch.nn.Module, args: tuple,
                                kwargs: dict) -> Any:
    """Run the layer with its checkpoint function marking the hidden_states it is given.

    transformers >= 5.23 checkpoints inside the layer's `forward`, after `Module.__call__` ran the module's pre-forward
    hooks; a hook that replaces the input (FSDP2's `cast_forward_inputs`, accelerate's device alignment) would
    otherwise hand the checkpoint a tensor that was never marked, and nothing would be offloaded. So the mark goes on
    what the checkpoint receives: the layer's `_gradient_checkpointing_func` (set on the instance by transformers, or
    on its class by a user) is replaced on the instance for this call only. Afterwards the instance gets back what it
    had (nothing, when the function lives on the class), unless someone set another function meanwhile, and never
    one of these wrappers: a nested call of the same layer, or another thread calling it at the same time (not
    supported: the marks of the two calls may mix), can leave no wrapper behind for `unpatch()` to miss."""
    own = layer.__dict__.get(LAYER_ATTR)
    checkpoint_fn = unwrap_marking(getattr(layer, LAYER_ATTR, None))
    if checkpoint_fn is None:
        diagnostics.report_missing_hidden_states(layer)
        return previous(layer, *args, **kwargs)
    reached = False

    def mark_then_checkpoint(function: Callable[..., Any], *cargs: Any, **ckwargs: Any) -> Any:
        nonlocal reached
        reached = True
        if cargs and isinstance(cargs[0], torch.Tensor):
            cargs = (_mark_hidden_state(layer, cargs[0]),) + cargs[1:]
        else:
            diagnostics.report_missing_hidden_states(layer)
        return checkpoint_fn(function, *cargs, **ckwargs)

    wrapper = MarkingWrapper(checkpoint_fn, mark_then_checkpoint)
    layer.__dict__[LAYER_ATTR] = wrapper
    try:
        out = previous(layer, *args, **kwargs)
    finally:
        if layer.__dict__.get(LAYER_ATTR) is wrapper:
            restored = unwrap_marking(own)
            if restored is None:
                del layer.__dict__[LAYER_ATTR]
            else:
                layer.__dict__[LAYER_ATTR] = restored
    if not reached:
        diagnostics.report_checkpoint_not_reached(layer)
    return out


def _begin_compiled_layer(layer: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """`_begin_layer` for a decoder layer whose __call__ torch.compile traces: run eagerly, in a graph break at the
    layer's start, so the mark applies to the real input tensor the compiled graph saves."""
    scope = current_scope()
    if scope is None:
        return None, None, args, kwargs
    kwargs = dict(kwargs)
    diagnostics.report_compiled_layer(layer)
    if scope.auto is not None:
        from . import auto  # noqa: PLC0415  (policy auto only)

        auto.report_unseen(layer, "a torch.compile'd model traces its layers")
    visit, args, _ = _begin_layer(scope, layer, args, kwargs, compiled=True)
    return scope, visit, args, kwargs


def _end_compiled_layer(scope: OffloadScope, visit: Any) -> None:
    scope.layer_tracker.end(visit)


def _make_layer_call(previous: Callable[..., Any], patch: ClassPatch) -> Callable[..., Any]:
    # Both run eagerly in a graph break. Made here, at patch time, not with a decorator at import: importing dynamo
    # costs about 1.2 s that every `import hsoffload` (the planner's CLI, each worker process) would pay.
    begin_compiled_layer = torch._dynamo.disable(_begin_compiled_layer)
    end_compiled_layer = torch._dynamo.disable(_end_compiled_layer)
    at_checkpoint = layer_checkpoints_in_forward()  # where this transformers runs the checkpoint (targets.py)

    @functools.wraps(previous)
    def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not patch.active or not self.training or not torch.is_grad_enabled():
            return previous(self, *args, **kwargs)
        if getattr(self, _IN_CHECKPOINT_WRAPPER, False):
            return previous(self, *args, **kwargs)  # the enclosing CheckpointWrapper marks and counts this layer
        if torch.compiler.is_compiling():
            if not current.any_active:
                return previous(self, *args, **kwargs)  # no graph break while no scope is active (dynamo guards it)
            # No try/finally here: a graph break inside one makes dynamo run the whole frame eagerly. A call that
            # raises leaves its visit open until the scope's exit resets it.
            scope, visit, args, kwargs = begin_compiled_layer(self, args, kwargs)
            out = previous(self, *args, **kwargs)
            if visit is not None:
                end_compiled_layer(scope, visit)
            return out
        scope = current_scope()
        observe: Any = contextlib.nullcontext()
        if scope is not None and scope.auto is not None:
            # policy auto: a step starts at the first layer; the layers' choices (a sac layer's checkpoint function
            # included) are set before this layer's is wrapped below; it may watch this call (what it issues)
            observe = scope.auto.before_layer(scope, self, args, kwargs, previous) or observe
        elif scope is not None and chooses_per_layer(scope.config.policy):
            raise RuntimeError("hsoffload: policy auto needs the model: hsoffload.offload_hidden_states(model, "
                               "policy='auto', ...) or scope.bind_model(model) before the first step")
        # Every policy, and outside scopes too (a selective checkpoint's policy may ask for CPU offload)
        _sac.wrap_checkpoint_fn(self)
        if scope is None:
            return previous(self, *args, **kwargs)
        visit = None
        try:
            # `layer.compile()` traces Module.__call__'s body (forward, the checkpoint function): a mark there would be
            # traced, not applied, so such a layer is marked on entry, as under a compiled __call__.
            mark_inside = at_checkpoint and getattr(self, "_compiled_call_impl", None) is None
            visit, args, due = _begin_layer(scope, self, args, kwargs, compiled=False, at_checkpoint=mark_inside)
            with observe:
                if due:
                    out = _call_marking_at_checkpoint(previous, self, args, kwargs)
                else:
                    out = previous(self, *args, **kwargs)
            if scope.auto is not None:
                scope.auto.after_layer(self, out)
            return out
        finally:
            if visit is not None:
                scope.layer_tracker.end(visit)

    return __call__


def _make_checkpoint_wrapper_forward(previous: Callable[..., Any], patch: ClassPatch) -> Callable[..., Any]:
    layer_cls = layer_class()

    @functools.wraps(previous)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        layer = getattr(self, "_checkpoint_wrapped_module", None)
        if not patch.active or not isinstance(layer, layer_cls):
            return previous(self, *args, **kwargs)
        # As the layer's own checkpoint: SAC through the scope, *_CPU_OFFLOAD honoured (outside scopes: said once)
        selective = _sac.wrap_checkpoint_fn(self, _sac.WRAPPER_ATTR, type(layer).__name__)
        scope = current_scope()
        if scope is None or not self.training or not torch.is_grad_enabled():
            return previous(self, *args, **kwargs)
        policy = scope.config.policy
        sac_policy = _policy.offloads_sac_saves(policy)
        if scope.auto is not None:
            from . import auto  # noqa: PLC0415  (policy auto only)

            auto.report_unseen(layer, "torch.distributed's checkpoint_wrapper checkpoints it")
        visit = scope.layer_tracker.begin(layer, compiled=False, checkpointed=True)
        setattr(layer, _IN_CHECKPOINT_WRAPPER, True)
        try:
            if sac_policy and visit.offload and not selective:
                diagnostics.report_sac_without_context(layer)
            mark = marks_layer_inputs(policy) and visit.offload
            args = _pass_hidden_states_first(layer, args, kwargs, mark)  # may move kwargs["hidden_states"] into args
            return previous(self, *args, **kwargs)
        finally:
            scope.layer_tracker.end(visit)

    return forward


LAYER_CALL = ClassPatch(layer_class, "__call__", _make_layer_call, inherited_ok=True)
CHECKPOINT_WRAPPER_FORWARD = ClassPatch(checkpoint_wrapper_class, "forward", _make_checkpoint_wrapper_forward)


def patch() -> None:
    """Install the marking `__call__` on GradientCheckpointingLayer and CheckpointWrapper's `forward` (idempotent).

    Chains through whatever is installed now (stock, Axolotl's or DeepSpeed's). If our wrapper is
    already installed (on top, or under a patch installed later that chains through it), this only
    makes sure it is active.
    """
    layer_class()  # a clear ImportError before anything changes
    with _lock:
        CHECKPOINT_WRAPPER_FORWARD.install()
        LAYER_CALL.install()


def unpatch() -> bool:
    """Undo `patch()`. Returns True if the previous `__call__` was restored exactly.

    If another patch was installed over ours since, ours cannot be taken out of its chain: it is
    made a pure pass-through instead, a warning is logged and False is returned. The policies'
    module hooks and wrapped SAC context functions are removed too.
    """
    layer_class()
    with _lock:
        CHECKPOINT_WRAPPER_FORWARD.remove()
        _policy.undo()
        _layers.undo()
        _sac.undo()
        return LAYER_CALL.remove()


def is_patched() -> bool:
    """True if the marking `__call__` is installed (on top or chained under a later patch) and active."""
    layer_class()
    return LAYER_CALL.is_installed()


def rebind_compiled_layers(model: torch.nn.Module, *, modules: Optional[Sequence[torch.nn.Module]] = None) -> int:
    """Decoder layers wrapped by `torch.compile(layer)` (Accelerate's regional compilation) before `patch()` bound
    the stock `__call__`: re-initialise those wrappers so they trace the patched one. Returns how many. `modules`:
    `list(model.modules())` where the caller has it already."""
    cls = layer_class()
    rebound = 0
    for module in model.modules() if modules is None else modules:
        inner = module._modules.get("_orig_mod")  # torch.compile(layer) registers the layer as this submodule
        if not isinstance(inner, cls):
            continue
        compiled_call = module.__dict__.get("_forward", module.__dict__.get("forward"))
        target = getattr(getattr(compiled_call, "_torchdynamo_orig_callable", None), "__func__", None)
        if target is None or getattr(target, PATCH_ATTR, False) or not is_patched():
            continue
        if not hasattr(module, "_initialize"):
            log_once(
                "compiled-before-patch",
                logging.WARNING,
                "hsoffload: %s was wrapped by torch.compile before hsoffload.patch() and cannot be re-bound on this "
                "torch; call hsoffload.patch() before torch.compile, or compile with layer.compile()",
                type(inner).__name__,
            )
            continue
        module._initialize()
        rebound += 1
    if rebound:
        logger.info("hsoffload: %d compiled decoder layers re-bound to the patched __call__", rebound)
    return rebound


def offload_hidden_states(
    model: Optional[torch.nn.Module] = None, config: Optional[OffloadConfig] = None, **kwargs: Any
) -> OffloadScope:
    """One line for training loops: patch transformers (once) and return an offload scope.

    `with hsoffload.offload_hidden_states() as scope: loss = model(**batch).loss; loss.backward()`.
    Pass `model` to have configuration problems reported up front.
    """
    patch()
    scope = OffloadScope(config, **kwargs)
    if model is not None:
        modules = list(model.modules())  # one walk for both (this runs at every step of the one-line idiom)
        rebind_compiled_layers(model, modules=modules)
        check_model(model, policy=scope.config.policy, modules=modules)
        scope.bind_model(model)
    return scope
