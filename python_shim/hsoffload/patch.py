"""Patch `transformers.GradientCheckpointingLayer.__call__` to mark decoder-layer inputs for offload.

While an offload scope is active on this thread and a checkpointed layer is training with grad
enabled, the layer's `hidden_states` input is marked with `torch.ops.hsoffload.mark_hidden_state`
and passed on *positionally*: transformers binds keyword arguments into a `functools.partial`, so
only positional tensors reach the checkpoint's saved tensors (and so the offload hooks).

torch.distributed's `CheckpointWrapper` (FSDP activation checkpointing) checkpoints a decoder layer
from outside its `__call__`; its `forward` is patched the same way when it wraps a
GradientCheckpointingLayer.

Chaining: `patch()` wraps whatever `__call__` is installed when it runs (stock transformers,
Axolotl's or DeepSpeed's marker) and calls it; it never copies the stock body (which uses a
zero-argument `super()`). A patch installed over ours later is expected to chain through ours, as
those do. `unpatch()` restores the exact previous attribute when ours is still on top; when
another patch sits on top it cannot take ours out of that chain, so it turns ours into a pure
pass-through instead (and a later `patch()` turns it back on).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
from typing import Any, Callable, Optional

import torch

from ._logging import log_once as _log_once
from . import scope as _scope_module
from .scope import OffloadConfig, OffloadScope, current_scope
from .policy import Policy, marks_layer_inputs, undo_model_changes, wrap_context_fn

logger = logging.getLogger("hsoffload")

_PATCH_ATTR = "_hsoffload_patched"
_MISSING = object()  # "the class had no __call__ of its own"
_lock = threading.Lock()  # serialises patch()/unpatch()


@dataclasses.dataclass
class _PatchState:
    """The process-wide patch (a monkeypatch is process-wide by nature)."""

    installed: Optional[Callable[..., Any]] = None  # our wrapper, wherever it sits in the chain
    previous: Any = _MISSING  # the class attribute our wrapper replaced, restored exactly by unpatch()
    active: bool = False  # False: our wrapper only forwards (unpatched while another patch wraps it)


_state = _PatchState()

# torch.distributed's CheckpointWrapper (FSDP `activation_checkpointing`, `apply_activation_checkpointing`)
# checkpoints a decoder layer from outside its __call__: the layer's inputs are saved before our
# layer patch runs, so the wrapper's forward is patched too. Module state, like the patch itself.
_wrapper_previous: Any = _MISSING  # CheckpointWrapper.forward before patch(); restored by unpatch()
_WRAPPED_ATTR = "_hsoffload_in_checkpoint_wrapper"  # set on layers a CheckpointWrapper checkpoints




def _layer_class() -> type:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError as exc:  # transformers < 4.52
        raise ImportError(
            "hsoffload.patch: transformers.modeling_layers.GradientCheckpointingLayer not found; "
            "hidden-state offload needs transformers >= 4.57 (pip install 'transformers>=4.57')"
        ) from exc
    return GradientCheckpointingLayer


@functools.lru_cache(maxsize=None)
def _first_param_is_hidden_states(cls: type) -> bool:
    try:
        params = list(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) >= 2 and params[1] == "hidden_states"


def _checkpoint_function(layer: torch.nn.Module) -> tuple[Any, dict[str, Any]]:
    """The callable behind `layer._gradient_checkpointing_func` and its bound keywords."""
    func = getattr(layer, "_gradient_checkpointing_func", None)
    keywords: dict[str, Any] = {}
    while isinstance(func, functools.partial):
        keywords = {**func.keywords, **keywords}
        func = func.func
    return func, keywords


def _bypass_reason(layer: torch.nn.Module) -> Optional[str]:
    """Why the offload hooks cannot see this layer's saved inputs, or None."""
    func, _ = _checkpoint_function(layer)
    qualname = getattr(func, "__qualname__", "")
    if "gradient_checkpointing_enable" in qualname and "<locals>" in qualname:
        # transformers >= 5.x `gradient_checkpointing_enable(offload=True)`: the checkpoint runs
        # under torch's save_on_cpu, an inner saved-tensor hook that takes every input first.
        return (
            "gradient checkpointing was enabled with offload=True, whose save_on_cpu hook already moves every "
            "checkpoint input to host and hides them from hsoffload; enable checkpointing without offload=True"
        )
    return None


