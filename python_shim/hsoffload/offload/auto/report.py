"""What policy auto tells: the last decision's table, and numbers for a trainer's logs."""

from __future__ import annotations

import logging

from ...choose import Choice

logger = logging.getLogger("hsoffload")


HISTORY = 1000  # steps kept in `history`
DECISION_LOG = 100  # decisions kept in `decision_log`


class ReportMixin:
    """The controller's report."""

    def report(self) -> str:
        """The last decision made (whichever bucket it is for): why, and its table (empty before the first)."""
        b = max(self.buckets.values(), key=lambda x: x.decision_index, default=None)
        if b is None or b.decision is None:
            return ""
        return (f"policy auto, decision {b.decision_index} ({b.reason}; bucket {b.shape.key()}, {b.tokens} tokens)"
                f"{' REPORT ONLY, every layer offloaded' if self.report_only else ''}:\n"
                f"{b.decision.table(b.costs)}")

    def log_values(self) -> dict[str, float]:
        """Numbers for a trainer's logs (`hsoffload/auto_*`): the layers per choice run now, the decisions made, the
        budget, and the last decided step's predicted and measured peak (GiB) and time (ms) (the last whose own peak
        is known: a step whose peak counter did not rise above an earlier step's has none)."""
        gib = float(1 << 30)
        values: dict[str, float] = {f"auto_{c.value}_layers": 0.0 for c in Choice}
        for c in self.choices():
            values[f"auto_{c.value}_layers"] += 1
        values["auto_decisions"] = float(self.decisions)
        values["auto_fits"] = float(self.bucket.decision is not None and self.bucket.decision.fits)
        values["auto_budget_gib"] = (self.budget or 0) / gib
        values["auto_prefetch_depth"] = float(self.prefetch_depth())
        values["auto_buckets"] = float(len(self.buckets))
        if self.agree_s:  # the ranks' agreement per micro-batch: the host's median wait
            values["auto_agree_ms"] = sorted(self.agree_s)[len(self.agree_s) // 2] * 1e3
        # the largest whole-step peak auto read (auto resets the device's peak counter at the steps it measures)
        values["auto_peak_read_gib"] = self.peak_read / gib
        last = next((r for r in reversed(self.history) if r.decided and r.measured_peak_bytes is not None), None)
        if last is not None:
            values["auto_predicted_peak_gib"] = (last.predicted_peak_bytes or 0) / gib
            values["auto_measured_peak_gib"] = (last.measured_peak_bytes or 0) / gib
            values["auto_predicted_step_ms"] = (last.predicted_step_s or 0.0) * 1e3
            values["auto_measured_step_ms"] = last.measured_step_s * 1e3
        return values
