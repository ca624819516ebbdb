"""Measuring steps: a calibration step's increase and phases into its bucket, a decided step verified against its
prediction (the margin, the allocator's gap, sac's learned cost)."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Optional

from ...choose import Choice, Decision, Phases
from .layers import _signature
from .phases import _PhaseMeter
from .records import Bucket, Step, StepRecord

logger = logging.getLogger("hsoffload")


VERIFY_STEPS = 3  # a decision with sac: its first this many steps' median time is checked against the prediction
TIME_SLACK = 0.10  # ... and sac's cost learned where that median passes the prediction by more than this share


class MeasureMixin:
    """The controller's reading of a step that ended."""

    def _mark(self, step: Step, key: str) -> None:
        """A time stamp of `step`: in a decided step an event on the compute stream where the device's events time
        (nothing waits: a decided step's time is only verified), else the host clock after a synchronize
        (calibration: its times are what decisions are made of)."""
        assert self.memory is not None
        event = self.memory.timing_event() if step.decided else None
        setattr(step, key, event if event is not None else self._sync_time())

    @staticmethod
    def _elapsed(t0: Any, t1: Any) -> float:
        if isinstance(t0, float) and isinstance(t1, float):
            return t1 - t0
        if isinstance(t0, float) or isinstance(t1, float):  # one stamp of each kind: cannot be compared
            return float("nan")
        t1.synchronize()  # waits for the step's own work only (the next step's is queued behind it)
        return t0.elapsed_time(t1) / 1e3

    def _sync_time(self) -> float:
        self.memory.synchronize()
        return time.perf_counter()

    def _end_step(self) -> Optional[str]:
        """Records the step that ended; returns why to decide again (None: the decision stands)."""
        step = self._step
        assert step is not None and self.memory is not None
        b: Bucket = step.bucket
        if not step.decided and self._layer_t0 is not None:
            self._layer_t0 = None  # the last layer's forward: measured as the others' mean below
        self._step = None
        if step.t1 is None:
            if step.hooks > 0:  # no backward reached the first layer (a forward only, or another graph): not a step
                return None
            self._mark(step, "t1")  # no hook possible: up to this step's start
            step.peak = self.memory.peak()
            step.reserved = self.memory.reserved_peak()
        peak, reserved = step.peak, step.reserved
        # with the optimizer's step, where a torch optimizer stepped
        whole = step.whole if step.whole is not None else peak
        if peak is None:
            return None
        whole = max(whole, peak)
        self.peak_read = max(self.peak_read, whole)
        if step.measured and step.whole is not None:  # the rest of the step (the optimizer's), where it passed the rest
            self.tail_increase = whole - step.start if whole > peak else 0
        measured_s = self._elapsed(step.t0, step.t1)
        decision: Optional[Decision] = step.decision
        predicted = step.predicted + step.start - b.decided_start_bytes if decision else None
        if not step.decided:
            self.history.append(StepRecord(step.shape.tokens, False, None, whole, None, measured_s, 0, reserved))
            return self._calibrated(b, step, peak, measured_s, reserved)
        # A measured step's counter was reset at its start: `whole` is its own peak. Another step's counter runs on
        # from earlier steps (and what the program allocated between them): a reading above the one at the step's
        # start was reached inside the step, and is its peak; one that did not rise says only that the step stayed
        # under an earlier peak (recorded as None).
        own = whole if step.measured or whole > step.counter0 else None
        self.history.append(StepRecord(step.shape.tokens, True, predicted, own, decision.step_s if decision else
                                       None, measured_s, step.index, reserved))
        if decision is None or step.unplanned:  # more forwards than decided for: decided again, not verified
            return None
        self.decided_steps += 1
        budget = step.budget  # the budget the step ran under (the user's may have changed since: a new budget
        # is the next decision's, never held against a step of the last one)
        expected = max(predicted, step.start + self.tail_increase)
        if self.decided_steps == 1 or (own is not None and own > expected):
            logger.info("hsoffload: policy auto: step measured %s peak (predicted %.1f, budget %.1f), %.1f ms "
                        "(predicted %.1f)", "an earlier" if own is None else f"{own / 2**20:.1f} MiB",
                        expected / 2**20, budget / 2**20, measured_s * 1e3, decision.step_s * 1e3)
        over = 0
        if own is not None and own > expected:
            over = own - expected
            self.margin += over
            if predicted + over + self.allocator_gap > budget:
                self.replans += 1
                return f"the measured peak {own / 2**20:.1f} MiB passed the prediction by {over / 2**20:.1f} MiB"
        if not step.measured and reserved is not None and reserved <= step.reserved0:
            reserved = None  # reached before this step (or between steps): not this step's
        if reserved is not None and reserved - budget > over and decision.fits:
            # What the allocator reserved passed the budget by more than the lent bytes' overshoot (now in the
            # margin): fragmentation beyond the gap measured; the gap grows by the rest and the decision is made again
            over = reserved - budget - over
            self.allocator_gap += over
            self.replans += 1
            return (f"the allocator reserved {reserved / 2**20:.1f} MiB, {over / 2**20:.1f} MiB over the budget "
                    "(its cache and fragmentation)")
        return self._verify_sac(decision, step.index, measured_s)

    def _calibrated(self, b: Bucket, step: Step, peak: int, measured_s: float,
                    reserved: Optional[int]) -> Optional[str]:
        """A calibration step of bucket `b` ended: its lean increase and time, scaled up to the bucket's top from
        the shape it ran at (bytes that grow with the length counted as growing with its square where attention is
        quadratic, times linearly). The lean increase is the most of the bucket's calibration steps without a probe
        (the probe's step holds the probe's own tensors for a while), or the probe's step's where it is the only one."""
        act, linear = b.shape.factors(step.shape)
        b.calibrated += 1
        forwards = step.forwards
        increase = math.ceil((peak - step.start) * act)
        probed = bool(step.probe)
        if probed:
            b.probe_step_increase = increase
        if b.lean_increase is None or (b.lean_probed and not probed):
            b.lean_increase, b.lean_forwards, b.lean_probed = increase, forwards, probed
        elif probed == b.lean_probed:
            top = max(forwards, b.lean_forwards)
            b.lean_increase = max(math.ceil(increase * top / forwards),
                                  math.ceil(b.lean_increase * top / b.lean_forwards))
            b.lean_forwards = top
        self._calibrated_phases(b, step, act, linear, self.sac_window - 1)
        if b.lean_step_s is None or not probed:  # a step without the probe's work, where there is one
            b.lean_step_s = measured_s * linear
        if reserved is not None:  # only grows (a decided step's overshoot may have grown it)
            self.allocator_gap = max(self.allocator_gap, reserved - peak)
        if b.restored is not None:
            self._adopt = (b.shape, self._matches_restored(b))
        return None  # the bucket decides when a batch of it next comes (other buckets' decisions stand)

    @staticmethod
    def _calibrated_phases(b: Bucket, step: Step, act: float, linear: float, depth: int) -> None:
        """A calibration step's peak by phase, above its start and scaled like its increase (only what grew is
        scaled up), into `b.phases`: the most per phase of the steps without a probe (the probe's where it is the
        only one)."""
        meter: Optional[_PhaseMeter] = step.meter
        if meter is None or not meter.complete():
            return
        start, n = step.start, meter.layers

        def up(nbytes: int) -> int:
            return math.ceil(nbytes * act) if nbytes > 0 else nbytes

        assert meter.head is not None
        now = Phases(up(meter.head - start), tuple(up(meter.backward[i] - start) for i in range(n)), 0,
                     tuple(up(meter.forward[i] - start) for i in range(n)),
                     tuple(up(meter.forward[i] - meter.forward_start[i]) for i in range(n)),
                     tuple(up(meter.backward[i] - meter.backward_start[i]) for i in range(n)),
                     # each backward phase's restored inputs: the `depth` below it (prefetched at its unpack) and its
                     # own (prefetched at the layer above's; the last layer's is its own phase's work, in the excess)
                     tuple(math.floor(sum(b.held_keep.get(j, 0) for j in range(max(0, i - depth), i))
                                      * linear) for i in range(n)),
                     shared=math.floor(meter.shared * linear))  # not scaled up: the smaller, the safer
        probed = bool(step.probe)
        if b.phases is None or (b.phases_probed and not probed):
            b.phases, b.phases_probed = now, probed
        elif probed == b.phases_probed:
            b.phases = b.phases.safer(now)

    def _verify_sac(self, decision: Decision, index: int, measured_s: float) -> Optional[str]:
        """A decision with sac: the median of its first VERIFY_STEPS steps against the prediction. sac's cost is the
        one the model does not see whole (the selective checkpoint's dispatch runs on every op of the layer, in
        forward and recompute; its projections are many small copies): past TIME_SLACK, the excess is learned as sac's
        per layer and the decision made again (sac kept only where it still pays)."""
        if (self.report_only or Choice.SAC not in decision.choices or index != self.decisions
                or not math.isfinite(measured_s)):
            return None
        self.bucket.verify.append(measured_s)
        if len(self.bucket.verify) != VERIFY_STEPS:
            return None
        measured = sorted(self.bucket.verify)[VERIFY_STEPS // 2]
        if measured <= decision.step_s * (1 + TIME_SLACK):
            return None
        sac = [k for k, c in enumerate(decision.choices) if c is Choice.SAC]
        per_layer = (measured - decision.step_s) / len(sac)
        layers = self.layers
        for kind in {_signature(layers[k][1]) for k in sac}:
            self.sac_extra_per_token[kind] = self.sac_extra_per_token.get(kind, 0.0) + per_layer / max(1, self.tokens)
        self.replans += 1
        return (f"its steps with sac measured {measured * 1e3:.1f} ms against {decision.step_s * 1e3:.1f} ms "
                f"predicted: sac's cost learned, {per_layer * 1e3:.1f} ms more per layer")