def _uses_reentrant(layer: torch.nn.Module) -> bool:
    func, keywords = _checkpoint_function(layer)
    if func is not torch.utils.checkpoint.checkpoint:
        return False
    return keywords.get("use_reentrant") in (True, None)  # torch's default is reentrant


def _report_inactive(layer: torch.nn.Module) -> bool:
    """Log (once per cause) and return True when this call cannot offload the layer's input."""
    name = type(layer).__name__
    if getattr(layer, _WRAPPED_ATTR, False):
        return True  # checkpointed (and marked) by the enclosing CheckpointWrapper
    if not getattr(layer, "gradient_checkpointing", False):
        _log_once(
            f"nockpt:{name}",
            logging.WARNING,
            "hsoffload: %s runs without gradient checkpointing (checkpointing off, or every_n_layers > 1 skips "
            "it), so its hidden states are not offloaded; call model.gradient_checkpointing_enable(), or use "
            "policy='all', which offloads the saved activations of layers that are not checkpointed.",
            name,
        )
        return True
    reason = _bypass_reason(layer)
    if reason is not None:
        _log_once(f"bypass:{name}", logging.WARNING, "hsoffload: %s: %s.", name, reason)
        return True
    return False


def _pass_hidden_states_first(layer: torch.nn.Module, args: tuple, kwargs: dict, mark: bool) -> tuple:
    """Return the positional arguments with `hidden_states` first (and marked when `mark`).

    A keyword `hidden_states` is moved to the front of the positional arguments (only when the
    layer's forward takes it first), since the checkpoint never saves keyword arguments.
    """
    marker = torch.ops.hsoffload.mark_hidden_state if mark else (lambda t: t)
    if args and isinstance(args[0], torch.Tensor):
        return (marker(args[0]),) + args[1:]
    if not args and isinstance(kwargs.get("hidden_states"), torch.Tensor) and _first_param_is_hidden_states(
        type(layer)
    ):
        return (marker(kwargs.pop("hidden_states")),)
    if mark:
        _log_once(
            f"nohidden:{type(layer).__name__}",
            logging.WARNING,
            "hsoffload: %s was called without a hidden_states tensor as first positional argument (or as a keyword "
            "its forward takes first); nothing to offload for it.",
            type(layer).__name__,
        )
    return args


def _report_reentrant_without_grad(layer: torch.nn.Module, args: tuple) -> None:
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args) or not _uses_reentrant(layer):
        return
    _log_once(
        f"reentrant-nograd:{type(layer).__name__}",
        logging.WARNING,
        "hsoffload: %s uses reentrant checkpointing but none of its tensor inputs requires grad, so the "
        "checkpoint saves (and hsoffload offloads) nothing, and the layer gets no gradients; call "
        "model.enable_input_require_grads() (PEFT) or use use_reentrant=False.",
        type(layer).__name__,
    )


def _report_sac_without_context(layer: torch.nn.Module) -> None:
    _log_once(
        f"sac-nocontext:{type(layer).__name__}",
        logging.WARNING,
        "hsoffload: policy='sac' but %s is checkpointed without a selective context_fn (torch.utils.checkpoint."
        "create_selective_checkpoint_contexts in gradient_checkpointing_kwargs), so SAC keeps nothing and only its "
        "hidden_states are offloaded",
        type(layer).__name__,
    )


