"""A step's events: its start in a bucket (calibrating or decided), another forward before one backward, the
end of its backward, the optimizer's step."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ..._logging import log_once
from ..calibration import Shape, bucket_of
from .layers import _signature
from .optimizer import _optimizer_steps
from .phases import _PhaseMeter
from .records import Bucket, Step

logger = logging.getLogger("hsoffload")


class StepsMixin:
    """The controller's steps."""

    def _another_forward(self, scope: Any, shape: Shape) -> None:
        """A forward whose first layer runs before the previous forward's backward reached it (two losses, one
        backward): each holds what its choices keep. A decision is never changed between the forwards of one step:
        a forward beyond those the decision was made for, or of a shape its bucket does not cover, runs the leanest
        choice the ranks can run apart (one process: every layer offloaded; several: the decision's `none` layers
        stay, every other layer offloads, so that every rank recomputes the same layers), and the next micro-batch
        decides for the forwards seen (on every rank: the wish and the count are agreed there)."""
        assert self._step is not None
        self._step.forwards += 1
        if self._step.meter is not None:
            self._step.meter.on = False  # phases are measured with one forward
        if self._step.forwards > self.forwards:
            self.forwards = self._step.forwards
            log_once("auto-forwards", logging.INFO, "hsoffload: policy auto: %d forwards before one backward: each "
                     "holds what the decision keeps, and the decisions count them", self.forwards)
        step_bucket: Bucket = self._step.bucket
        larger = not step_bucket.shape.covers(bucket_of(shape))
        if larger:
            log_once("auto-forward-shape", logging.INFO, "hsoffload: policy auto: a later forward of one step has a "
                     "larger shape (%s) than its first (%s): it runs every checkpointed layer offloaded",
                     shape.key(), step_bucket.shape.key())
        if (self._step.forwards <= self._step.planned_forwards and not larger) or self._step.unplanned:
            return
        self._step.unplanned = True
        if self._step.decided:
            if not larger:
                self._urgent = f"{self.forwards} forwards before one backward"
                logger.info("hsoffload: policy auto: forward %d of a step whose decision was made for %d: it runs "
                            "every checkpointed layer offloaded, and the next micro-batch decides for %d",
                            self._step.forwards, self._step.planned_forwards, self.forwards)
            self._apply(scope)

    def _first_layer_backward_done(self, grad: torch.Tensor) -> None:
        """The gradient of a forward's first layer input: once every forward's has come, every layer's backward ran.
        The step's forward-and-backward peak and time are read here, before the embedding's gradient and the
        optimizer's step (their peak is read at the optimizer's step: `at_optimizer_step`)."""
        step = self._step
        if step is None or step.t1 is not None:
            return
        step.hooks -= 1
        if step.hooks > 0:
            return
        self._mark(step, "t1")
        step.peak = self.memory.peak()
        step.reserved = self.memory.reserved_peak()
        meter: Optional[_PhaseMeter] = step.meter
        if meter is not None and meter.on and meter.head is not None:
            meter.backward_ended(0)(grad)  # read, not reset: the rest of the step is the tail's
            step.peak = max(int(step.peak or 0), meter.largest())
            if meter.reserved is not None:
                step.reserved = max(int(step.reserved or 0), meter.reserved)

    def at_optimizer_step(self) -> None:
        """An optimizer holding this model's parameters stepped: the step's whole peak (the embedding's gradient and
        the optimizer's step included) is read now."""
        step = self._step
        if step is not None and step.t1 is not None and self.memory is not None:
            step.whole = self.memory.peak()

    def _count_start(self, start: int) -> bool:
        """What this micro-batch starts with, into what decisions count (the most over the last optimizer step's
        micro-batches: the later ones start with the gradients the first accumulated); returns whether it is an
        optimizer step's first."""
        boundary = _optimizer_steps.at_boundary(self)
        if boundary:
            self._cycle_starts = (self._cycle_starts[1], start)
        else:
            self._cycle_starts = (self._cycle_starts[0], max(self._cycle_starts[1], start))
        self.start_bytes = max(self._cycle_starts)
        return boundary

    def _begin(self, scope: Any, shape: Shape, start: int) -> None:
        """The step in the running bucket: calibrating (every layer offloaded, its phases measured) or decided.
        Measured steps (the device's peak counter reset at their start) are calibration and a decision's first step
        in its bucket; other steps leave the counter alone, so that an outer reader (the Trainer's memory metrics, a
        user's max_memory_allocated) sees their peaks too: they are verified by the counter's rise."""
        assert self.memory is not None and self.ranks is not None
        b = self.bucket
        decided = b.decision is not None
        measured = not decided or b.measured_decision != b.decision_index
        # The reserved peak must be the lean step's or the decision's own, not a cache an earlier step left (the
        # probe's, or a decision that held more): the last calibration step and a decision's first step start with
        # the allocator's cache given back.
        fresh = (b.decision_index, decided, b.calibrated)
        if (decided or b.calibrated == self.calibration_steps - 1) and fresh != b.fresh:
            b.fresh = fresh
            self.memory.empty_cache()
        watched = self.ranks.size == 1 or all(_signature(m) in self.collectives for _, m in self.layers)
        meter = None if decided else _PhaseMeter(self.memory, len(self._layer_refs))
        self._step = Step(shape, b, decided, b.decision, meter, probe=not decided and not b.probes and watched,
                          planned_forwards=b.decided_forwards if decided else self.forwards, start=start,
                          measured=measured, predicted=self.predicted_peak, index=b.decision_index, budget=self.budget)
        self._apply(scope)
        if measured:
            b.measured_decision = b.decision_index
            self.memory.reset_peak()
        self._step.counter0 = 0 if measured else int(self.memory.peak() or 0)
        self._step.reserved0 = 0 if measured else int(self.memory.reserved_peak() or 0)
        self._mark(self._step, "t0")

    def _enter(self, target: Shape, shape: Shape) -> None:
        """Run the coming step in bucket `target` (made, or taken from the restored file, at first use)."""
        b = self.buckets.get(target)
        if b is None:
            b = Bucket(target)
            restored = self._restored.pop(target.key(), None)
            if restored is not None:
                b.restored = restored
            self.buckets[target] = b
            if len(self.buckets) > 1 or target != shape:
                logger.info("hsoffload: policy auto: a batch of shape %dx%d%s: calibrating for its bucket, up to "
                            "%dx%d (%d calibrating steps)", shape.batch, shape.length,
                            " (quadratic attention)" if shape.quadratic else "", target.batch, target.length,
                            self.calibration_steps)
        self.bucket = b
