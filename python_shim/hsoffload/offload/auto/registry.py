"""One controller per model, beside it while it lives; the optimizer-step hook that marks an optimizer step's first
micro-batch; and the public functions that reach a model's controller."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ..._logging import log_once
from ...choose import Choice
from .controller import AutoController
from .optimizer import _controllers

logger = logging.getLogger("hsoffload")


def controller_for(model: torch.nn.Module, layer_cls: type, config: Any) -> AutoController:
    """The model's controller, made at first use with `config`'s auto options (a later scope with another budget
    sets it)."""
    ctl = _controllers.get(model)
    if ctl is None:
        ctl = AutoController(model, layer_cls, config.device_budget, config.auto_calibration_steps,
                             config.auto_report_only, config.auto_state_path)
        ctl.sac_window = config.prefetch_depth + 1
        _controllers[model] = ctl
    else:
        ctl.report_only = config.auto_report_only
        ctl.calibration_steps = config.auto_calibration_steps
        if config.prefetch_depth + 1 != ctl.sac_window:
            ctl.sac_window = config.prefetch_depth + 1
            ctl.request("prefetch_depth changed")
        if config.auto_state_path is not None:
            ctl.state_path = config.auto_state_path
        if config.device_budget is not None and config.device_budget != ctl.budget_arg:
            ctl.budget_arg = ctl.budget = config.device_budget
            ctl.request("device_budget changed")
    return ctl


def pin(model: torch.nn.Module, pins: dict[str, str]) -> None:
    """Fix some layers' choices (layer name -> "none", "keep", "sac" or "offload"); policy "auto" decides the others.
    Takes effect at the model's next decision (call before its first step, or with its scope's next budget)."""
    ctl = _controllers.get(model)
    if ctl is None:
        raise RuntimeError("hsoffload: pin() needs a model with policy auto: enter "
                           "hsoffload.offload_hidden_states(model, policy='auto', ...) once first")
    names = {n for n, _ in ctl.layers}
    parsed = {k: Choice.parse(v, f"the pin of {k}") for k, v in pins.items()}
    unknown = sorted(set(parsed) - names)
    if unknown:
        raise ValueError(f"hsoffload: pin() names layers this model does not have: {', '.join(unknown)}")
    ctl.pins.update(parsed)
    ctl.request("pins changed")


def report_unseen(layer: torch.nn.Module, why: str) -> None:
    """A decoder layer policy auto cannot choose for (it runs as hidden_states): said once per cause."""
    log_once(f"auto-unseen-{why}", logging.WARNING, "hsoffload: policy auto cannot choose for %s (%s): it runs as "
             "policy hidden_states (every such layer checkpointed and offloaded)", type(layer).__name__, why)


def controller(model: torch.nn.Module) -> Optional[AutoController]:
    """The model's controller, if policy auto ever ran on it."""
    return _controllers.get(model)
