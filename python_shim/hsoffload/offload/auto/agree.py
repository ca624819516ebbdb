"""Agreement across ranks: every rank of a job applies one decision from the same step on
(`hsoffload.offload.ranks`)."""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib
from typing import Optional

from ...choose import LayerCost, Phases
from ..calibration import Shape, agreed_bucket
from .records import NEVER, Wish

logger = logging.getLogger("hsoffload")


class AgreeMixin:
    """The controller's collectives: one per micro-batch (the bucket and the wishes), one per decision (the costs)."""

    def _agree_step(self, local: Shape, want: Wish, boundary: bool,
                    adopt: Optional[tuple[Shape, bool]]) -> tuple[Shape, int, bool, bool, int]:
        """The ranks' one collective per micro-batch (at its first layer): the bucket (the largest batch, length
        and attention of the ranks'), the strongest wish to decide (0 none, 1 due, 2 the running decision no longer
        fits), whether every rank is at an optimizer step's first micro-batch, and whether every rank's check of a
        restored bucket passed. Raises on every rank if their models or controller states differ (their next
        collectives would not match: a hang)."""
        assert self.ranks is not None
        state = zlib.crc32(repr(([n for n, _ in self.layers], sorted(
            (k.key(), b.calibrated, b.decision is not None, b.stale is not None, len(b.probes))
            for k, b in self.buckets.items()),
            self.decisions, adopt[0].key() if adopt else None)).encode())
        failed = 1.0 if adopt is not None and not adopt[1] else 0.0
        agreed, same = self.ranks.max_and_same(
            [local.batch, local.length, 1.0 if local.quadratic else 0.0, float(want), 0.0 if boundary else 1.0, failed,
             self.forwards], [state])
        if not same:
            raise RuntimeError("hsoffload: policy auto: the ranks' models or auto states differ (decoder layers, the "
                               "buckets calibrated, calibration steps, decisions or probes): every rank must run the "
                               "same model through the same steps, forward and backward, for one decision to hold")
        target = agreed_bucket(agreed[:3])
        return target, int(agreed[3]), agreed[4] == 0, agreed[5] == 0, int(agreed[6])

    def _agree(self, costs: list[LayerCost], fixed_s: float, slack: int, phases: Phases, host_room: Optional[int]
               ) -> tuple[list[LayerCost], float, int, Phases, Optional[int]]:
        """On several ranks: each layer's largest cost over the ranks, the longest fixed time, each phase's largest
        lean peak and the smallest budgets (the device's, the host's), so that the deterministic chooser makes one
        decision everywhere. Raises on every rank if the ranks' models or pins differ (a decision for different
        layers cannot be one)."""
        assert self.ranks is not None
        if self.ranks.size == 1:
            return costs, fixed_s, slack, phases, host_room
        fields = ("held_none", "held_keep", "forward_s", "backward_s", "copy_s", "sac_bytes", "projection_s",
                  "sac_extra_s", "none_forward", "none_backward")
        pins = zlib.crc32(repr(sorted((k, v.value) for k, v in self.pins.items())).encode())
        shape = zlib.crc32(repr([c.name for c in costs]).encode())
        flat = [float(getattr(c, f)) for c in costs for f in fields]
        unlimited = float(NEVER)
        # sac is offered for a layer only if every rank can apply it (-1 where offered: the max is -1 iff all are)
        offered = [-1.0 if c.sac_offered else 0.0 for c in costs]
        # every rank's phases in one shape (a flat bound where one measured none: its per-layer tuples filled)
        n = len(costs)
        full = dataclasses.replace(phases, layers=phases.layers or (0,) * n,
                                   layer_work=phases.layer_work or (1 << 50,) * n,
                                   backward_work=phases.backward_work or (1 << 50,) * n)
        lean = [float(v) for v in (full.forward, *full.backward, full.after, *full.layers)]
        # the work figures are agreed by their smallest (the excess of a layer without checkpointing: the largest)
        lean += [-float(v) for v in (*full.layer_work, *full.backward_work)]
        lean += [-float(v) for v in (phases.restores or (0,) * n)] + [-float(phases.shared)]  # subtracted: the least
        agreed, same = self.ranks.max_and_same(
            flat + offered + lean + [fixed_s, -slack, -(unlimited if host_room is None else host_room),
                                     self.sac_window], [shape, pins])
        at = len(flat) + len(offered)
        lean = [int(v) for v in agreed[at:at + len(lean)]]
        fixed_s, neg_slack, neg_host, window = agreed[at + len(lean):]
        if not same:
            raise RuntimeError("hsoffload: policy auto: the ranks' models have different decoder layers, or "
                               "auto.pin() was given different pins on different ranks; every rank must run the same "
                               "model with the same pins (one decision is applied by all)")
        out = []
        everywhere = agreed[len(flat):len(flat) + len(offered)]
        for k, c in enumerate(costs):
            v = agreed[k * len(fields):(k + 1) * len(fields)]
            on = everywhere[k] < 0
            out.append(dataclasses.replace(c, held_none=int(v[0]), held_keep=int(v[1]), forward_s=v[2],
                                           backward_s=v[3], copy_s=v[4], sac_bytes=int(v[5]) if on else 0,
                                           projection_s=v[6] if on else 0.0, sac_extra_s=v[7],
                                           none_forward=int(v[8]), none_backward=int(v[9])))
        self.sac_window = int(window)  # the deepest prefetch of the ranks: one window for all
        agreed_phases = Phases(lean[0], tuple(lean[1:n + 1]), lean[n + 1], tuple(lean[n + 2:2 * n + 2]),
                               tuple(-v for v in lean[2 * n + 2:3 * n + 2]),
                               tuple(-v for v in lean[3 * n + 2:4 * n + 2]),
                               tuple(-v for v in lean[4 * n + 2:5 * n + 2]), (), -lean[5 * n + 2])
        return (out, fixed_s, int(-neg_slack), agreed_phases, None if -neg_host >= unlimited else int(-neg_host))

    def _agree_micro_batch(self, local: Shape, wish: Wish, boundary: bool, reason: Optional[str]
                           ) -> tuple[Shape, Wish, bool, Optional[str]]:
        """The micro-batch's bucket, wish and optimizer-step boundary, agreed across ranks (one collective per
        micro-batch on every rank), and a restored bucket's check settled where every rank's passed."""
        adopt, self._adopt = self._adopt, None
        target, adopt_ok = local, adopt is not None and adopt[1]
        if self.ranks.size > 1:
            t0 = time.perf_counter()
            target, wish_any, boundary, adopt_ok, forwards = self._agree_step(local, wish, boundary, adopt)
            self.agree_s.append(time.perf_counter() - t0)
            self.forwards = forwards
            if wish_any > wish:
                reason = reason or "another rank's measurements changed (its peak, its start bytes or its calibration)"
                wish = Wish(int(wish_any))
        if adopt is not None:
            self._settle_restored(self.buckets[adopt[0]], adopt_ok)
        return target, wish, boundary, reason

