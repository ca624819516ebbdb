"""What the DeepSpeed tests compare, read the same way in every worker: the full (unpartitioned) gradients before an
optimizer step and the full float32 parameters after it, gathered with DeepSpeed's own `safe_get_full_*` helpers.
`recording_engine_steps` records both around each `DeepSpeedEngine.step` at an accumulation boundary, for runs where
the engine is driven by someone else (HF Trainer / accelerate run the step inside their backward)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def full_grads(engine: Any) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_grad

    return {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}


@contextlib.contextmanager
def recording_engine_steps(record: dict[str, Any]) -> Iterator[None]:
    """Inside the block every `DeepSpeedEngine.step` at an accumulation boundary appends `full_grads` (before) to
    record["grads"] and `full_params` (after) to record["params"]; the real step is restored at exit."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    real_step = DeepSpeedEngine.step

    def recording_step(engine: Any, *args: Any, **kwargs: Any) -> Any:
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary:
            record["grads"].append(full_grads(engine))
        result = real_step(engine, *args, **kwargs)
        if boundary:
            record["params"].append(full_params(engine))
        return result

    DeepSpeedEngine.step = recording_step
    try:
        yield
    finally:
        DeepSpeedEngine.step = real_step
