"""What one decision of `policy="auto"` costs: a decoder layer's bytes and time per choice, the step's device peak by
phase and its time with the copy pipeline. One model for the runtime (hsoffload.offload.auto: costs measured) and
the planner (`hsoffload plan --policy auto`: costs from the models), both through hsoffload.choose.

Plain numbers in: per layer (`LayerCost`) and per phase of the leanest step (`Phases`); no model-shape or setup
types, no torch.

The device peak is order-aware. A step's bytes beyond the leanest step's are what its layers hold until their
backward (`LayerCost.held`), and a layer's held bytes are alive only until its own backward:

- through forward, the head, the loss and the head's backward, every layer's held bytes are alive (`Phases.forward`:
  the leanest step's peak over that phase);
- during layer i's recompute and backward, only the layers below it still hold theirs (`Phases.backward[i]`: the
  leanest step's peak there, its gradients so far and its restores ahead included); a layer without checkpointing
  holds at its own backward what its recompute would make, so its own bytes are in that phase's lean peak already;
- after the first layer's backward (the embedding's gradient, the optimizer's step), nothing is held
  (`Phases.after`).

The peak of a decision is the largest of those phases (`Phases.peak`); a flat bound (every phase at the lean step's
peak: `Phases.flat`) is what a caller that measured one peak only can give.

Stdlib only.
"""

from __future__ import annotations

import dataclasses
import math
from enum import Enum
from typing import Optional, Sequence, Union

SAC_WINDOW = 2  # layers of sac entries on the device at once by default: one copy out in flight, one prefetched


