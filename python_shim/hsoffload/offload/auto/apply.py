"""A decision applied to the layers: each layer's checkpointing flag, its offload selection, the `sac` context."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from ...choose import Choice
from ...targets import LAYER_ATTR
from . import selective
from .selective import _is_selective, _selective_ready

logger = logging.getLogger("hsoffload")

_ABSENT = object()  # a layer without its own checkpoint function (transformers' is on its class)


class ApplyMixin:
    """The controller's application of its decision."""

    def choices(self) -> list[Choice]:
        """What each layer runs with now."""
        if self.bucket.decision is None or self.report_only:
            return [Choice.OFFLOAD] * len(self.layers)  # calibration (the lean baseline), or report only
        if self._step is not None and self._step.unplanned:
            # a forward beyond those the decision was made for: the leanest the ranks can run apart
            if self.ranks is not None and self.ranks.size > 1:
                return [c if c is Choice.NONE else Choice.OFFLOAD for c in self.bucket.decision.choices]
            return [Choice.OFFLOAD] * len(self.layers)
        return list(self.bucket.decision.choices)

    def prefetch_depth(self) -> int:
        """The prefetch depth run now: the decision's, or the configured one (calibration, report only)."""
        if self.bucket.decision is None or self.report_only or self.bucket.decision.prefetch_depth is None:
            return self.sac_window - 1
        return self.bucket.decision.prefetch_depth

    def offloads_none(self) -> bool:
        """The layers run now offload nothing (a decision of only none and keep)."""
        return not {Choice.OFFLOAD, Choice.SAC} & set(self.choices())

    def _apply(self, scope: Any) -> None:
        tracker = scope.layer_tracker
        scope.set_prefetch_depth(self.prefetch_depth())
        for (name, layer), choice in zip(self.layers, self.choices()):
            if id(layer) not in self._flags:
                self._flags[id(layer)] = bool(getattr(layer, "gradient_checkpointing", False))
            layer.gradient_checkpointing = choice is not Choice.NONE
            self._set_selective(layer, choice is Choice.SAC)
            stats = tracker.layers.get(name)
            if stats is not None:
                stats.selected = choice in (Choice.OFFLOAD, Choice.SAC)

    def _set_selective(self, layer: torch.nn.Module, on: bool) -> None:
        """Give a `sac` layer's checkpoint the selective context (SAC_CONTEXT), or its own function back."""
        entry = self._checkpoints.get(id(layer))
        installed = layer.__dict__.get(LAYER_ATTR, _ABSENT)
        if entry is not None:
            if _is_selective(installed):
                entry[1] = installed  # ours, as the patch wrapped it (its SAC memory kept for the next time)
            elif installed is not entry[0]:  # the user set another checkpoint function since: theirs from now on
                del self._checkpoints[id(layer)]
                entry = None
        if not on:
            if entry is not None and _is_selective(installed):
                if entry[0] is _ABSENT:
                    del layer.__dict__[LAYER_ATTR]
                else:
                    layer.__dict__[LAYER_ATTR] = entry[0]
            return
        if entry is None:
            func = _selective_ready(layer)
            if func is None:  # the decision offers sac only where the probe found it ready
                raise RuntimeError(f"hsoffload: policy auto chose sac for {type(layer).__name__}, whose checkpoint "
                                   "function changed since it was probed (it is no longer torch's non-reentrant "
                                   "checkpoint without a context_fn): call auto.pin() with keep or offload for it")
            entry = [installed, functools.partial(func.func, *func.args, **{**func.keywords,
                                                                             "context_fn": selective.SAC_CONTEXT})]
            self._checkpoints[id(layer)] = entry
        layer.__dict__[LAYER_ATTR] = entry[1]

    def _selective_offered(self, layer: torch.nn.Module) -> bool:
        """Whether sac can be applied to `layer` now: its checkpoint is ready, or the selective one is installed."""
        return _selective_ready(layer) is not None or id(layer) in self._checkpoints

    def restore(self) -> None:
        """Give every layer back the gradient_checkpointing flag and the checkpoint function it had (the scope
        exits)."""
        for _, layer in self.layers:
            if id(layer) in self._flags:
                layer.gradient_checkpointing = self._flags.pop(id(layer))
            if id(layer) in self._checkpoints:
                self._set_selective(layer, False)
