"""Policy auto never goes over its budget: the inputs that broke its model of a step (issue 51), each step's peak
measured by the test itself on hsoffload's counting CPU allocator (reset before forward, read after
`optimizer.step()` and `zero_grad`, AdamW's first step allocating its states included), every run bit for bit plain
checkpointing's. Budgets are set from peaks this file measures on fixed configurations, never from auto's figures.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import random
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
import torch
import transformers

import hsoffload
from hsoffload.choose import Choice
from hsoffload.offload import auto
from hsoffload.offload.auto import DeviceMemory
from hsoffload.offload.calibration import bucket_length
from hsoffload.targets import enable_checkpointing
from torch.utils.checkpoint import noop_context_fn

MIB = 1 << 20
LAYERS = 4
Batch = tuple[int, int]  # (sequences, length)


@pytest.fixture(autouse=True)
def _meter() -> None:
    DeviceMemory(torch.device("cpu"))  # the counting allocator, installed before any model


def _meter_reset() -> None:
    torch.classes.hsoffload.OffloadScope.cpu_meter_reset_peak()


def _meter_peak() -> int:
    return int(torch.classes.hsoffload.OffloadScope.cpu_meter_stats()["peak_allocated_bytes"])


def _model(attn: str = "eager", dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A tiny Llama, checkpointed with torch's `noop_context_fn` as its context_fn: the checkpoint runs as without
    one, and policy auto does not offer its `sac` choice (whose context would replace the user's). Between none,
    keep and offload the choice at a budget is set by bytes, not by this machine's noisy timings, so that two runs
    can be compared choice for choice."""
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.train()
    enable_checkpointing(model, {"use_reentrant": False, "context_fn": noop_context_fn})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _batch(step: int, shape: Batch, pad: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 512, shape, generator=torch.Generator().manual_seed(step))
    batch = {"input_ids": ids, "labels": ids}
    if pad:  # the last quarter of the first sequence is padding: transformers builds a 4-D mask
        mask = torch.ones_like(ids)
        mask[0, -max(1, shape[1] // 4):] = 0
        batch["attention_mask"] = mask
    return batch


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, shapes: Sequence[Batch], scope: Any = None,
           pad: bool = False, forwards: Callable[[int], int] = lambda step: 1,
           first: int = 0) -> tuple[list[float], list[int]]:
    """Steps of `shapes` (in `scope` if given): the losses and each step's peak as the meter saw it (what else is
    alive counts too: every run starts after a collection, with the reference run's weights held throughout)."""
    gc.collect()
    losses, peaks = [], []
    for k, shape in enumerate(shapes):
        step = first + k
        _meter_reset()
        with scope if scope is not None else _null():
            loss = sum(model(**_batch(step * 10 + f, shape, pad)).loss for f in range(forwards(step)))
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        peaks.append(_meter_peak())
        losses.append(float(loss.detach()))
    return losses, peaks


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _auto(model: torch.nn.Module, budget: int, **kwargs: Any) -> Any:
    return hsoffload.offload_hidden_states(model, policy="auto", device_budget=budget, min_offload_size=0,
                                          offload_cpu_tensors=True, **kwargs)


def _fixed_peak(shape: Batch, unchecked: int, attn: str = "eager", pad: bool = False, steps: int = 2) -> int:
    """The steady peak of the first `unchecked` layers without checkpointing and the others checkpointed and
    offloaded (a fixed configuration, no auto), measured here. (The first ones: a layer's activations held from its
    forward to its backward count whole at the peak, where backward starts; the last layer's recompute happens there
    anyway, so leaving it uncheckpointed costs next to nothing.)"""
    model, opt = _model(attn)
    for layer in model.model.layers[:unchecked]:
        layer.gradient_checkpointing = False
    scope = hsoffload.offload_hidden_states(model, policy="hidden_states", min_offload_size=0,
                                            offload_cpu_tensors=True)
    _, peaks = _train(model, opt, [shape] * steps, scope, pad)
    return max(peaks)


def _plain(shapes: Sequence[Batch], attn: str = "eager", pad: bool = False,
           forwards: Callable[[int], int] = lambda step: 1) -> tuple[list[float], list[torch.Tensor]]:
    model, opt = _model(attn)
    losses, _ = _train(model, opt, shapes, None, pad, forwards)
    return losses, [p.detach().clone() for p in model.parameters()]


def _assert_bitwise(model: torch.nn.Module, losses: list[float], ref: tuple[list[float], list[torch.Tensor]]) -> None:
    assert losses == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref[1]))


