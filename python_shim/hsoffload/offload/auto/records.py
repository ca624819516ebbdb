"""Policy auto's records: a step's (`Step`, `StepRecord`), a probe's, a shape bucket's, and what a rank wishes."""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any, Optional

from ...choose import Decision, LayerCost, Phases
from ..calibration import Shape

logger = logging.getLogger("hsoffload")


NEVER = 1 << 62  # held bytes of a choice that must never be taken


@dataclasses.dataclass
class StepRecord:
    """One step (micro-batch) under a decision: predicted and measured."""

    tokens: int
    decided: bool  # False: a calibration step
    predicted_peak_bytes: Optional[int]
    measured_peak_bytes: Optional[int]  # None: a decided step whose peak counter did not rise above an earlier one
    predicted_step_s: Optional[float]
    measured_step_s: float
    decision_index: int = 0  # the decision it ran with (controller.decisions then; 0: none)
    measured_reserved_bytes: Optional[int] = None  # the allocator's reserved peak, where the device tells it


@dataclasses.dataclass
class _Probe:
    held_none: int  # bytes (math.inf-like huge: never leave uncheckpointed)
    backward_s: float
    copy_s: float
    sac_bytes: int = 0  # the projections' outputs its recompute reads (0: the sac choice not offered)
    # the share of its forward its projections took (timed one by one, each synchronized, within the probe's forward
    # timed whole with them: the synchronizations' cost counted on both sides); times the layer's measured forward,
    # what the sac choice's recompute skips
    projection_share: float = 0.0
    none_forward: int = 0  # its forward's peak above the bytes at its start, without checkpointing
    none_backward: int = 0  # its backward's, above the bytes at the forward's start


@dataclasses.dataclass
class Bucket:
    """The measurements and the decision of one shape bucket (hsoffload.offload.calibration): every figure scaled
    up to the bucket's top shape from the shape it was measured at."""

    shape: Shape  # the bucket's top: what its decision is made for
    calibrated: int = 0  # calibration steps done
    probes: dict[tuple, "_Probe"] = dataclasses.field(default_factory=dict)  # per layer kind
    probe_shape: Optional[Shape] = None  # the batch the probes ran at
    forward_s: dict[int, float] = dataclasses.field(default_factory=dict)  # per layer index (last calibration step)
    forward_shape: Optional[Shape] = None
    held_keep: dict[int, int] = dataclasses.field(default_factory=dict)  # per layer index, at forward_shape
    # The lean step's forward-and-backward peak above what the step started with, scaled to `shape`: the most of
    # its calibration steps without a probe (the probe's step where it is the only one)
    lean_increase: Optional[int] = None
    lean_probed: bool = True  # lean_increase comes from a step with a probe
    lean_forwards: int = 1  # forwards before one backward in the step lean_increase was measured in
    lean_step_s: Optional[float] = None
    # The lean step's peak by phase (hsoffload.costs.Phases) above what the step started with, scaled to `shape`: the
    # most of its calibration steps with one forward and without a probe (the probe's step's where it is the only
    # one); None where no calibration step measured every phase (a flat bound from lean_increase is used then)
    phases: Optional[Phases] = None
    phases_probed: bool = True
    probe_step_increase: Optional[int] = None  # the probe's step's increase (scaled): a restored file's check
    decision: Optional[Decision] = None
    costs: list[LayerCost] = dataclasses.field(default_factory=list)
    decided_start_bytes: int = 0  # what steps started with when the decision was made
    reason: str = ""  # why the decision was made
    fresh: Optional[tuple[int, bool, int]] = None  # the step the allocator's cache was last given back at
    verify: list[float] = dataclasses.field(default_factory=list)  # the decision's first steps' times (sac)
    # Measurements read from auto_state_path, applied once the bucket's first lean step matches them
    restored: Optional[dict[str, Any]] = None
    stale: Optional[str] = None  # why the decision is to be made again (None: it stands)
    decision_index: int = 0  # the controller's decision count when this bucket's decision was made
    decided_forwards: int = 1  # forwards before one backward the decision was made for
    measured_decision: int = -1  # the decision_index whose first step was measured

    @property
    def tokens(self) -> int:
        return self.shape.tokens

    def ready(self, calibration_steps: int) -> bool:
        """Measured enough to decide: its calibration steps run, its layers probed (on several ranks the first
        bucket's first step only watches the layers for collectives: one more step)."""
        return self.lean_increase is not None and self.calibrated >= calibration_steps and bool(self.probes)


class Wish(enum.IntEnum):
    """What a rank wishes at a micro-batch's start (agreed across ranks: the largest)."""

    NOTHING = 0  # the decisions stand
    DUE = 1  # a decision is due, at the next optimizer step's first micro-batch
    NOW = 2  # at once: a decision no longer fits what this step starts with, or more forwards than decided for


@dataclasses.dataclass
class Step:
    """The micro-batch in progress, from its first layer's call to the next one's."""

    shape: Shape
    bucket: Bucket  # the bucket it runs in
    decided: bool  # runs its bucket's decision (False: calibration, every layer offloaded)
    decision: Optional[Decision]
    meter: Optional[Any]  # calibration: its peak by phase (phases._PhaseMeter)
    probe: bool  # probes the kinds of layer not probed yet
    planned_forwards: int  # forwards before one backward its decision was made for
    start: int  # device bytes allocated at its first layer
    measured: bool  # the device's peak counter was reset at its start
    predicted: Optional[int]  # its decision's predicted peak, the margin included
    index: int  # its decision's index (0: none)
    budget: Optional[int]  # the budget it runs under
    forwards: int = 1
    hooks: int = 0  # forwards whose first layer's input gradient is awaited
    unplanned: bool = False  # a forward beyond those decided for ran (every layer offloaded)
    output_hooked: bool = False  # the phases' meter hooked the last layer's output
    counter0: int = 0  # the peak counter at its start (steps not measured: verified by its rise)
    reserved0: int = 0
    t0: Any = None  # time stamps: a float (host clock) or a device event
    t1: Any = None
    peak: Optional[int] = None  # forward and backward's peak
    reserved: Optional[int] = None
    whole: Optional[int] = None  # with the optimizer's step

