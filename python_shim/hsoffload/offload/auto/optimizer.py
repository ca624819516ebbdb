"""The optimizer-step hook that tells a controller its micro-batch is an optimizer step's first, and the map of
every model's controller (the hook's to walk)."""


from __future__ import annotations

import weakref
from typing import Any

import torch


class _OptimizerSteps:
    """Counts, per controller, the steps of optimizers that hold its model's parameters (torch.optim's global step
    post-hook, registered at first use), so that a controller can tell an optimizer step's first micro-batch. The
    hook is process-wide by nature; it runs on the thread that steps the optimizer, the count is read on the one that
    runs forward (the same, in a training loop)."""

    def __init__(self) -> None:
        self._hooked = False

    def _step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for ctl in list(_controllers.values()):
            if any(id(p) in held for _, layer in ctl.layers for p in layer.parameters()):
                ctl.optimizer_steps += 1
                ctl.at_optimizer_step()

    def at_boundary(self, ctl: Any) -> bool:
        """Whether `ctl`'s micro-batch starting now is an optimizer step's first: its model's optimizer stepped since
        its last micro-batch, or never did (no torch optimizer holds its parameters, as under DeepSpeed, whose
        optimizer holds copies; or before the first step): then every micro-batch is one."""
        if not self._hooked:
            self._hooked = True
            from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: PLC0415

            register_optimizer_step_post_hook(self._step)
        seen, ctl._optimizer_steps_seen = ctl._optimizer_steps_seen, ctl.optimizer_steps
        return ctl.optimizer_steps == 0 or ctl.optimizer_steps != seen


_optimizer_steps = _OptimizerSteps()

# One controller per model, beside it while it lives (the decision is the model's, across scopes and steps): the
# process-wide map is the optimizer hook's (itself process-wide) to walk; used on the training thread.
_controllers: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()
