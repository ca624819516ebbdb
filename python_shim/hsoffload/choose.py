"""`policy="auto"`'s decision: per decoder layer, what to keep, recompute or offload, for the least step time whose
device peak stays under a budget. The same chooser for the runtime (costs measured: hsoffload.offload.auto) and the
planner (costs from the models: `hsoffload plan --policy auto`).

Per layer, from fastest to leanest:

- `none`: no checkpointing; the layer's saved activations stay on the device until its backward (its `held_none`
  bytes), nothing is recomputed;
- `keep`: checkpointing, its input kept on the device (`held_keep` bytes); backward recomputes its forward;
- `sac`: checkpointing, its input and the outputs of its projections (the matmuls its recompute would read:
  `sac_bytes`) copied to the host in forward and back before its backward (selective activation checkpointing with
  the saves offloaded): the recompute skips the projections (`projection_s`), the copies are larger; 0 device bytes
  held, but the entries of `sac_window` layers are on the device at once (a copy out in flight, the prefetch), so the
  peak adds that many times the largest `sac_bytes` among the layers that choose it. Offered where the layer's costs
  name its projections (`sac_bytes` and `projection_s` above 0);
- `offload`: checkpointing, its input copied to the host in forward and back before its backward (0 device bytes
  held beyond the prefetch window); the recompute, plus what of the copies the layer's compute does not hide.

The step time of a decision is a fixed part (every layer's forward and backward, the head, the optimizer) plus each
layer's extra (`extra_s`): the recompute, and for `offload` the part of its copy longer than the layer's forward
(the copy out) and than its recompute and backward (the copy back), plus one copy (the pipeline's fill) when any layer
offloads or chooses `sac`. The device peak is order-aware (hsoffload.costs): the leanest step's peak by phase
(`Phases`: measured, or modelled) plus, in each phase, what the layers still alive there hold (all of them through
forward and the head; below layer i during its backward), plus the `sac` window. The time is a sum over layers but
for two terms, and the peak bounds each prefix of the layers' held bytes (a cap per layer, `Phases.caps`), so the
least-time decision under the budget is a multiple-choice knapsack with a capacity per prefix, solved over the Pareto
front of (bytes held so far, time) (`_knapsack`): exact while the front stays under FRONT_LIMIT states (always for
layers alike; thinned past it, never over a cap); the two terms that are a largest, not a sum (the pipeline's fill,
the `sac` window), by one knapsack per pair of values they can take (up to FILL_LIMITS and SAC_LIMITS of them), the
window held in every phase.

Stdlib only (the planner imports it without torch).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence, Union

from .costs import SAC_WINDOW, Choice, LayerCost, Phases, as_phases, fill_s, pipeline_s, predict, window_bytes

__all__ = ["SAC_WINDOW", "Choice", "Decision", "LayerCost", "Phases", "choose", "fill_s", "pipeline_s", "predict",
           "prefetch_depths", "sac_host_bytes", "window_bytes"]

FILL_LIMITS = 6  # values of the pipeline's fill tried at most (one knapsack each, per SAC limit)
SAC_LIMITS = 4  # values of the largest `sac_bytes` among the layers choosing sac tried at most
FRONT_LIMIT = 256  # states of the knapsack's Pareto front kept per layer (thinned past it; never over the room)


@dataclasses.dataclass(frozen=True)
class Decision:
    """One choice per layer, and what it is predicted to cost."""

    choices: tuple[Choice, ...]
    names: tuple[str, ...]
    budget_bytes: int
    peak_bytes: int  # predicted device peak
    step_s: float  # predicted step time
    fits: bool  # False: not even the leanest choice (with the pins) fits; the leanest is returned
    pinned: tuple[str, ...] = ()
    sac_window: int = SAC_WINDOW
    prefetch_depth: Optional[int] = None  # layers restored ahead in backward, where chosen (None: the caller's)

    def counts(self) -> dict[str, int]:
        return {c.value: sum(1 for x in self.choices if x is c) for c in Choice}

    def table(self, costs: Optional[Sequence[LayerCost]] = None) -> str:
        """The decision, a line per run of equal choices: layers, choice, bytes held, extra time."""
        lines = [f"policy auto: {', '.join(f'{n} {c}' for c, n in self.counts().items() if n)}; predicted peak "
                 f"{self.peak_bytes / 2**20:,.1f} MiB of a {self.budget_bytes / 2**20:,.1f} MiB budget"
                 f"{'' if self.fits else ' (DOES NOT FIT: the leanest choice is applied)'}, step "
                 f"{self.step_s * 1e3:,.1f} ms"
                 + (f", prefetch depth {self.prefetch_depth}" if self.prefetch_depth is not None else "")]
        i = 0
        while i < len(self.choices):
            j = i
            while j + 1 < len(self.choices) and self.choices[j + 1] is self.choices[i]:
                j += 1
            span = self.names[i] if i == j else f"{self.names[i]} .. {self.names[j]}"
            detail = ""
            if costs is not None:
                held = sum(costs[k].held(self.choices[k]) for k in range(i, j + 1))
                extra = sum(costs[k].extra_s(self.choices[k]) for k in range(i, j + 1))
                detail = f": {held / 2**20:,.1f} MiB held, +{extra * 1e3:,.1f} ms"
            pins = [n for n in self.names[i:j + 1] if n in self.pinned]
            lines.append(f"  {span} ({j - i + 1}): {self.choices[i]}{detail}"
                         + (f" (pinned: {', '.join(pins)})" if pins else ""))
            i = j + 1
        if costs is not None and Choice.SAC in self.choices:
            lines.append(f"  sac window: {window_bytes(costs, self.choices, self.sac_window) / 2**20:,.1f} MiB "
                         f"({self.sac_window} layers' projections on the device at once)")
        return "\n".join(lines)


def choose(costs: Sequence[LayerCost], budget_bytes: int, lean: Union[int, Phases], fixed_s: float,
           pins: Optional[Mapping[str, Choice]] = None, sac_window: int = SAC_WINDOW,
           host_room: Optional[int] = None, prefetch_depths: Sequence[int] = ()) -> Decision:
    """The least predicted step time whose predicted peak is at most `budget_bytes` and whose sac layers' projections
    (`sac_host_bytes`) fit `host_room` (None: no limit; the inputs every layer may offload are the lean baseline's,
    counted by the caller); pinned layers keep their choice (a pinned sac where the layer's costs offer none is an
    error). When nothing fits, every unpinned layer offloads and `fits` is False.

    `prefetch_depths`: the prefetch depths to choose among (the lean peak was measured at `sac_window` - 1). Each
    depth's best decision (the room less the extra restores ahead it holds, its sac window depth + 1) is timed with
    its copies played through one copy engine (`predict`'s `depth`); the fastest is returned, the shallower one when
    a deeper is not faster by DEPTH_GAIN. Empty: the depth stays the caller's and copies are timed per layer."""
    pins = dict(pins or {})
    unknown = sorted(set(pins) - {c.name for c in costs})
    if unknown:
        raise ValueError(f"hsoffload: auto_pins names layers this model does not have: {', '.join(unknown)} "
                         f"(its layers: {costs[0].name} .. {costs[-1].name})" if costs else
                         f"hsoffload: auto_pins given, but the model has no decoder layers: {', '.join(unknown)}")
    unoffered = sorted(c.name for c in costs if pins.get(c.name) is Choice.SAC and not c.sac_offered)
    if unoffered:
        raise ValueError(f"hsoffload: auto_pins pins sac on {', '.join(unoffered)}, whose projections were not "
                         "measured (a layer whose checkpoint already has a context_fn, reentrant checkpointing, or a "
                         "layer not probed): pin keep or offload there")
    names = tuple(c.name for c in costs)
    options = [[pins[c.name]] if c.name in pins else
               [x for x in Choice if x is not Choice.SAC or c.sac_offered] for c in costs]
    phases = as_phases(lean, len(costs))
    caps = phases.caps(budget_bytes)  # per layer, what the layers before it may hold (None: the lean step does not fit)
    lean_depth = sac_window - 1
    restorable = max((c.held_keep for c, o in zip(costs, options) if Choice.OFFLOAD in o or Choice.SAC in o), default=0)
    found: list[tuple[float, int, list[Choice]]] = []
    # Without copies (none and keep only) the backward phases hold no restores: searched on their own phases
    still = [[x for x in o if x in (Choice.NONE, Choice.KEEP)] for o in options]
    if phases.restores and all(still):
        uncopied = phases.without_copies()
        caps_still = uncopied.caps(budget_bytes)
        chosen = None if caps_still is None else _within(costs, still, caps_still, uncopied, fixed_s, sac_window,
                                                         host_room)
        if chosen is not None:
            chosen = _canonical_within(costs, chosen, pins, phases, sac_window)
            found.append((predict(costs, chosen, phases, fixed_s, sac_window)[0 + 1], -1, chosen))
    for depth in sorted({d for d in prefetch_depths if d >= 0}) or [None]:
        window = sac_window if depth is None else depth + 1
        ahead = 0 if depth is None else max(0, depth - lean_depth) * restorable
        chosen = None if caps is None else _within(costs, options, _less(caps, ahead), phases, fixed_s, window,
                                                   host_room)
        if chosen is not None:
            chosen = _canonical_within(costs, chosen, pins, phases, sac_window, depth)
            step = predict(costs, chosen, phases, fixed_s, sac_window, depth)[1]
            if not found or step < found[0][0] * (1 - DEPTH_GAIN):
                found.insert(0, (step, -1 if depth is None else depth, chosen))
            if depth is not None and len(found) == 1 and (
                    step - fixed_s - pipeline_s(costs, chosen, len(costs)) <= DEPTH_GAIN * step):
                break  # no restore waited for that any depth could hide: deeper ones only hold more
    if found:
        _, depth, chosen = found[0]
        fits = True
    else:
        depth = lean_depth if prefetch_depths else -1
        chosen, fits = [pins.get(c.name, Choice.OFFLOAD) for c in costs], False
    d = None if depth < 0 else depth
    peak, step = predict(costs, chosen, phases, fixed_s, sac_window, d)
    return Decision(tuple(chosen), names, budget_bytes, peak, step, fits=fits, pinned=tuple(sorted(pins)),
                    sac_window=sac_window if d is None else d + 1, prefetch_depth=d)


DEPTH_GAIN = 0.001  # a deeper prefetch is chosen only if its predicted step is at least this much shorter
DEEPEST_PREFETCH = 3  # the deepest prefetch chosen (from the configured depth, the one the lean peak was measured at)


def prefetch_depths(configured: int) -> range:
    """The prefetch depths policy auto chooses among: from the configured one (its calibration's) to
    DEEPEST_PREFETCH."""
    return range(configured, max(configured, DEEPEST_PREFETCH) + 1)


Caps = tuple  # Phases.caps: per layer, the forward phase's, the backward phase's and the later phases' caps


def _less(caps: Caps, used: int) -> Caps:
    """Every cap less `used` bytes held throughout (the sac window, restores ahead)."""
    return tuple([c - used for c in part] for part in caps)


def _short(caps: Caps) -> bool:
    """Some phase has no room left even for the leanest choices."""
    return any(min(part, default=0) < 0 for part in caps)


def _within(costs: Sequence[LayerCost], options: Sequence[Sequence[Choice]], caps: Caps, lean: Phases,
            fixed_s: float, sac_window: int, host_room: Optional[int]) -> Optional[list[Choice]]:
    """The least predicted time within the device room and the host room; None if nothing fits (or, where only
    pinned sac passes the host room, the decision without unpinned sac: the user's pins, as asked)."""
    best = _best(costs, options, caps, lean, fixed_s, sac_window, 0.0)
    if best is None or host_room is None or sac_host_bytes(costs, best) <= host_room:
        return best
    # The projections held on the host are a budget of their own: a price per host byte on the sac choice (a
    # Lagrangian), searched by bisection between none and the price past which no layer gains from sac; the fastest
    # decision found within the host room (at worst the one without any unpinned sac).
    lo, hi = 0.0, _price_ceiling(costs)
    without = [[x for x in o if x is not Choice.SAC] or o for o in options]  # pinned sac stays
    no_sac = _best(costs, without, caps, lean, fixed_s, sac_window, 0.0)
    feasible = [no_sac] if no_sac is not None and sac_host_bytes(costs, no_sac) <= host_room else []
    for _ in range(PRICE_STEPS):
        mid = (lo + hi) / 2
        found = _best(costs, options, caps, lean, fixed_s, sac_window, mid)
        if found is not None and sac_host_bytes(costs, found) <= host_room:
            feasible.append(found)
            hi = mid
        else:
            lo = mid
    if not feasible:  # only pinned sac over the host room: the user's pins, as asked
        return no_sac
    return min(feasible, key=lambda ch: predict(costs, ch, lean, fixed_s, sac_window)[1])


PRICE_STEPS = 8  # bisection steps of the host byte's price (sac under a host room)


def sac_host_bytes(costs: Sequence[LayerCost], choices: Sequence[Choice]) -> int:
    """The host bytes the sac layers' projections take beyond their inputs (what offload would copy anyway)."""
    return sum(c.sac_bytes for c, x in zip(costs, choices) if x is Choice.SAC)


def _price_ceiling(costs: Sequence[LayerCost]) -> float:
    """A price per host byte at which sac is never faster than offload for any layer (twice the largest gain)."""
    gains = [(c.extra_s(Choice.OFFLOAD) - c.extra_s(Choice.SAC)) / c.sac_bytes for c in costs if c.sac_offered]
    return 2 * max([g for g in gains if g > 0], default=1e-12) + 1e-12


def _best(costs: Sequence[LayerCost], options: Sequence[Sequence[Choice]], caps: Caps, lean: Phases,
          fixed_s: float, sac_window: int, price: float) -> Optional[list[Choice]]:
    """The least predicted time (plus `price` per sac host byte) within the device room; None if nothing fits.
    Two terms are a largest, not a sum over layers: the fill (the largest copy of a layer that offloads or chooses
    sac) and the sac window (the largest sac_bytes among those choosing sac). For each pair of values they can
    take, the best decision whose layers stay within both (the window's bytes taken from the room first)."""
    if _short(caps):
        return None
    candidates = []
    for sac_limit in [None] + _limits([c.sac_bytes for c, o in zip(costs, options) if Choice.SAC in o], SAC_LIMITS):
        rest = _less(caps, sac_window * sac_limit if sac_limit is not None else 0)
        if _short(rest):
            continue
        withins = [[x for x in o if x is not Choice.SAC or (sac_limit is not None and c.sac_bytes <= sac_limit)]
                   for c, o in zip(costs, options)]
        # The fill's values among the copies this window's limit allows (without sac: the inputs' alone, as before
        # sac existed, so that offering it never thins the grid of the decisions without it)
        copies = [c.copy(x) for c, w in zip(costs, withins) for x in w if x in (Choice.OFFLOAD, Choice.SAC)]
        for limit in _limits(copies, FILL_LIMITS) + [None]:
            allowed = []
            for c, within in zip(costs, withins):
                # The fill is a time: a pinned copy over the limit stays allowed (its time is predicted whole below).
                allowed.append([x for x in within if x not in (Choice.OFFLOAD, Choice.SAC)
                                or (limit is not None and c.copy(x) <= limit)] or within)
            if not all(allowed):
                continue  # a pin the window's limit excludes
            found = _knapsack(costs, allowed, rest, lean, price)
            if found is not None:
                candidates.append(found)
    if not candidates:
        return None
    return min(candidates, key=lambda ch: predict(costs, ch, lean, fixed_s, sac_window)[1]
               + price * sac_host_bytes(costs, ch))


# Along the layers, among layers that cost the same: leanest first.
ORDER = (Choice.OFFLOAD, Choice.SAC, Choice.KEEP, Choice.NONE)


def _canonical(costs: Sequence[LayerCost], choices: Sequence[Choice], pins: Mapping[str, Choice]) -> list[Choice]:
    """The same multiset of choices per group of layers that cost the same, laid out in ORDER along them: the first
    layers offload (their copies have the longest to hide behind), the last go without checkpointing (backward needs
    them first). The peak and time are unchanged; the runtime and the planner lay alike decisions out alike."""
    out = list(choices)
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(costs):
        if c.name not in pins:
            groups.setdefault(dataclasses.astuple(dataclasses.replace(c, name="")), []).append(i)
    for members in groups.values():
        for i, choice in zip(members, sorted((out[i] for i in members), key=ORDER.index)):
            out[i] = choice
    return out


def _canonical_within(costs: Sequence[LayerCost], choices: Sequence[Choice], pins: Mapping[str, Choice],
                      phases: Phases, sac_window: int, depth: Optional[int] = None) -> list[Choice]:
    """`_canonical`, unless its layout peaks higher (the layers below a checkpointed one hold the calls' shared
    tensors: `Phases.shared`), then the knapsack's own."""
    out = _canonical(costs, choices, pins)
    if predict(costs, out, phases, 0.0, sac_window, depth)[0] > predict(costs, choices, phases, 0.0, sac_window,
                                                                          depth)[0]:
        return list(choices)
    return out


def _limits(values: Sequence[float], most: int) -> list:
    """The values a largest-of term is tried at: every distinct one, or `most` of them spread over their range (the
    largest included) where layers differ more (a close limit costs at most the gap)."""
    distinct = sorted(set(values))
    if len(distinct) <= most:
        return distinct
    return sorted({distinct[round(k * (len(distinct) - 1) / (most - 1))] for k in range(most)})


def _knapsack(costs: Sequence[LayerCost], options: Sequence[Sequence[Choice]], caps: Caps, phases: Phases,
              price: float = 0.0) -> Optional[list[Choice]]:
    """Least total extra time with every phase within its cap (`Phases.caps`: the bytes the layers before layer k
    hold, plus what its choice needs in its own forward and backward phases, and the bytes of layers 0..k for the
    later phases), exact: the Pareto
    front of (bytes held so far, time) over the layers so far (layers alike collapse to few sums; a prefix's bytes
    are all a later cap needs). A front past FRONT_LIMIT states is thinned to the fastest state per
    max(caps) / FRONT_LIMIT bytes: every state kept is exact (never over a cap), the optimum may then be missed by at
    most that much room. None if the leanest options do not fit."""
    # A state: the bytes held so far, whether every layer so far goes without checkpointing (`Phases.shared`)
    front: list[tuple[tuple[int, bool], float, tuple[Choice, ...]]] = [((0, True), 0.0, ())]
    fwd_caps, bwd_caps, later_caps = caps
    last = len(costs) - 1
    for k, (cost, opts) in enumerate(zip(costs, options)):
        nxt: dict[tuple[int, bool], tuple[float, tuple[Choice, ...]]] = {}
        for (held, bare), t, chosen in front:
            for c in opts:
                h2, bare2 = held + cost.held(c), bare and c is Choice.NONE
                fwd, bwd = phases.excess(k, cost, c)
                gone = phases.shared if bare2 else 0
                if (h2 - (gone if k == last else 0) > later_caps[k] or held + fwd > fwd_caps[k]
                        or held + bwd - gone > bwd_caps[k]):
                    continue
                t2 = t + cost.extra_s(c) + (price * cost.sac_bytes if c is Choice.SAC else 0.0)
                cur = nxt.get((h2, bare2))
                if cur is None or t2 < cur[0] - 1e-15:
                    nxt[(h2, bare2)] = (t2, chosen + (c,))
        front = []
        for bare in (True, False):  # per flag: more bytes only if faster than every leaner state
            fastest = float("inf")
            for key, (t, chosen) in sorted(x for x in nxt.items() if x[0][1] is bare):
                if t < fastest - 1e-15:
                    front.append((key, t, chosen))
                    fastest = t
        if len(front) > FRONT_LIMIT:
            width = max(1, max(later_caps) // FRONT_LIMIT)
            thinned: dict[tuple[int, bool], tuple[tuple[int, bool], float, tuple[Choice, ...]]] = {}
            for state in sorted(front):  # ascending bytes, descending time: the last of a bucket is its fastest
                thinned[(state[0][0] // width, state[0][1])] = state
            front = sorted(thinned.values())
    if not front:
        return None
    return list(min(front, key=lambda s: (s[1], s[0][0]))[2])