def _begin_layer(scope: OffloadScope, layer: torch.nn.Module, args: tuple, kwargs: dict, compiled: bool) -> tuple:
    """Start a decoder-layer call in `scope`: open its prefetch group and counters, mark what the policy marks.
    Returns (visit, args); `kwargs` may lose its hidden_states to args."""
    visit = scope.layer_tracker.begin(layer, compiled, checkpointed=bool(getattr(layer, "gradient_checkpointing", False)))
    try:
        return visit, _mark_layer_inputs(scope, layer, args, kwargs, visit, compiled)
    except BaseException:
        scope.layer_tracker.end(visit)
        raise


def _mark_layer_inputs(scope: OffloadScope, layer: torch.nn.Module, args: tuple, kwargs: dict, visit: Any,
                       compiled: bool) -> tuple:
    policy = scope.config.policy
    if not marks_layer_inputs(policy):
        return _pass_hidden_states_first(layer, args, kwargs, mark=False)
    if not visit.offload or _report_inactive(layer):
        return args
    if policy == "sac" and not compiled and not wrap_context_fn(layer):
        _report_sac_without_context(layer)
    args = _pass_hidden_states_first(layer, args, kwargs, mark=True)
    _report_reentrant_without_grad(layer, args)
    return args


@torch._dynamo.disable
def _begin_compiled_layer(layer: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """`_begin_layer` for a decoder layer whose __call__ torch.compile traces: run eagerly, in a graph break at the
    layer's start, so the mark applies to the real input tensor the compiled graph saves."""
    scope = current_scope()
    if scope is None:
        return None, None, args, kwargs
    kwargs = dict(kwargs)
    _log_once(
        "compiled-layer",
        logging.INFO,
        "hsoffload: %s.__call__ runs under torch.compile: hsoffload marks its inputs eagerly in a graph break at the "
        "layer's start and end (one extra graph per layer; whole-model compile is split at every decoder layer)",
        type(layer).__name__,
    )
    visit, args = _begin_layer(scope, layer, args, kwargs, compiled=True)
    return scope, visit, args, kwargs


@torch._dynamo.disable
def _end_compiled_layer(scope: OffloadScope, visit: Any) -> None:
    scope.layer_tracker.end(visit)


def _make_wrapper(previous: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(previous)
    def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not _state.active or not self.training or not torch.is_grad_enabled():
            return previous(self, *args, **kwargs)
        if getattr(self, _WRAPPED_ATTR, False):
            return previous(self, *args, **kwargs)  # the enclosing CheckpointWrapper marks and counts this layer
        if torch.compiler.is_compiling():
            if not _scope_module.any_active:
                return previous(self, *args, **kwargs)  # no graph break while no scope is active (dynamo guards it)
            # No try/finally here: a graph break inside one makes dynamo run the whole frame eagerly. A call that
            # raises leaves its visit open until the scope's exit resets it.
            scope, visit, args, kwargs = _begin_compiled_layer(self, args, kwargs)
            out = previous(self, *args, **kwargs)
            if visit is not None:
                _end_compiled_layer(scope, visit)
            return out
        scope = current_scope()
        if scope is None:
            return previous(self, *args, **kwargs)
        visit = None
        try:
            visit, args = _begin_layer(scope, self, args, kwargs, compiled=False)
            return previous(self, *args, **kwargs)
        finally:
            if visit is not None:
                scope.layer_tracker.end(visit)

    setattr(__call__, _PATCH_ATTR, True)
    return __call__


def _forget_if_removed(cls: type) -> None:
    """If someone put back the attribute we replaced, our wrapper is out of every chain: forget it."""
    if _state.installed is not None and cls.__dict__.get("__call__", _MISSING) is _state.previous:
        logger.debug("hsoffload: %s.__call__ was restored by someone else; our patch is gone", cls.__qualname__)
        _state.installed, _state.previous, _state.active = None, _MISSING, False


def _checkpoint_wrapper_class() -> Optional[type]:
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # torch built without distributed
        return None
    return CheckpointWrapper


def _make_checkpoint_wrapper_forward(previous: Callable[..., Any]) -> Callable[..., Any]:
    layer_cls = _layer_class()

    @functools.wraps(previous)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        layer = getattr(self, "_checkpoint_wrapped_module", None)
        if (
            not _state.active
            or current_scope() is None
            or not isinstance(layer, layer_cls)
            or not self.training
            or not torch.is_grad_enabled()
        ):
            return previous(self, *args, **kwargs)
        scope = current_scope()
        policy = scope.config.policy
        visit = scope.layer_tracker.begin(layer, compiled=False, checkpointed=True)
        # Stays set: the wrapper's checkpoint calls the layer again in backward (its recompute), which must not
        # be treated as an unwrapped, uncheckpointed call.
        setattr(layer, _WRAPPED_ATTR, True)
        try:
            if policy == "sac":
                _log_once(
                    "sac-checkpoint-wrapper",
                    logging.WARNING,
                    "hsoffload: policy='sac': %s is checkpointed by torch.distributed's CheckpointWrapper, whose "
                    "checkpoint function hsoffload does not wrap; only its hidden_states are offloaded. Use "
                    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'context_fn': ...}) instead.",
                    type(layer).__name__,
                )
            mark = marks_layer_inputs(policy) and visit.offload
            args = _pass_hidden_states_first(layer, args, kwargs, mark)  # may move kwargs["hidden_states"] into args
            return previous(self, *args, **kwargs)
        finally:
            scope.layer_tracker.end(visit)

    setattr(forward, _PATCH_ATTR, True)
    return forward


