"""Why offload would do nothing for (part of) a model: the checks `check_model` runs up front and the once-per-cause
log lines the transformers patch emits per layer call. Reads models and logs; patches and changes nothing.
Thread-safety: stateless apart from `log_once`'s process-wide set of logged keys (locked there)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional, Sequence

import torch

from .._logging import log_once
from ..options import PolicyName
from .policy import Policy, marks_layer_inputs
from ..targets import (
    checkpoint_function,
    checkpoint_wrapper_class,
    checkpointing_enable_name,
    layer_class,
    uses_reentrant,
)


# Set once a bypass reason was logged in this process: the scope's "none was marked" warning (which advises marking
# and patching) would then contradict the reason given.
_bypass_reported = threading.Event()


def bypass_reported() -> bool:
    """Whether this process logged why a checkpointed layer's inputs cannot be offloaded (a bypass reason)."""
    return _bypass_reported.is_set()


def _report_bypass(name: str, reason: str) -> None:
    _bypass_reported.set()
    log_once(f"bypass:{name}", logging.WARNING, "hsoffload: %s: %s.", name, reason)


def _str_attr(obj: Any, name: str) -> str:
    value = getattr(obj, name, None)
    return value if isinstance(value, str) else ""


def bypass_reason(layer: torch.nn.Module) -> Optional[str]:
    """Why the offload hooks cannot see this layer's saved inputs, or None."""
    func, _ = checkpoint_function(layer)
    # Read once each and kept only as strings: the function may be any object of the user's (a mock, a proxy answers
    # every attribute with another object)
    qualname = _str_attr(func, "__qualname__")
    module = _str_attr(func, "__module__")
    if module == "deepspeed" or module.startswith("deepspeed."):
        # deepspeed.checkpointing.checkpoint (DeepSpeed's activation checkpointing, also what Megatron-style models
        # install) keeps the checkpoint's inputs on its autograd function's context, not as saved tensors.
        return (
            f"its gradient checkpointing function is DeepSpeed's ({module}.{qualname}), which keeps the layer inputs "
            "on its own autograd context instead of autograd's saved tensors, so no saved-tensor hook (hsoffload's "
            "included) ever sees them and nothing is offloaded; checkpoint with torch's instead: "
            f"model.{checkpointing_enable_name()}(...) with {{'use_reentrant': False}} and do not "
            "pass deepspeed.checkpointing.checkpoint as gradient_checkpointing_func (ZeRO stages work unchanged "
            "with torch's checkpoint), or drop hsoffload and use DeepSpeed's own activation_checkpointing "
            "cpu_checkpointing"
        )
    if "checkpointing_enable" in qualname and "<locals>" in qualname:
        # transformers >= 5.x `gradient_checkpointing_enable(offload=True)` (5.23: `activation_checkpointing_enable`,
        # its function made in `_activation_checkpointing_enable`): the checkpoint runs under torch's save_on_cpu, an
        # inner saved-tensor hook that takes every input first.
        return (
            "checkpointing was enabled with offload=True, whose save_on_cpu hook already moves every "
            "checkpoint input to host and hides them from hsoffload; enable checkpointing without offload=True"
        )
    return None


def report_inactive(layer: torch.nn.Module) -> bool:
    """Log (once per cause) and return True when this call cannot offload the layer's input."""
    name = type(layer).__name__
    if not getattr(layer, "gradient_checkpointing", False):
        log_once(
            f"nockpt:{name}",
            logging.WARNING,
            "hsoffload: %s runs without gradient checkpointing (checkpointing off, or every_n_layers > 1 skips "
            "it), so its hidden states are not offloaded; call model.%s(), or use "
            "policy='all', which offloads the saved activations of layers that are not checkpointed.",
            name,
            checkpointing_enable_name(),
        )
        return True
    reason = bypass_reason(layer)
    if reason is not None:
        _report_bypass(name, reason)
        return True
    return False


def report_checkpoint_not_reached(layer: torch.nn.Module) -> None:
    log_once(
        f"noreach:{type(layer).__name__}",
        logging.WARNING,
        "hsoffload: %s was to be offloaded but its call never reached its checkpoint function "
        "(layer._gradient_checkpointing_func), so nothing of it was offloaded; a subclass or wrapper that calls the "
        "layer's unwrapped forward bypasses transformers' checkpoint (and so hsoffload): call the layer itself.",
        type(layer).__name__,
    )


def report_missing_hidden_states(layer: torch.nn.Module) -> None:
    log_once(
        f"nohidden:{type(layer).__name__}",
        logging.WARNING,
        "hsoffload: %s was called without a hidden_states tensor as first positional argument (or as a keyword "
        "its forward takes first); nothing to offload for it.",
        type(layer).__name__,
    )