def _assert_under(peaks: list[int], budget: int) -> None:
    over = [(k, round(p / MIB, 2)) for k, p in enumerate(peaks) if p > budget]
    assert not over, f"steps over the {budget / MIB:.2f} MiB budget (step, MiB): {over}"


def _half_way(shape: Batch, attn: str = "eager", pad: bool = False) -> list[int]:
    """Budgets half-way between the peaks of 0..LAYERS-1 layers left uncheckpointed at `shape`, measured here by
    each test (with what that test holds alive: its reference run's weights)."""
    peaks = [_fixed_peak(shape, k, attn, pad) for k in range(LAYERS)]  # (all LAYERS: the last one's comes free)
    assert peaks == sorted(peaks) and peaks[-1] > peaks[0] * 1.5, [p / MIB for p in peaks]
    return [(a + b) // 2 for a, b in zip(peaks, peaks[1:])]


@pytest.mark.slow
@pytest.mark.parametrize("attn,pad", [("eager", False), ("sdpa", True)])
def test_equal_tokens_in_longer_sequences_stay_under_the_budget(attn: str, pad: bool) -> None:
    """Calibrated on 8 x 64, then 1 x 512 (the same tokens; attention holds 8x more per layer): the longer
    batch runs in a bucket of its own, calibrated before it is decided for, under the budget at every step."""
    shapes = [(8, 64)] * 4 + [(1, 512)] * 4
    ref = _plain(shapes, attn, pad)
    budget = int(_fixed_peak((1, 512), 0, attn, pad) * 1.02)  # just above the leanest at the longer shape
    model, opt = _model(attn)
    losses, peaks = _train(model, opt, shapes, _auto(model, budget), pad)
    _assert_under(peaks, budget)
    _assert_bitwise(model, losses, ref)
    ctl = auto.controller(model)
    assert {s.length for s in ctl.buckets} == {64, 512} and all(s.quadratic for s in ctl.buckets)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["long-first", "short-first"])
def test_alternating_lengths_decide_as_the_common_length_alone(order: str) -> None:
    """512 and 64 alternating: each length runs its own bucket's decision, the 512 one the same as a run of
    512 alone makes, at budgets half-way between two layer counts (where a misjudged byte changes the choice)."""
    long, short = (1, 512), (1, 64)
    shapes = [long, short] * 5 if order == "long-first" else [short, long] * 5
    ref = _plain(shapes)
    budgets = _half_way(long)
    for budget in (budgets[0], budgets[2]):
        alone, alone_opt = _model()
        _, alone_peaks = _train(alone, alone_opt, [long] * 4, _auto(alone, budget))
        _assert_under(alone_peaks, budget)
        expected = auto.controller(alone).decision.choices
        del alone, alone_opt
        model, opt = _model()
        losses, peaks = _train(model, opt, shapes, _auto(model, budget))
        _assert_under(peaks, budget)
        _assert_bitwise(model, losses, ref)
        ctl = auto.controller(model)
        decided = [b for b in ctl.buckets.values() if b.shape.length == 512]
        assert decided and decided[0].decision.choices == expected, (ctl.decision_log, expected)
        del model, opt, ctl, decided  # the next run alone starts with what this one started with