def _patch_checkpoint_wrapper() -> None:
    global _wrapper_previous
    wrapper_cls = _checkpoint_wrapper_class()
    if wrapper_cls is None or getattr(wrapper_cls.__dict__.get("forward"), _PATCH_ATTR, False):
        return
    _wrapper_previous = wrapper_cls.__dict__["forward"]
    wrapper_cls.forward = _make_checkpoint_wrapper_forward(_wrapper_previous)


def _unpatch_checkpoint_wrapper() -> None:
    global _wrapper_previous
    wrapper_cls = _checkpoint_wrapper_class()
    if wrapper_cls is None or _wrapper_previous is _MISSING:
        return
    if getattr(wrapper_cls.__dict__.get("forward"), _PATCH_ATTR, False):
        wrapper_cls.forward = _wrapper_previous
        _wrapper_previous = _MISSING


def patch() -> None:
    """Install the marking `__call__` on GradientCheckpointingLayer (idempotent).

    Chains through whatever `__call__` is installed now (stock, Axolotl's or DeepSpeed's). If our
    wrapper is already installed (on top, or under a patch installed later that chains through
    it), this only makes sure it is active.
    """
    cls = _layer_class()
    with _lock:
        _forget_if_removed(cls)
        _patch_checkpoint_wrapper()
        if _state.installed is not None:
            _state.active = True
            return
        previous = cls.__dict__.get("__call__", _MISSING)
        wrapper = _make_wrapper(cls.__call__ if previous is _MISSING else previous)
        _state.installed, _state.previous, _state.active = wrapper, previous, True
        cls.__call__ = wrapper
        logger.debug("hsoffload: patched %s.__call__ (chaining through %r)", cls.__qualname__, previous)


def unpatch() -> bool:
    """Undo `patch()`. Returns True if the previous `__call__` was restored exactly.

    If another patch was installed over ours since, ours cannot be taken out of its chain: it is
    made a pure pass-through instead, a warning is logged and False is returned.
    """
    cls = _layer_class()
    with _lock:
        _forget_if_removed(cls)
        _unpatch_checkpoint_wrapper()
        undo_model_changes()  # the policies' module hooks and wrapped SAC context functions
        if _state.installed is None:
            return False
        if cls.__dict__.get("__call__") is _state.installed:
            if _state.previous is _MISSING:
                delattr(cls, "__call__")
            else:
                cls.__call__ = _state.previous
            _state.installed, _state.previous, _state.active = None, _MISSING, False
            return True
        _state.active = False
        logger.warning(
            "hsoffload.unpatch: %s.__call__ was patched again after hsoffload (%r); hsoffload's marking is now a "
            "pass-through inside that chain instead of being removed",
            cls.__qualname__,
            cls.__dict__.get("__call__"),
        )
        return False