# The kernels' index wall on a decoder layer's input (hsoffload.planning.walls has the whole table, with sources):
# a hidden_states of 2^31 elements or more is past what Liger's Triton RMSNorm and FlashAttention-2 index.
INDEX_WALL_ELEMENTS = 1 << 31


def report_index_wall(layer: torch.nn.Module, x: torch.Tensor) -> None:
    """Warns once when a layer's hidden_states is past the 32-bit index wall (a size check: no cost on the hot path
    beyond reading numel)."""
    if x.numel() < INDEX_WALL_ELEMENTS:
        return
    log_once(
        "index_wall",
        logging.WARNING,
        "hsoffload: %s's hidden_states has %s elements: tokens x hidden per rank passes 2^31 elements, the wall of "
        "kernels that index in 32 bits (Liger's Triton RMSNorm, FlashAttention-2): they fault ('an illegal memory "
        "access'); more sequence parallelism, or kernels with 64-bit offsets (`hsoffload plan` names the walls)",
        type(layer).__name__, f"{x.numel():,}",
    )


def report_reentrant_without_grad(layer: torch.nn.Module, args: tuple) -> None:
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args) or not uses_reentrant(layer):
        return
    log_once(
        f"reentrant-nograd:{type(layer).__name__}",
        logging.WARNING,
        "hsoffload: %s uses reentrant checkpointing but none of its tensor inputs requires grad, so the "
        "checkpoint saves (and hsoffload offloads) nothing, and the layer gets no gradients; call "
        "model.enable_input_require_grads() (PEFT) or use use_reentrant=False.",
        type(layer).__name__,
    )


def report_sac_without_context(layer: torch.nn.Module) -> None:
    log_once(
        f"sac-nocontext:{type(layer).__name__}",
        logging.WARNING,
        "hsoffload: policy='sac' but %s is checkpointed without a selective context_fn (torch.utils.checkpoint."
        "create_selective_checkpoint_contexts, as context_fn in gradient_checkpointing_kwargs or to torch.distributed's "
        "checkpoint_wrapper), so SAC keeps nothing and only its hidden_states are offloaded",
        type(layer).__name__,
    )


def report_compiled_layer(layer: torch.nn.Module) -> None:
    log_once(
        "compiled-layer",
        logging.INFO,
        "hsoffload: %s.__call__ runs under torch.compile: hsoffload marks its inputs eagerly in a graph break at the "
        "layer's start and end (one extra graph per layer; whole-model compile is split at every decoder layer)",
        type(layer).__name__,
    )


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


def check_model(model: torch.nn.Module, policy: Policy = PolicyName.HIDDEN_STATES, *,
                modules: Optional[Sequence[torch.nn.Module]] = None) -> int:
    """Log (once per problem) why offload would do nothing for (part of) `model`; return the number
    of checkpointed layers whose inputs the patch will certainly mark (layers overriding `__call__`
    are not counted). `modules`: `list(model.modules())` where the caller has it already."""
    cls = layer_class()
    modules = list(model.modules()) if modules is None else modules
    layers = [m for m in modules if isinstance(m, cls)]
    if not layers:
        log_once(
            f"nolayers:{type(model).__name__}",
            logging.WARNING,
            "hsoffload: %s has no transformers GradientCheckpointingLayer; hidden-state offload will do nothing. "
            "Mark tensors yourself with torch.ops.hsoffload.mark_hidden_state.",
            type(model).__name__,
        )
        return 0
    overriding = _overriding_classes(layers, cls)
    if overriding:
        log_once(
            "override:" + ",".join(overriding),
            logging.WARNING,
            "hsoffload: %s override __call__; their inputs are offloaded only if that override calls "
            "super().__call__(hidden_states, ...), otherwise it bypasses the GradientCheckpointingLayer patch.",
            ", ".join(overriding),
        )
    if not marks_layer_inputs(policy):
        return len(layers)  # "all" and callables need no checkpointing
    wrapper_cls = checkpoint_wrapper_class()
    wrapped = (
        {id(m._checkpoint_wrapped_module) for m in modules if isinstance(m, wrapper_cls)}
        if wrapper_cls is not None
        else set()
    )
    checkpointed = [m for m in layers if getattr(m, "gradient_checkpointing", False) or id(m) in wrapped]
    if not checkpointed:
        log_once(
            f"nockptmodel:{type(model).__name__}",
            logging.WARNING,
            "hsoffload: gradient checkpointing is off on every layer of %s; call "
            "model.%s() for hidden-state offload to take effect.",
            type(model).__name__,
            checkpointing_enable_name(),
        )
    bypassed = [m for m in checkpointed if bypass_reason(m) is not None]
    if bypassed:
        _report_bypass(type(bypassed[0]).__name__, bypass_reason(bypassed[0]) or "")
    overriding_set = set(overriding)
    return sum(1 for m in checkpointed if m not in bypassed and type(m).__name__ not in overriding_set)
