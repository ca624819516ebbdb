"""What policy auto reads of a decoder layer and its call: its kind, whether its parameters are sharded, its
attention, the batch's shape, and transformers 4.5x's output recorders (kept out of a probe)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from typing import Any, Iterator, Optional

import torch

from ..calibration import Shape, quadratic_attention

logger = logging.getLogger("hsoffload")


def _signature(layer: torch.nn.Module) -> tuple:
    """A layer's kind: its class and its parameters' names, full shapes and dtypes (DeepSpeed ZeRO-3's `ds_shape`:
    its partitioned parameters change shape as they are gathered and released)."""
    return (type(layer).__qualname__,) + tuple((n, tuple(getattr(p, "ds_shape", p.shape)), p.dtype)
                                               for n, p in layer.named_parameters())


def _sharded(layer: torch.nn.Module) -> bool:
    """Whether the layer's parameters are shards that its forward gathers (FSDP2's DTensors or FSDP module, FSDP1's
    flat-parameter views, DeepSpeed ZeRO-3's partitioned parameters)."""
    if any(type(m).__name__.startswith(("FSDP", "FullyShardedDataParallel")) for m in layer.modules()):
        return True
    for p in layer.parameters():
        if hasattr(p, "ds_id") or hasattr(p, "_local_tensor") or hasattr(p, "_is_flat_param") or p.numel() == 0:
            return True
    return False


def _first_tensor(out: Any) -> Optional[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    return getattr(out, "last_hidden_state", None)


def _attention_implementation(layer: torch.nn.Module) -> Optional[str]:
    """The attention implementation a decoder layer's config names (transformers' `_attn_implementation`), None where
    none of its modules has a config."""
    for module in layer.modules():
        impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if isinstance(impl, str):
            return impl
    return None


def _attention_dropout(layer: torch.nn.Module) -> float:
    """The attention dropout a decoder layer's config names (0.0 where none)."""
    for module in layer.modules():
        p = getattr(getattr(module, "config", None), "attention_dropout", None)
        if isinstance(p, (int, float)):
            return float(p)
    return 0.0


def _shape(layer: torch.nn.Module, x: torch.Tensor, args: tuple, kwargs: dict) -> Shape:
    """The shape of the batch whose first decoder layer input is `x` (batch, length, hidden): what policy auto
    calibrates and scales by, the attention being quadratic where the layer's implementation or a 4-D mask among
    its inputs says so."""
    length = int(x.shape[-2]) if x.dim() >= 2 else 1
    batch = x.numel() // max(1, int(x.shape[-1]) * length)
    tensors = []
    for v in (*args[1:], *kwargs.values()):
        if isinstance(v, (tuple, list)):
            tensors.extend(t for t in v[:8] if isinstance(t, torch.Tensor))
        elif isinstance(v, torch.Tensor):
            tensors.append(v)
    impl = _attention_implementation(layer)
    if impl == "sdpa" and layer.training and _attention_dropout(layer) > 0:
        impl = "sdpa-math"  # SDPA with dropout in training takes the math path on the CPU (and may on CUDA)
    return Shape(batch, length, quadratic_attention(impl, tensors, x.device.type))


def _is_capture_wrapper(fn: Any) -> bool:
    """transformers 4.5x's `check_model_inputs` output recorder: a function it sets as a module's `forward` for the
    model call, identified by its code object (its own file and name: `functools.wraps` gave it the wrapped
    forward's name), never by an attribute it answers."""
    code = getattr(fn, "__code__", None) if inspect.isfunction(fn) else None
    if code is None or not hasattr(fn, "__wrapped__"):
        return False
    name = getattr(code, "co_qualname", code.co_name)
    return name.endswith("wrapped_forward") and code.co_filename.replace(os.sep, "/").endswith(
        "transformers/utils/generic.py")


@contextlib.contextmanager
def _no_output_capture(layer: torch.nn.Module) -> Iterator[None]:
    """The probe's forward must not add to the model call's collected outputs (a second router-logits entry, a
    graph freed twice, a hidden state more): transformers >= 5 collects through the call's collector (switched off
    here); 4.5x's `check_model_inputs` wraps the forwards of the decoder layer and the modules in it (unwrapped here,
    for `layer`'s modules only, and put back after)."""
    unwrapped = []
    for module in layer.modules():
        fn = module.__dict__.get("forward")
        if fn is not None and _is_capture_wrapper(fn):
            unwrapped.append((module, fn))
            inner = fn.__wrapped__
            for _ in range(8):  # a module recorded for several keys is wrapped once per key
                if not _is_capture_wrapper(inner):
                    break
                inner = inner.__wrapped__
            module.__dict__["forward"] = inner
    try:
        collector = None
        try:
            from transformers.utils import output_capturing

            collector = getattr(output_capturing, "_active_collector", None)
        except ImportError:
            pass
        if collector is None:
            yield
            return
        token = collector.set(None)
        try:
            yield
        finally:
            collector.reset(token)
    finally:
        for module, fn in unwrapped:
            module.__dict__["forward"] = fn