@dataclasses.dataclass(frozen=True)
class Phases:
    """The leanest step's device peak by phase (bytes): every layer checkpointed and offloaded, at the prefetch
    depth SAC_WINDOW - 1 (the calibration's). Per layer (forward order): its forward's peak (`layers`) and its
    recompute and backward's (`backward`), each with that phase's own working set above where it started
    (`layer_work`, `backward_work`: what a layer without checkpointing may need beyond, `LayerCost.none_forward`,
    `none_backward`); empty tuples where unknown (the flat bound)."""

    forward: int  # after the last layer's forward: the head, the loss and the head's backward; every layer's held bytes
    backward: tuple[int, ...]  # layer i's recompute and backward: the held bytes of the layers below it alive
    after: int = 0  # after the first layer's backward: the embedding's gradient, the optimizer's step
    layers: tuple[int, ...] = ()  # layer k's forward: the held bytes of the layers below it alive
    layer_work: tuple[int, ...] = ()  # layer k's forward peak above the bytes at its start
    backward_work: tuple[int, ...] = ()  # layer i's recompute and backward peak above the bytes at its start
    # layer i's backward phase's restored inputs (its own and those prefetched at its unpack): gone from a step that
    # copies nothing (`without_copies`)
    restores: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()  # the restores `without_copies` took out of each backward phase
    # The layers' calls' other tensors (the attention mask, the position embeddings: made once per forward): a
    # checkpointed layer holds them until its backward, so they are gone from a backward phase (and the head's)
    # where no layer up to it is checkpointed
    shared: int = 0

    def without_copies(self) -> "Phases":
        """The phases of a step in which no layer offloads (none and keep only): no restores in backward."""
        if not self.restores:
            return self
        return dataclasses.replace(self, backward=tuple(b - r for b, r in zip(self.backward, self.restores)),
                                   restores=(), removed=self.restores)

    @classmethod
    def flat(cls, lean_peak: int, layers: int) -> "Phases":
        """One measured peak for every phase: the bound `lean peak + everything held`."""
        return cls(lean_peak, (lean_peak,) * layers, 0)

    @property
    def lean(self) -> int:
        """The leanest step's peak: its largest phase."""
        return max(self.forward, max(self.backward, default=0), max(self.layers, default=0), self.after)

    def shifted(self, delta: int) -> "Phases":
        """Every phase `delta` bytes higher (what steps start with changed, a margin)."""
        return dataclasses.replace(self, forward=self.forward + delta, after=self.after + delta,
                                   backward=tuple(b + delta for b in self.backward),
                                   layers=tuple(f + delta for f in self.layers))

    def safer(self, other: "Phases") -> "Phases":
        """The bound of two measurements of the same phases: each peak's larger, each figure subtracted (a phase's
        work, restores, shared tensors) its smaller."""
        def hi(x: tuple[int, ...], y: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(map(max, x, y)) if x and y else x or y

        def lo(x: tuple[int, ...], y: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(map(min, x, y)) if x and y else ()

        return Phases(max(self.forward, other.forward), hi(self.backward, other.backward),
                      max(self.after, other.after), hi(self.layers, other.layers),
                      lo(self.layer_work, other.layer_work), lo(self.backward_work, other.backward_work),
                      lo(self.restores, other.restores), (), min(self.shared, other.shared))

    def excess(self, k: int, cost: "LayerCost", choice: "Choice") -> tuple[int, int]:
        """What layer k's own forward and backward phases need beyond the leanest step's for `choice`: a layer
        without checkpointing runs its forward keeping what it saves, and its backward on those instead of a
        recompute's (the measured peaks above the phase's start, less the leanest step's there)."""
        if choice is not Choice.NONE:
            return 0, 0
        # The phase's start (the leanest step's, less its work there) plus the layer's own peak without
        # checkpointing: less than the leanest step's where its recompute needed more (negative)
        fwd = cost.none_forward - self.layer_work[k] if self.layer_work and cost.none_forward else 0
        bwd = 0
        if self.backward_work and cost.none_backward:  # the restores taken out were in its work: counted back
            bwd = cost.none_backward - self.backward_work[k] + (self.removed[k] if self.removed else 0)
        return fwd, bwd

    def peak(self, costs: Sequence["LayerCost"], choices: Sequence["Choice"]) -> int:
        """The device peak of a step whose layers make `choices` (forward order)."""
        below, top, uncheckpointed = 0, self.after, True
        for k, (cost, c) in enumerate(zip(costs, choices)):
            fwd, bwd = self.excess(k, cost, c)
            uncheckpointed = uncheckpointed and c is Choice.NONE
            if self.layers:
                top = max(top, self.layers[k] + below + fwd)
            top = max(top, self.backward[k] + below + bwd - (self.shared if uncheckpointed else 0))
            below += cost.held(c)
        return max(top, self.forward + below - (self.shared if uncheckpointed else 0))

    def caps(self, budget: int) -> Optional[tuple[list[int], list[int], list[int]]]:
        """For each layer k: the most the layers before it may hold in its forward phase and in its backward phase
        (each less what its own choice needs there: `excess`), and the most the layers 0..k may hold together for
        every later phase to fit `budget`. None if the leanest step's own phases do not fit."""
        if self.lean > budget:
            return None
        n = len(self.backward)
        fwd = [budget - (self.layers[k] if self.layers else 0) for k in range(n)]
        bwd = [budget - b for b in self.backward]
        # The held bytes only add up: the head's phase bounds every sum of them (a layer's own phases are checked
        # with its choice, whose excess may be negative: not folded into the earlier sums' caps)
        after = [budget - self.forward] * n
        return fwd, bwd, after


def as_phases(lean: Union[int, Phases], layers: int) -> Phases:
    """`lean` as phases: an int is a peak measured whole (every phase at it)."""
    return lean if isinstance(lean, Phases) else Phases.flat(int(lean), layers)


class Choice(str, Enum):
    NONE = "none"  # no checkpointing
    KEEP = "keep"  # checkpointing, input kept on the device
    SAC = "sac"  # checkpointing, input and projection outputs offloaded: the recompute skips the projections
    OFFLOAD = "offload"  # checkpointing, input offloaded (policy hidden_states)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: object, what: str) -> "Choice":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"hsoffload: {what} must be one of {', '.join(c.value for c in cls)}, got "
                             f"{value!r}") from None




@dataclasses.dataclass(frozen=True)
class LayerCost:
    """What one decoder layer costs per choice (bytes on the device until its backward; seconds)."""

    name: str
    held_none: int  # its saved activations without checkpointing
    held_keep: int  # its input (what checkpointing saves)
    forward_s: float  # its forward (the recompute)
    backward_s: float
    copy_s: float  # its input to the host, or back (one direction)
    sac_bytes: int = 0  # the outputs of its projections its recompute reads (0: the sac choice is not offered)
    projection_s: float = 0.0  # those projections' forward: what the sac choice's recompute skips
    sac_extra_s: float = 0.0  # what sac steps measured beyond this model, per layer (learned: the selective
    # checkpoint's dispatch on every op, many small copies)
    # Without checkpointing, its forward's peak and its backward's above the bytes at their start (what it saves
    # included): what its own phases need beyond the leanest step's (`Phases.excess`); 0 where not measured
    none_forward: int = 0
    none_backward: int = 0

    @property
    def sac_offered(self) -> bool:
        return self.sac_bytes > 0 and self.projection_s > 0

    def held(self, c: Choice) -> int:
        """Bytes held on the device until its backward (the sac window apart: `window_bytes`)."""
        return self.held_none if c is Choice.NONE else self.held_keep if c is Choice.KEEP else 0

    def copy(self, c: Choice) -> float:
        """One direction of what this choice copies: the input (offload), the input and the projections (sac)."""
        if c is Choice.OFFLOAD:
            return self.copy_s
        if c is Choice.SAC:
            return self.copy_s * (1 + self.sac_bytes / max(1, self.held_keep))
        return 0.0

    def recompute_s(self, c: Choice) -> float:
        """Backward's recompute of this layer's forward: none without checkpointing, less its projections (sac)."""
        if c is Choice.NONE:
            return 0.0
        return self.forward_s - (min(self.projection_s, self.forward_s) if c is Choice.SAC else 0.0)

    def extra_s(self, c: Choice) -> float:
        """The time this choice adds to the step over `none` (the pipeline's fill not included): the recompute, and
        what of the copy out its forward does not hide, and of the copy back its recompute and backward."""
        recompute, copy = self.recompute_s(c), self.copy(c)
        learned = self.sac_extra_s if c is Choice.SAC else 0.0
        return recompute + max(0.0, copy - self.forward_s) + max(0.0, copy - recompute - self.backward_s) + learned

    def scaled(self, factor: float) -> "LayerCost":
        """The costs at `factor` times the tokens (bytes and times linear in them: a safe bound is the caller's)."""
        return dataclasses.replace(self, held_none=math.ceil(self.held_none * factor),
                                   held_keep=math.ceil(self.held_keep * factor), forward_s=self.forward_s * factor,
                                   backward_s=self.backward_s * factor, copy_s=self.copy_s * factor,
                                   sac_bytes=math.ceil(self.sac_bytes * factor),
                                   projection_s=self.projection_s * factor, sac_extra_s=self.sac_extra_s * factor,
                                   none_forward=math.ceil(self.none_forward * factor),
                                   none_backward=math.ceil(self.none_backward * factor))




def fill_s(costs: Sequence[LayerCost], choices: Sequence[Choice]) -> float:
    """The pipeline's fill: one copy when any layer offloads or chooses sac (the first restore of backward is waited
    for)."""
    copies = [c.copy(x) for c, x in zip(costs, choices) if x in (Choice.OFFLOAD, Choice.SAC)]
    return max(copies) if copies else 0.0


def window_bytes(costs: Sequence[LayerCost], choices: Sequence[Choice], sac_window: int = SAC_WINDOW) -> int:
    """The sac entries on the device at once: `sac_window` times the largest among the layers choosing sac."""
    sizes = [c.sac_bytes for c, x in zip(costs, choices) if x is Choice.SAC]
    return sac_window * max(sizes) if sizes else 0


def predict(costs: Sequence[LayerCost], choices: Sequence[Choice], lean: Union[int, Phases],
            fixed_s: float, sac_window: int = SAC_WINDOW, depth: Optional[int] = None) -> tuple[int, float]:
    """The device peak and step time of `choices`, from the leanest step's peak (`lean`: by phase, or one number).
    With `depth` (layers restored ahead in backward) the time's copies are played through one copy engine
    (`pipeline_s`) and the peak holds the restores ahead beyond the lean step's (`sac_window` - 1 of them: the lean
    peak was measured at that depth); without it, each layer's copy is set against its own compute
    (`LayerCost.extra_s`) and the fill is one copy. The sac window and the restores ahead are counted in every
    phase (they are in flight in forward and in backward)."""
    window, ahead = (sac_window, 0) if depth is None else (depth + 1, max(0, depth - (sac_window - 1)))
    extra = window_bytes(costs, choices, window) + (ahead * _largest_restore(costs, choices) if ahead else 0)
    phases = as_phases(lean, len(costs))
    if not any(x in (Choice.OFFLOAD, Choice.SAC) for x in choices):
        phases = phases.without_copies()
    peak = phases.peak(costs, choices) + extra
    if depth is None:
        return peak, fixed_s + sum(c.extra_s(x) for c, x in zip(costs, choices)) + fill_s(costs, choices)
    return peak, fixed_s + pipeline_s(costs, choices, depth)


def _largest_restore(costs: Sequence[LayerCost], choices: Sequence[Choice]) -> int:
    """The largest input restored in backward (the layers that offload or choose sac)."""
    return max((c.held_keep for c, x in zip(costs, choices) if x in (Choice.OFFLOAD, Choice.SAC)), default=0)


def pipeline_s(costs: Sequence[LayerCost], choices: Sequence[Choice], depth: int) -> float:
    """The time `choices` add to the step over no checkpointing, with `depth` layers restored ahead: every
    checkpointed layer's recompute, what of a copy out its layer's forward does not hide, and backward's waits for
    its restores. Backward is played in its order through one copy engine as the engine schedules it (prefetch.h):
    when a layer's restore is reached (its unpack), the restores of the next `depth` layers that copy are started,
    each after the one before it; a layer's backward starts when the one after it is done and its restore has
    arrived; the first restore is waited for whole (the pipeline's fill)."""
    extra = 0.0
    for cost, c in zip(costs, choices):
        extra += cost.recompute_s(c) + max(0.0, cost.copy(c) - cost.forward_s)
        extra += cost.sac_extra_s if c is Choice.SAC else 0.0
    order = [i for i in reversed(range(len(costs)))]
    copied = [i for i in order if choices[i] in (Choice.OFFLOAD, Choice.SAC)]
    at = {i: k for k, i in enumerate(copied)}
    arrives: dict[int, float] = {}
    engine_free = 0.0
    started = 0

    def start_until(k: int, now: float) -> None:
        nonlocal engine_free, started
        while started <= min(k, len(copied) - 1):
            j = copied[started]
            engine_free = max(engine_free, now) + costs[j].copy(choices[j])
            arrives[j] = engine_free
            started += 1

    t = 0.0
    for i in order:
        if i in at:
            start_until(at[i], t)  # on demand, unless started ahead
            wait = max(0.0, arrives[i] - t)
            extra += wait
            t += wait
            start_until(at[i] + depth, t)  # the layers `depth` ahead, at this unpack
        t += costs[i].recompute_s(choices[i]) + costs[i].backward_s
    return extra


def restores_exposed_s(layers: int, compute: float, copy: float) -> float:
    """Backward's restores of `layers` alike layers as a two-stage pipeline (compute beside copies): the time the
    copies add beyond compute (the planner's aggregate; `pipeline_s` plays them layer by layer)."""
    if copy <= 0 or layers <= 0:
        return 0.0
    return max(layers * compute, layers * copy) + min(compute, copy) - layers * compute


def copies_out_exposed_s(offloaded: int, layers: int, layer_forward: float, per_copy: float, head: float) -> float:
    """The forward's copies to the host that compute does not hide. Layer i's input starts copying when layer i
    starts, one copy after another on the side stream, so the last of `offloaded` copies (the first layers') ends at
    max(n x, (n - 1) c + x); backward's first restore waits for it, and until then the layers' forward and the head's
    forward and backward run."""
    if offloaded <= 0 or per_copy <= 0:
        return 0.0
    last_copy_done = max(offloaded * per_copy, (offloaded - 1) * layer_forward + per_copy)
    return max(0.0, last_copy_done - layers * layer_forward - head)
