"""The decision: a bucket's measurements scaled to its top shape, agreed across ranks, handed to hsoffload.choose."""

from __future__ import annotations

import logging
import math
from typing import Optional

from ..._logging import log_once
from ...choose import Choice, LayerCost, Phases, choose, predict, prefetch_depths
from ..calibration import Shape
from .device import BUDGET_FRACTION, HEADROOM_FRACTION, default_budget
from .layers import _signature
from .records import NEVER, Bucket, Wish

logger = logging.getLogger("hsoffload")


class DecideMixin:
    """The controller's decisions."""

    def _decide(self, why: str) -> None:
        """The running bucket's decision, from its measurements scaled up to its top shape (made on every rank at
        once: the costs and rooms agreed)."""
        b = self.bucket
        assert b.lean_increase is not None and b.lean_step_s is not None
        # A layer's forward time: the mean over the layers of its kind (alike layers cost alike, whatever the timer's
        # noise; the decision then lays them out canonically, as the planner does).
        layers = self.layers
        kinds = [_signature(layer) for _, layer in layers]
        by_kind: dict[tuple, list[float]] = {}
        for k, kind in enumerate(kinds):
            if k in b.forward_s:
                by_kind.setdefault(kind, []).append(b.forward_s[k])
        known = [t for ts in by_kind.values() for t in ts]
        mean_fwd = sum(known) / len(known) if known else 0.0
        # At the bucket's top shape: a probe's bytes by the activations' factor (length squared where attention is
        # quadratic), a layer's input and times by the tokens'; each forward in flight holds its own.
        pa, pl = b.shape.factors(b.probe_shape or b.shape)
        _, fl = b.shape.factors(b.forward_shape or b.shape)
        forwards = self.forwards
        costs = []
        for k, ((name, _), kind) in enumerate(zip(layers, kinds)):
            probe = b.probes.get(kind)
            times = by_kind.get(kind)
            fwd = sum(times) / len(times) if times else mean_fwd
            held_none = probe.held_none if probe else NEVER
            costs.append(LayerCost(
                name=name, held_none=held_none if held_none >= NEVER else math.ceil(held_none * pa * forwards),
                held_keep=math.ceil(b.held_keep[k] * fl * forwards) if k in b.held_keep else NEVER,
                forward_s=fwd * fl, backward_s=(probe.backward_s * pl) if probe else 2 * fwd * fl,
                copy_s=(probe.copy_s * pl) if probe else 0.0,
                # per step like held_keep (each forward in flight copies its own); 0 where the layer's checkpoint can
                # no longer take the selective context (restored measurements, a function changed since the probe)
                sac_bytes=math.ceil(probe.sac_bytes * pl * forwards) if probe and self._selective_offered(
                    layers[k][1]) else 0,
                projection_s=probe.projection_share * fwd * fl if probe else 0.0,
                sac_extra_s=self.sac_extra_per_token.get(kind, 0.0) * b.tokens,
                none_forward=math.ceil(probe.none_forward * pa * forwards) if probe else 0,
                none_backward=math.ceil(probe.none_backward * pa * forwards) if probe else 0))
        lean = [Choice.OFFLOAD] * len(layers)
        lean_depth = self.sac_window - 1  # the configured prefetch depth, the calibration's
        _, lean_s = predict(costs, lean, 0, 0.0, self.sac_window, lean_depth)
        fixed_s = b.lean_step_s - lean_s  # the step without any layer's extra: what the lean step measured, less
        phases = self._lean_phases(b)
        if self.budget_arg is None:
            self._default_budget()
        slack = self.budget - self.margin - self.allocator_gap  # what the decision's predicted peak may reach
        host_room = self._host_room(costs)
        costs, fixed_s, slack, phases, host_room = self._agree(costs, fixed_s, slack, phases, host_room)
        b.costs = costs
        b.decided_start_bytes = self.start_bytes
        # the agreed window: the ranks' deepest configured prefetch (one set of depths everywhere)
        b.decision = choose(costs, slack, phases, fixed_s, self.pins, self.sac_window, host_room,
                            prefetch_depths=prefetch_depths(self.sac_window - 1))
        if self.start_bytes + self.tail_increase > self.budget:
            log_once("auto-tail-over", logging.WARNING, "hsoffload: policy auto: the step after backward (the "
                     "embedding's gradient, the optimizer's step) reached %.1f MiB, over the %.1f MiB budget: no "
                     "choice of the decoder layers brings it under", (self.start_bytes + self.tail_increase) / 2**20,
                     self.budget / 2**20)
        self.decisions += 1
        b.decision_index = self.decisions
        b.decided_forwards = self.forwards
        b.stale = None
        b.reason = why
        self.decision_log.append(f"{''.join(str(c)[0] for c in b.decision.choices)} ({why}; {b.shape.key()})")
        b.verify = []
        self._save()
        logger.info("hsoffload: policy auto, decision %d (%s; bucket %s, %d tokens; margin %.1f MiB)%s:\n%s",
                    self.decisions, why, b.shape.key(), b.tokens, self.margin / 2**20,
                    " REPORT ONLY, every layer offloaded" if self.report_only else "", b.decision.table(costs))

    def _lean_phases(self, b: Bucket) -> Phases:
        """Bucket `b`'s leanest step by phase, for a step that starts with what steps start with now: measured where
        a calibration step with one forward measured every phase and steps run one forward; else one bound for every
        phase (the lean peak, for the forwards steps run)."""
        if b.phases is not None and max(self.forwards, b.lean_forwards) == 1:
            return b.phases.shifted(self.start_bytes)
        lean_peak = self.lean_peak
        assert lean_peak is not None
        return Phases.flat(lean_peak, len(self._layer_refs))

    def _host_room(self, costs: list[LayerCost]) -> Optional[int]:
        """The host bytes sac's projections may take per forward: the host budget (max_host_bytes, resolved) less
        what is held now and the inputs every layer may offload; None where the budget is unlimited."""
        from ..host import budget_stats  # noqa: PLC0415  (the host budget's owner)

        stats = budget_stats()
        if stats.limit <= 0:
            return None
        inputs = sum(c.held_keep for c in costs if c.held_keep < NEVER)  # every forward's (held_keep counts them)
        return max(0, stats.limit - stats.in_flight - inputs)

    def _default_budget(self) -> None:
        """Without device_budget: the device's memory less what the process holds outside the allocator now (after
        full steps: the CUDA context, communicators' buffers; other processes too) less HEADROOM_FRACTION of it, at
        most BUDGET_FRACTION of it."""
        assert self.memory is not None
        total, outside = self.memory.total(), self.memory.outside_allocator()
        if total is None or outside is None:
            return
        budget = default_budget(total, outside)
        if budget != self.budget:
            logger.info("hsoffload: policy auto: device_budget %.2f GiB: %s's %.2f GiB less %.2f GiB held outside the "
                        "allocator and %.0f%% headroom (at most %.0f%%)", budget / 2**30, self.memory.device,
                        total / 2**30, outside / 2**30, HEADROOM_FRACTION * 100, BUDGET_FRACTION * 100)
            self.budget = budget

    def _predicted_at(self, bucket: Bucket, start: int) -> int:
        """`bucket`'s decision's predicted peak for a step that starts with `start` bytes (the margin and the
        allocator's gap included)."""
        assert bucket.decision is not None
        return bucket.decision.peak_bytes + self.margin + self.allocator_gap + start - bucket.decided_start_bytes

    def request(self, why: str) -> None:
        """Decide again (after calibration) for what the user changed (a budget, pins): at once in one process; on
        several ranks at the next micro-batch's start, where the wish is agreed and every rank marks the same
        decisions to be made again (a rank marking its own alone would decide, and all-reduce, alone: a hang)."""
        if self.ranks is None or self.ranks.size > 1:
            self._pending = why
            return
        for b in self.buckets.values():
            if b.decision is not None:
                b.stale = b.stale or why
        if self.bucket.ready(self.calibration_steps):
            self._decide(why)

    def _wish(self, local: Shape, start: int, reason: Optional[str], urgent: Optional[str]
              ) -> tuple[Optional[str], Wish]:
        """Whether this rank wishes a decision at this micro-batch's start, and why: what steps start with grew
        (a due decision), a decision no longer fits what this step starts with, whatever bucket it is for, or more
        forwards came than decided for (at once)."""
        mine = self.buckets.get(local)
        if (reason is None and mine is not None and mine.decision is not None and not self.report_only
                and self.start_bytes > mine.decided_start_bytes + 0.01 * self.budget):
            reason = (f"steps now start with {(self.start_bytes - mine.decided_start_bytes) / 2**20:.1f} MiB more "
                      "on the device (the optimizer's states, gradients, or another model)")
        wish = Wish.NOTHING if reason is None and urgent is None else Wish.DUE
        unfit = [b for b in self.buckets.values() if b.decision is not None and b.decision.fits
                 and self._predicted_at(b, start) > self.budget]
        if unfit:
            reason = reason or (f"a decision no longer fits: this step starts with {start / 2**20:.1f} MiB on the "
                                "device")
        if urgent is not None or unfit:
            wish = Wish.NOW
        return reason, wish

    def _decide_due(self, wish: Wish, boundary: bool) -> None:
        """The running bucket's decision where it is due: its first once calibrated, one for more forwards, and a
        stale one at an optimizer step's first micro-batch (or at once where wished)."""
        b = self.bucket
        if not b.ready(self.calibration_steps):
            return
        if b.decision is None:
            self._decide(b.stale or "calibrated")
        elif b.decided_forwards < self.forwards:
            self._decide(b.stale or f"{self.forwards} forwards before one backward")
        elif b.stale is not None and (boundary or wish is Wish.NOW):
            self._decide(b.stale)