def is_patched() -> bool:
    """True if the marking `__call__` is installed (on top or chained under a later patch) and active."""
    cls = _layer_class()
    with _lock:
        _forget_if_removed(cls)
        return _state.installed is not None and _state.active


def _overriding_classes(layers: list[torch.nn.Module], base: type) -> list[str]:
    """Layer classes whose own `__call__` shadows GradientCheckpointingLayer's."""
    names = set()
    for layer in layers:
        for klass in type(layer).__mro__:
            if klass is base:
                break
            if "__call__" in klass.__dict__:
                names.add(type(layer).__name__)
                break
    return sorted(names)


def check_model(model: torch.nn.Module, policy: Policy = "hidden_states") -> int:
    """Log (once per problem) why offload would do nothing for (part of) `model`; return the number
    of checkpointed layers whose inputs the patch will certainly mark (layers overriding `__call__`
    are not counted)."""
    cls = _layer_class()
    layers = [m for m in model.modules() if isinstance(m, cls)]
    if not layers:
        _log_once(
            f"nolayers:{type(model).__name__}",
            logging.WARNING,
            "hsoffload: %s has no transformers GradientCheckpointingLayer; hidden-state offload will do nothing. "
            "Mark tensors yourself with torch.ops.hsoffload.mark_hidden_state.",
            type(model).__name__,
        )
        return 0
    overriding = _overriding_classes(layers, cls)
    if overriding:
        _log_once(
            "override:" + ",".join(overriding),
            logging.WARNING,
            "hsoffload: %s override __call__; their inputs are offloaded only if that override calls "
            "super().__call__(hidden_states, ...), otherwise it bypasses the GradientCheckpointingLayer patch.",
            ", ".join(overriding),
        )
    if not marks_layer_inputs(policy):
        return len(layers)  # "all" and callables need no checkpointing
    wrapper_cls = _checkpoint_wrapper_class()
    wrapped = (
        {id(m._checkpoint_wrapped_module) for m in model.modules() if isinstance(m, wrapper_cls)}
        if wrapper_cls is not None
        else set()
    )
    checkpointed = [m for m in layers if getattr(m, "gradient_checkpointing", False) or id(m) in wrapped]
    if not checkpointed:
        _log_once(
            f"nockptmodel:{type(model).__name__}",
            logging.WARNING,
            "hsoffload: gradient checkpointing is off on every layer of %s; call "
            "model.gradient_checkpointing_enable() for hidden-state offload to take effect.",
            type(model).__name__,
        )
    bypassed = [m for m in checkpointed if _bypass_reason(m) is not None]
    if bypassed:
        name = type(bypassed[0]).__name__
        _log_once(f"bypass:{name}", logging.WARNING, "hsoffload: %s: %s.", name, _bypass_reason(bypassed[0]))
    overriding_set = set(overriding)
    return sum(1 for m in checkpointed if m not in bypassed and type(m).__name__ not in overriding_set)


def rebind_compiled_layers(model: torch.nn.Module) -> int:
    """Decoder layers wrapped by `torch.compile(layer)` (Accelerate's regional compilation) before `patch()` bound
    the stock `__call__`: re-initialise those wrappers so they trace the patched one. Returns how many."""
    cls = _layer_class()
    rebound = 0
    for module in model.modules():
        inner = getattr(module, "_orig_mod", None)
        if not isinstance(inner, cls) or not isinstance(module, torch.nn.Module):
            continue
        compiled_call = module.__dict__.get("_forward", module.__dict__.get("forward"))
        target = getattr(getattr(compiled_call, "_torchdynamo_orig_callable", None), "__func__", None)
        if target is None or getattr(target, _PATCH_ATTR, False) or not is_patched():
            continue
        if not hasattr(module, "_initialize"):
            _log_once(
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
        rebind_compiled_layers(model)
        check_model(model, policy=scope.config.policy)
        scope.bind_model(model)
    return scope
