"""Patch `transformers.GradientCheckpointingLayer.__call__` to mark decoder-layer inputs for offload.

While an offload scope is active on this thread and a checkpointed layer is training with grad
enabled, the layer's `hidden_states` input is marked with `torch.ops.hsoffload.mark_hidden_state`
and passed on *positionally*: transformers binds keyword arguments into a `functools.partial`, so
only positional tensors reach the checkpoint's saved tensors (and so the offload hooks).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from typing import Any, Callable, Optional

import torch

from .scope import OffloadConfig, OffloadScope, current_scope

logger = logging.getLogger("hsoffload")

_PATCH_ATTR = "_hsoffload_patched"
_lock = threading.Lock()  # serialises patch()/unpatch()
# The __call__ installed before ours (stock transformers, Axolotl's or DeepSpeed's patch): we chain
# through it. Module state by nature: a monkeypatch is process-wide.
_previous_call: Optional[Callable[..., Any]] = None
_logged: set[str] = set()  # keys of "log once" messages


def _log_once(key: str, level: int, msg: str, *args: Any) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)


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


def _mark_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    previous = _previous_call
    assert previous is not None  # set before this function is installed
    if current_scope() is None or not self.training or not torch.is_grad_enabled():
        return previous(self, *args, **kwargs)
    if not getattr(self, "gradient_checkpointing", False):
        _log_once(
            f"nockpt:{type(self).__name__}",
            logging.WARNING,
            "hsoffload: %s runs without gradient checkpointing, so its hidden states are not offloaded; "
            "call model.gradient_checkpointing_enable() to offload them.",
            type(self).__name__,
        )
        return previous(self, *args, **kwargs)
    if torch.compiler.is_compiling():
        _log_once(
            "compiled",
            logging.WARNING,
            "hsoffload: %s is called inside a torch.compile region: the mark traces as identity and the compiled "
            "graph unpacks all its saved tensors at the start of its backward, so hidden-state offload has no "
            "effect there. Compile the layers' inner modules instead of the decoder layers.",
            type(self).__name__,
        )
        return previous(self, *args, **kwargs)
    if args:
        hidden = args[0]
        if isinstance(hidden, torch.Tensor):
            args = (torch.ops.hsoffload.mark_hidden_state(hidden),) + args[1:]
    elif isinstance(kwargs.get("hidden_states"), torch.Tensor) and _first_param_is_hidden_states(type(self)):
        # Keyword hidden_states would be bound into a partial and never saved by the checkpoint:
        # pass it positionally so the checkpoint (and our hooks) see it.
        hidden = kwargs.pop("hidden_states")
        args = (torch.ops.hsoffload.mark_hidden_state(hidden),)
    else:
        _log_once(
            f"nohidden:{type(self).__name__}",
            logging.WARNING,
            "hsoffload: %s was called without a hidden_states tensor as first positional or keyword argument; "
            "nothing to offload for it.",
            type(self).__name__,
        )
    return previous(self, *args, **kwargs)


def patch() -> None:
    """Install the marking `__call__` on GradientCheckpointingLayer (idempotent).

    Chains through whatever `__call__` is installed now (stock, Axolotl's or DeepSpeed's).
    """
    global _previous_call
    cls = _layer_class()
    with _lock:
        current = cls.__dict__.get("__call__")
        if getattr(current, _PATCH_ATTR, False):
            return
        _previous_call = current if current is not None else cls.__call__

        @functools.wraps(_previous_call)
        def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            return _mark_call(self, *args, **kwargs)

        setattr(__call__, _PATCH_ATTR, True)
        cls.__call__ = __call__
        logger.debug("hsoffload: patched %s.__call__", cls.__qualname__)


def unpatch() -> bool:
    """Restore the `__call__` that `patch()` replaced. Returns False (and logs) if another patch was
    installed over ours since: we then leave theirs in place."""
    global _previous_call
    cls = _layer_class()
    with _lock:
        current = cls.__dict__.get("__call__")
        if not getattr(current, _PATCH_ATTR, False):
            if _previous_call is not None:
                logger.warning(
                    "hsoffload.unpatch: %s.__call__ was replaced by another patch after ours; leaving it in place",
                    cls.__qualname__,
                )
            return False
        cls.__call__ = _previous_call
        _previous_call = None
        return True


def is_patched() -> bool:
    """True if the marking `__call__` is installed on GradientCheckpointingLayer."""
    return bool(getattr(_layer_class().__dict__.get("__call__"), _PATCH_ATTR, False))


def check_model(model: torch.nn.Module) -> int:
    """Log (once per problem) why offload would do nothing for `model`; return the number of
    checkpointed layers whose inputs will be marked."""
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
    overriding = sorted({type(m).__name__ for m in layers if "__call__" in type(m).__dict__})
    if overriding:
        _log_once(
            "override:" + ",".join(overriding),
            logging.WARNING,
            "hsoffload: %s override __call__ and bypass the GradientCheckpointingLayer patch; their inputs are "
            "not offloaded.",
            ", ".join(overriding),
        )
    active = [m for m in layers if getattr(m, "gradient_checkpointing", False) and "__call__" not in type(m).__dict__]
    if not active:
        _log_once(
            f"nockptmodel:{type(model).__name__}",
            logging.WARNING,
            "hsoffload: gradient checkpointing is off on every layer of %s; call "
            "model.gradient_checkpointing_enable() for hidden-state offload to take effect.",
            type(model).__name__,
        )
    return len(active)


def offload_hidden_states(
    model: Optional[torch.nn.Module] = None, config: Optional[OffloadConfig] = None, **kwargs: Any
) -> OffloadScope:
    """One line for training loops: patch transformers (once) and return an offload scope.

    `with hsoffload.offload_hidden_states() as scope: loss = model(**batch).loss; loss.backward()`.
    Pass `model` to have configuration problems reported up front.
    """
    patch()
    if model is not None:
        check_model(model)
    return OffloadScope(config, **kwargs)
