"""policy auto's chooser (hsoffload.choose): the least step time under the budget, checked against every decision
by brute force (up to 3 layers: their fill and window values, at most 6 and 3, are all tried, so it is exact); never over the budget; never slower with more room; pins kept; nothing fits said."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsoffload.choose import Choice, LayerCost, choose, pipeline_s, predict, sac_host_bytes

layer = st.builds(
    lambda i, none, keep, f, b, c, sac, p: LayerCost(f"model.layers.{i}", none, keep, f, b, c, sac, p * f),
    st.just(0), st.integers(1, 10_000), st.integers(1, 1_000), st.floats(0.001, 1.0), st.floats(0.001, 2.0),
    st.floats(0.0, 3.0), st.one_of(st.just(0), st.integers(1, 8_000)), st.floats(0.0, 0.9))


def _named(costs: list[LayerCost]) -> list[LayerCost]:
    return [dataclasses.replace(c, name=f"model.layers.{i}") for i, c in enumerate(costs)]


def _choices(c: LayerCost) -> list[Choice]:
    return [x for x in Choice if x is not Choice.SAC or c.sac_offered]


@settings(max_examples=150, deadline=None)
@given(st.lists(layer, min_size=1, max_size=3), st.integers(0, 40_000), st.integers(0, 5_000))
def test_the_least_time_under_the_budget(costs: list[LayerCost], room: int, lean: int) -> None:
    costs = _named(costs)
    d = choose(costs, lean + room, lean, fixed_s=1.0)
    fitting = [ch for ch in itertools.product(*[_choices(c) for c in costs])
               if predict(costs, ch, lean, 1.0)[0] <= lean + room]
    if not d.fits:
        assert not fitting and d.choices == (Choice.OFFLOAD,) * len(costs)
        return
    assert fitting and d.peak_bytes <= lean + room, "the decision holds more than the budget allows"
    assert (d.peak_bytes, d.step_s) == predict(costs, d.choices, lean, 1.0)
    # Exact: no decision that fits is faster.
    assert d.step_s <= min(predict(costs, ch, lean, 1.0)[1] for ch in fitting) + 1e-9


@settings(max_examples=60, deadline=None)
@given(st.lists(layer, min_size=1, max_size=6))
def test_more_room_is_never_slower(costs: list[LayerCost]) -> None:
    costs = _named(costs)
    total = sum(c.held_none for c in costs)
    steps = [choose(costs, 1000 + r, 1000, 0.0).step_s for r in range(0, total + 2, max(1, total // 7))]
    assert steps == sorted(steps, reverse=True)
    # Room for everything: nothing is checkpointed, nothing added to the step.
    d = choose(costs, 1000 + total, 1000, 0.0)
    assert d.choices == (Choice.NONE,) * len(costs) and d.step_s == 0.0


def test_copies_slower_than_compute_recompute_instead() -> None:
    # Room for two layers without checkpointing only if the other two hold nothing (offload), not their inputs.
    fast = [LayerCost(f"l{i}", 100, 10, forward_s=1.0, backward_s=2.0, copy_s=0.1) for i in range(4)]
    slow = [LayerCost(f"l{i}", 100, 10, forward_s=1.0, backward_s=2.0, copy_s=5.0) for i in range(4)]
    assert choose(fast, 200 + 19, 0, 0.0).counts() == {"none": 2, "keep": 0, "sac": 0, "offload": 2}
    assert choose(slow, 200 + 19, 0, 0.0).counts() == {"none": 1, "keep": 3, "sac": 0, "offload": 0}


def test_pins_and_what_does_not_fit() -> None:
    costs = [LayerCost(f"l{i}", 100, 10, 1.0, 2.0, 0.1) for i in range(3)]
    d = choose(costs, 10_000, 0, 0.0, pins={"l1": Choice.OFFLOAD})
    assert [str(c) for c in d.choices] == ["none", "offload", "none"] and d.pinned == ("l1",)
    d = choose(costs, 50, 100, 0.0)
    assert not d.fits and d.choices == (Choice.OFFLOAD,) * 3 and "DOES NOT FIT" in d.table(costs)
    with pytest.raises(ValueError, match="l7"):
        choose(costs, 10_000, 0, 0.0, pins={"l7": Choice.NONE})
    with pytest.raises(ValueError, match="must be one of none, keep, sac, offload"):
        Choice.parse("maybe", "the pin")
    with pytest.raises(ValueError, match="pins sac on l0, whose projections were not measured"):
        choose(costs, 10_000, 0, 0.0, pins={"l0": Choice.SAC})


def _sac_layers(copy_s: float) -> list[LayerCost]:
    """4 layers: 100 bytes without checkpointing, a 10-byte input, 40 bytes of projections that take 0.6 of the
    1.0 s forward."""
    return [LayerCost(f"l{i}", 100, 10, forward_s=1.0, backward_s=2.0, copy_s=copy_s, sac_bytes=40,
                      projection_s=0.6) for i in range(4)]


def test_sac_skips_the_projections_recompute_where_copies_hide_and_its_window_fits() -> None:
    fast = _sac_layers(0.1)
    # Room for the window of two layers' projections (80 bytes), not for a layer without checkpointing plus it.
    d = choose(fast, 80, 0, 0.0)
    assert d.counts() == {"none": 0, "keep": 0, "sac": 4, "offload": 0}
    assert d.peak_bytes == 80 and d.step_s == pytest.approx(4 * 0.4 + 0.5)  # recompute 0.4 each; fill: one 5x copy
    assert "sac window: " in d.table(fast)
    # One byte less: no window, so keep (the recompute whole, no copy); with less room still, offload.
    assert choose(fast, 79, 0, 0.0).counts() == {"none": 0, "keep": 4, "sac": 0, "offload": 0}
    assert choose(fast, 9, 0, 0.0).counts() == {"none": 0, "keep": 0, "sac": 0, "offload": 4}
    # The window is one term whatever the count: room for it and one layer without checkpointing.
    assert choose(fast, 180, 0, 0.0).counts() == {"none": 1, "keep": 0, "sac": 3, "offload": 0}
    # Copies 5x the input's, slower than what hides them: the plain offload (or keep) is faster.
    slow = _sac_layers(0.5)
    assert choose(slow, 80, 0, 0.0).counts()["sac"] == 0
    # A window of 1 (no prefetch) costs half.
    assert choose(fast, 40, 0, 0.0, sac_window=1).counts()["sac"] == 4



@settings(max_examples=80, deadline=None)
@given(st.lists(layer, min_size=1, max_size=3), st.integers(0, 40_000), st.integers(0, 20_000))
def test_a_host_room_bounds_the_sac_layers_projections(costs: list[LayerCost], room: int, host_room: int) -> None:
    costs = _named(costs)
    free = choose(costs, room, 0, 1.0)
    d = choose(costs, room, 0, 1.0, host_room=host_room)
    assert d.fits == free.fits
    if not d.fits:
        return
    assert sac_host_bytes(costs, d.choices) <= host_room and d.peak_bytes <= room
    assert d.step_s >= free.step_s - 1e-9  # a bound never makes it faster
    if sac_host_bytes(costs, free.choices) <= host_room:
        assert d.choices == free.choices  # a bound that does not bind changes nothing
    # Never slower than the best decision without any sac.
    no_sac = [dataclasses.replace(c, sac_bytes=0) for c in costs]
    assert d.step_s <= choose(no_sac, room, 0, 1.0).step_s + 1e-9


def test_a_host_room_sheds_the_sac_layers_that_gain_least_per_host_byte() -> None:
    # Two layers gain 0.6 s of recompute for 40 host bytes, two gain 0.2 s for 40: room on the host for two.
    costs = _sac_layers(0.1)[:2] + [dataclasses.replace(c, name=f"m{i}", projection_s=0.2)
                                    for i, c in enumerate(_sac_layers(0.1)[:2])]
    assert choose(costs, 80, 0, 0.0).counts()["sac"] == 4
    d = choose(costs, 80, 0, 0.0, host_room=80)
    assert [str(c) for c in d.choices] == ["sac", "sac", "offload", "offload"], d.choices  # the window: no room to keep
    assert choose(costs, 80, 0, 0.0, host_room=0).counts()["sac"] == 0


def _alternating(copy_s: float) -> list[LayerCost]:
    """Six layers, MoE-like (forward 3, backward 6) then dense-like (1, 2), every input a copy of `copy_s`."""
    return [LayerCost(f"l{i}", 1000, 100, 3.0 if i % 2 == 0 else 1.0, 6.0 if i % 2 == 0 else 2.0, copy_s)
            for i in range(6)]


def test_backward_played_through_one_copy_engine_as_the_engine_prefetches() -> None:
    # Every layer offloaded, copies of 5 against backward compute (recompute + backward) of 9 and 3, alternating.
    # Forward: recompute 3*3 + 3*1 = 12, copies out not hidden 3*(5-3) + 3*(5-1) = 18. Backward (layers 5..0):
    # depth 0: every restore waited whole, 6*5 = 30; depth 1: the first waited (5), then each dense layer's
    # restore (5) started at its neighbour's unpack waits 5-3 = 2 behind a dense layer's compute, three times (5+6);
    # depth 2: two restores run behind each MoE layer's 9, one wait of 2 (5+2). Deeper: nothing more to gain.
    costs = _alternating(5.0)
    off = [Choice.OFFLOAD] * 6
    assert [pipeline_s(costs, off, d) for d in range(5)] == [60.0, 41.0, 37.0, 37.0, 37.0]
    # Copies shorter than every layer's compute: only the fill is waited for, whatever the depth.
    assert [pipeline_s(_alternating(2.0), off, d) for d in (1, 2, 3)] == [12 + 3 * 1 + 2.0] * 3


@settings(max_examples=100, deadline=None)
@given(st.lists(layer, min_size=1, max_size=6), st.data())
def test_a_deeper_prefetch_never_waits_longer(costs: list[LayerCost], data: st.DataObject) -> None:
    costs = _named(costs)
    ch = [data.draw(st.sampled_from(_choices(c))) for c in costs]
    times = [pipeline_s(costs, ch, d) for d in range(5)]
    assert all(a >= b - 1e-9 for a, b in zip(times, times[1:])), times
    # Depth 0: every restore waited for whole.
    recompute = sum(c.forward_s - (min(c.projection_s, c.forward_s) if x is Choice.SAC else 0.0)
                    for c, x in zip(costs, ch) if x is not Choice.NONE)
    copies_out = sum(max(0.0, c.copy(x) - c.forward_s) for c, x in zip(costs, ch))
    assert times[0] == pytest.approx(recompute + copies_out + sum(c.copy(x) for c, x in zip(costs, ch)))


def test_the_prefetch_depth_chosen_where_it_pays_and_its_restores_fit() -> None:
    costs = _alternating(5.0)
    # Every layer's input is the same size, so a byte of one more restore ahead buys more as one more kept input
    # (its copies gone, not only hidden): with room for one input, one layer keeps, at depth 1 (35 against 37).
    d = choose(costs, 100, 0, 0.0, sac_window=2, prefetch_depths=range(1, 4))
    assert (d.prefetch_depth, d.counts()["keep"], d.step_s, d.peak_bytes) == (1, 1, 35.0, 100)
    # Where every layer must offload (pinned), the room goes to the prefetch: depth 2, its restore counted.
    pins = {c.name: Choice.OFFLOAD for c in costs}
    d = choose(costs, 100, 0, 0.0, pins=pins, sac_window=2, prefetch_depths=range(1, 4))
    assert (d.prefetch_depth, d.step_s, d.peak_bytes) == (2, 37.0, 100)
    assert "prefetch depth 2" in d.table(costs)
    # One byte short of the restore: the depth the lean peak was measured at.
    d = choose(costs, 99, 0, 0.0, pins=pins, sac_window=2, prefetch_depths=range(1, 4))
    assert (d.prefetch_depth, d.step_s, d.peak_bytes) == (1, 41.0, 0)
    # Copies hidden at any depth: the shallowest (no bytes for nothing).
    d = choose(_alternating(2.0), 1_000, 0, 0.0, pins=pins, sac_window=2, prefetch_depths=range(1, 4))
    assert d.prefetch_depth == 1
    # Without depths: the caller's, and the per-layer copy model.
    assert choose(costs, 0, 0, 0.0).prefetch_depth is None


def test_sacs_learned_cost_moves_the_choice() -> None:
    costs = _sac_layers(0.1)
    assert choose(costs, 80, 0, 0.0).counts()["sac"] == 4
    learned = [dataclasses.replace(c, sac_extra_s=c.projection_s) for c in costs]  # sac gains nothing now
    assert choose(learned, 80, 0, 0.0).counts()["sac"] == 0