@pytest.mark.slow
def test_random_lengths_calibrate_each_bucket_at_most_twice_and_decide_no_bolder_than_its_top_alone() -> None:
    """Seeded random lengths in [L/8, L] over 20 steps: at most two calibration steps per length bucket, every
    step under the budget, each bucket's decision no bolder than a run at its top length alone makes (the same where
    it was measured at its top: the alternating test)."""
    top = 512
    rng = random.Random(51)
    shapes = [(1, rng.randint(top // 8, top)) for _ in range(20)]
    ref = _plain(shapes)
    budget = _half_way((1, top))[1]
    model, opt = _model()
    losses, peaks = _train(model, opt, shapes, _auto(model, budget))
    _assert_under(peaks, budget)
    _assert_bitwise(model, losses, ref)
    ctl = auto.controller(model)
    records = list(ctl.history)  # a step is recorded when the next one starts: the last one is not yet
    assert len(records) == len(shapes) - 1
    calibrations: dict[int, int] = {}
    for shape, rec in zip(shapes, records):
        if not rec.decided:
            calibrations[bucket_length(shape[1])] = calibrations.get(bucket_length(shape[1]), 0) + 1
    assert max(calibrations.values()) <= 2, calibrations
    decided_tops = {bucket_length(s[1]) for s, r in zip(shapes, records) if r.decided}
    assert decided_tops, "no bucket was decided for"
    ours = {b.shape.length: b.decision.choices for b in ctl.buckets.values() if b.decision is not None}
    log = list(ctl.decision_log)
    del model, opt, ctl  # the runs alone start with what this one started with
    for length in sorted(decided_tops)[-2:]:  # the two longest decided buckets: where the budget binds
        alone, alone_opt = _model()
        _train(alone, alone_opt, [(1, length)] * 3, _auto(alone, budget))
        theirs = auto.controller(alone).decision.choices
        # Measured below the bucket's top and scaled up to it (quadratic attention: by up to 1.26^2), a bucket's
        # decision leaves no more layers uncheckpointed than a run at the top alone; at the top, the same.
        assert sum(c is Choice.NONE for c in ours[length]) <= sum(c is Choice.NONE for c in theirs), (length, log)
        del alone, alone_opt


def _saved_run(tmp_path: Path, budget: int, shape: Batch = (1, 512), **model_kwargs: Any) -> str:
    path = str(tmp_path / "auto-{rank}.json")
    model, opt = _model(**model_kwargs)
    _train(model, opt, [shape] * 3, _auto(model, budget, auto_state_path=path))
    assert json.loads((tmp_path / "auto-0.json").read_text())["buckets"]
    return path


@pytest.mark.slow
@pytest.mark.parametrize("other", ["attention", "dtype", "micro-batch"])
def test_a_state_file_from_another_run_is_not_applied(tmp_path: Path, other: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A file saved by an SDPA run (or a bfloat16 one, or one of another micro-batch) decides nothing in an eager
    float32 run of 1 x 512: that run calibrates, and stays under its budget from its first step."""
    shapes = [(1, 512)] * 4
    ref = _plain(shapes)
    budget = _half_way((1, 512))[1]
    kwargs = {"attention": {"attn": "sdpa"}, "dtype": {"dtype": torch.bfloat16}, "micro-batch": {}}[other]
    path = _saved_run(tmp_path, 10 * budget, (2, 512) if other == "micro-batch" else (1, 512), **kwargs)
    model, opt = _model()
    with caplog.at_level(logging.INFO, logger="hsoffload"):
        losses, peaks = _train(model, opt, shapes, _auto(model, budget, auto_state_path=path))
    _assert_under(peaks, budget)
    _assert_bitwise(model, losses, ref)
    ctl = auto.controller(model)
    assert [r.decided for r in ctl.history] == [False, False, True]  # the last step is recorded by the next
    said = " ".join(r.getMessage() for r in caplog.records)
    if other == "micro-batch":  # the identity matched; the file's bucket is another shape's
        assert "2x512q" not in {s.key() for s in ctl.buckets} and "are not reused" not in said
    else:  # the identity names what differs
        assert "it was saved for another" in said and {"attention": "attention (", "dtype": "dtypes ("}[other] in said


@pytest.mark.slow
def test_a_layer_that_saves_more_than_its_file_says_is_measured_again(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A mismatch the file's identity cannot see: the same classes and shapes, but every decoder layer now saves
    runs its attention twice. The restored bucket's first (lean) step measures more than the file
    says: nothing of the file is used, and no step goes over."""
    budget = _half_way((1, 512))[2]
    path = _saved_run(tmp_path, budget)
    model, opt = _model()
    for layer in model.model.layers:  # attention run twice and averaged: the same output, twice its saves
        attn = layer.self_attn
        plain = attn.forward

        def twice(*args: Any, _plain: Callable[..., Any] = plain, **kwargs: Any) -> Any:
            a, b = _plain(*args, **kwargs), _plain(*args, **kwargs)
            return ((a[0] + b[0]) / 2,) + tuple(a[1:])

        attn.forward = twice
    shapes = [(1, 512)] * 4
    with caplog.at_level(logging.INFO, logger="hsoffload"):
        _, peaks = _train(model, opt, shapes, _auto(model, budget, auto_state_path=path))
    _assert_under(peaks, budget)
    assert any("are not reused" in r.getMessage() for r in caplog.records)
    assert [r.decided for r in auto.controller(model).history] == [False, False, True]


@pytest.mark.slow
def test_a_second_forward_per_backward_after_calibration_stays_under() -> None:
    """From step 4 on, each step runs two forwards before one backward: the decision made for one forward is not
    changed between them (the first forward runs it, the extra forward runs every layer checkpointed and offloaded),
    the next step decides for two, and every step after is under the budget. The step where the second forward first
    comes is the one auto cannot plan for (docs/usage.md): the first forward's held bytes are alive through the whole
    second graph, so it may pass the budget by what a second forward adds to the leanest step (its head and loss,
    measured here with every layer offloaded) plus what the first forward's decision holds (at most what its layers
    left uncheckpointed add, measured here)."""
    shape = (1, 512)
    two = lambda step: 1 if step < 4 else 2  # noqa: E731
    shapes = [shape] * 8
    ref = _plain(shapes, forwards=two)
    budget = _half_way(shape)[2]
    lean = {}
    for forwards in (1, 2):
        lean_model, lean_opt = _model()
        scope = hsoffload.offload_hidden_states(lean_model, policy="hidden_states", min_offload_size=0,
                                                offload_cpu_tensors=True)
        lean[forwards] = max(_train(lean_model, lean_opt, [shape] * 2, scope, forwards=lambda s, f=forwards: f)[1])
        del lean_model, lean_opt, scope
    model, opt = _model()
    calls: list[tuple[int, bool]] = []  # per decoder-layer call in forward (not a recompute): index, checkpointed
    index = {id(layer): k for k, layer in enumerate(model.model.layers)}

    def seen(module: torch.nn.Module, args: Any) -> None:
        if torch._C._current_graph_task_id() == -1:  # not inside backward (a checkpoint's recompute)
            calls.append((index[id(module)], module.gradient_checkpointing))

    handles = [layer.register_forward_pre_hook(seen) for layer in model.model.layers]
    losses, peaks = _train(model, opt, shapes, _auto(model, budget), forwards=two)
    for h in handles:
        h.remove()
    _assert_under(peaks[:4] + peaks[5:], budget)
    held = _fixed_peak(shape, 3) - _fixed_peak(shape, 0)  # the most a half-way decision's layers hold
    assert peaks[4] <= budget + (lean[2] - lean[1]) + held, (peaks[4], budget, lean, held)
    _assert_bitwise(model, losses, ref)
    ctl = auto.controller(model)
    assert ctl.forwards == 2
    runs: list[list[bool]] = []  # the calls from one call of layer 0 to the next: a forward (or a probe's call)
    for k, flag in calls:
        if k == 0:
            runs.append([])
        runs[-1].append(flag)
    forwards = [r for r in runs if len(r) == LAYERS]  # a probe calls one layer on its own
    assert len(forwards) == sum(two(step) for step in range(len(shapes)))
    steps: list[list[list[bool]]] = []
    for step in range(len(shapes)):
        steps.append([forwards.pop(0) for _ in range(two(step))])
    decided_one = steps[3][0]  # step 3: the decision for one forward
    assert not all(decided_one), "the budget leaves no layer uncheckpointed: nothing to keep across forwards"
    assert steps[4][0] == decided_one, "the decision changed before the first forward of the 2-forward step"
    assert all(steps[4][1]), "the extra forward did not run every layer checkpointed"
    assert all(len(s) == 2 for s in steps[5:]) and steps[5][0] == steps[5][1], "not one decision for both forwards"


def test_a_fresh_trainer_run_does_not_read_an_earlier_runs_file(tmp_path: Path) -> None:
    """The Trainer integration's default state path is written by every run and read only by one that resumes."""
    from hsoffload.integrations.trainer import _keep_auto_state

    class _State:
        global_step = 0

    class _Args:
        output_dir = str(tmp_path)

    class _Trainer:
        args = _Args()
        state = _State()

    model, _ = _model()
    scope = _auto(model, 64 * MIB)
    scope.bind_model(model)
    _keep_auto_state(scope, _Trainer())
    assert scope.auto.state_path.startswith(str(tmp_path)) and not scope.auto.restore_state
    _Trainer.state.global_step = 7
    scope.auto.state_path = None
    _keep_auto_state(scope, _Trainer())
    assert scope.auto.restore_state


@pytest.mark.parametrize("name,value,words", [
    ("auto_calibration_steps", 0, "an int from 1 to 100"),
    ("auto_calibration_steps", 101, "an int from 1 to 100"),
    ("auto_state_path", 123, "a file path (a template: {rank} is replaced by the rank)"),
    ("device_budget", "lots", "bytes"),
    ("auto_report_only", "yes", "a bool"),
])
def test_bad_auto_options_name_the_whole_allowed_range(name: str, value: Any, words: str) -> None:
    with pytest.raises((ValueError, TypeError)) as err:
        hsoffload.OffloadConfig(policy="auto", **{name: value})
    assert name in str(err.value) and words in str(err.value), str(err.value)



def test_a_buckets_top_is_in_its_own_bucket_and_powers_of_two_are_tops() -> None:
    """A batch at a bucket's top runs in that bucket (a run of the top length alone and a run of shorter lengths
    of the bucket decide for the same shape); every length's top is at least the length and at most 1.26x it."""
    tops = sorted({bucket_length(n) for n in range(1, 70_000)})
    assert all(bucket_length(t) == t for t in tops)
    assert all(n <= bucket_length(n) <= max(2, math.ceil(n * 2 ** (1 / 3))) for n in range(1, 70_000))
    assert {2 ** k for k in range(17)} <= set(tops)


def test_a_resumed_run_keeps_the_buckets_it_has_not_seen_yet(tmp_path: Path) -> None:
    """Run A decides for two lengths; run B, resumed from A's file, sees only one of them before it saves: the
    other length's bucket is still in the file for the next resume."""
    path = str(tmp_path / "auto-{rank}.json")
    model, opt = _model()
    _train(model, opt, [(1, 512), (1, 64)] * 3, _auto(model, 1 << 30, auto_state_path=path))
    assert set(json.loads((tmp_path / "auto-0.json").read_text())["buckets"]) == {"1x512q", "1x64q"}
    del model, opt
    model, opt = _model()
    _train(model, opt, [(1, 64)] * 3, _auto(model, 1 << 30, auto_state_path=path))
    assert auto.controller(model).decisions >= 1
    assert set(json.loads((tmp_path / "auto-0.json").read_text())["buckets"]) == {"1x512q", "1x64q"}


def test_sdpa_with_attention_dropout_counts_as_quadratic() -> None:
    """SDPA without a mask is linear where it runs a fused kernel; with attention dropout in training it takes the
    math path (the probabilities held): the batch's shape says quadratic."""
    from hsoffload.offload.auto import _shape

    model, _ = _model("sdpa")
    layer = model.model.layers[0]
    x = torch.zeros(1, 512, 64)
    assert not _shape(layer, x, (x,), {}).quadratic
    layer.self_attn.config.attention_dropout = 0.1
    assert _shape(layer, x, (x,), {}).quadratic
