"""The step-time model (hsoffload.planning.timing): every plan and --max-seq row carries a predicted step, its parts
add up, copies that compute hides cost only the pipeline's fill, and copies slower than compute show in full."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hsoffload import costs
from hsoffload import plan
from hsoffload.planning import timing
from hsoffload.tools.cli import main

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B = str(REPO / "configs" / "llama-8b-shape.json")
BASE = [LLAMA_8B, "--seq-len", "65536", "--world-size", "8", "--device-gib", "80", "--host-ram-gib", "2048"]


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_plan_carries_its_step_time(capsys: pytest.CaptureFixture[str]) -> None:
    p = _json(capsys, *BASE)
    assert p["device_profile"] == "h100-sxm"
    assert p["step_time_s"] == pytest.approx(sum(p["step_parts"].values()))
    assert p["step_overhead"] == pytest.approx(p["step_time_s"] / p["step_time_s_checkpointing"] - 1)
    # 8 ranks share the node's host memory bandwidth (300 GB/s / 8 < the 50 GB/s link): 37.5 GB/s per rank.
    assert p["transfer_s_per_layer"] == pytest.approx(p["layer_input_bytes"] / 37.5e9)
    # Hidden copies cost the backward pipeline's fill only: its first restore. In forward the last copy ends before
    # the layers do.
    assert p["step_parts"]["exposed_d2h"] == 0
    assert p["step_parts"]["exposed_h2d"] == pytest.approx(p["transfer_s_per_layer"])
    assert 0 < p["step_overhead"] < 0.01
    assert main(["plan", *BASE]) == 0
    assert "against checkpointing only" in capsys.readouterr().out


def test_copies_slower_than_compute_show_in_full(capsys: pytest.CaptureFixture[str]) -> None:
    overheads = [_json(capsys, *BASE, "--bandwidth", str(gbps))["step_overhead"] for gbps in (50, 2, 0.5, 0.1)]
    assert overheads == sorted(overheads) and overheads[-1] > 0.3
    slow = _json(capsys, *BASE, "--bandwidth", "0.1")
    layers, copy = 32, slow["transfer_s_per_layer"]
    # The forward's copies queue up behind each other: the last ends at layers x copy, and backward's first restore
    # waits for it; the layers' forward and the head's forward and backward hide that much of it.
    head = slow["step_parts"]["head"]
    assert slow["step_parts"]["exposed_d2h"] == pytest.approx(layers * copy - layers * slow["forward_s_per_layer"]
                                                              - head)
    # Backward: the restores are the slower stage of the pipeline, one layer's compute not hidden.
    parts = slow["step_parts"]
    bwd = (parts["recompute"] + parts["backward"]) / layers
    assert slow["step_parts"]["exposed_h2d"] == pytest.approx(layers * copy + bwd - layers * bwd)


def test_forward_copies_hidden_by_the_layers_and_the_head() -> None:
    # 4 layers of 1 s: copies of 0.5 s end at 3.5 s, before the layers; copies of 2 s end at 8 s, the layers and a
    # 1 s head at 5 s: 3 s show; a 5 s head hides them.
    assert costs.copies_out_exposed_s(4, 4, layer_forward=1.0, per_copy=0.5, head=0.0) == 0.0
    assert costs.copies_out_exposed_s(4, 4, layer_forward=1.0, per_copy=2.0, head=1.0) == pytest.approx(3.0)
    assert costs.copies_out_exposed_s(4, 4, layer_forward=1.0, per_copy=2.0, head=5.0) == 0.0
    # Two kept layers compute after the two offloaded ones' copies started: they hide them too.
    assert costs.copies_out_exposed_s(2, 4, layer_forward=1.0, per_copy=2.0, head=0.0) == 0.0
    assert costs.copies_out_exposed_s(0, 4, layer_forward=1.0, per_copy=2.0, head=0.0) == 0.0


def test_flash_attention_backward_recomputes_the_scores(capsys: pytest.CaptureFixture[str]) -> None:
    # At a long sequence attention dominates: its backward with a fused kernel is 2.5 forwards (5 matmuls against
    # 2), with the math path 2; the projections' backward is 2 forwards either way.
    flash = _json(capsys, *BASE, "--seq-len", "1048576", "--sequence-parallel", "8")["step_parts"]
    math_ = _json(capsys, *BASE, "--seq-len", "1048576", "--sequence-parallel", "8", "--attn", "math")["step_parts"]
    assert flash["forward"] == pytest.approx(math_["forward"])
    assert 2.3 < flash["backward"] / flash["forward"] < 2.5
    assert math_["backward"] / math_["forward"] == pytest.approx(2.0)


def test_gradient_accumulation_repeats_the_micro_batches_not_the_optimizer(capsys: pytest.CaptureFixture[str]) -> None:
    one = _json(capsys, *BASE, "--cpu-offload", "optimizer")
    eight = _json(capsys, *BASE, "--cpu-offload", "optimizer", "--grad-accum", "8")
    assert eight["input"]["grad_accum"] == 8
    for part, t in one["step_parts"].items():
        assert eight["step_parts"][part] == pytest.approx(t if part.startswith("optimizer") else 8 * t), part
    assert one["step_parts"]["optimizer_on_host"] > 0
    assert main(["plan", *BASE, "--grad-accum", "0"]) == 2
    assert "--grad-accum must be >= 1" in capsys.readouterr().err


def test_pipeline_fill_and_throughput() -> None:
    assert costs.restores_exposed_s(10, compute=2.0, copy=1.0) == pytest.approx(1.0)  # hidden: the last copy's fill
    assert costs.restores_exposed_s(10, compute=1.0, copy=3.0) == pytest.approx(10 * 3 + 1 - 10)  # copy-bound
    assert costs.restores_exposed_s(0, compute=1.0, copy=3.0) == 0.0


def test_profiles_and_a_profile_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    h100 = _json(capsys, *BASE)["step_time_s"]
    a100 = _json(capsys, *BASE, "--device-profile", "a100-80gb")
    assert a100["step_time_s"] > 2.5 * h100 and a100["device_profile"] == "a100-80gb"
    fields = {**timing.PROFILES["h100-sxm"].__dict__, "name": "mine", "tflops": 100.0}
    fields.pop("source")
    (tmp_path / "mine.json").write_text(json.dumps(fields))
    mine = _json(capsys, *BASE, "--device-profile", str(tmp_path / "mine.json"))
    assert mine["device_profile"] == "mine" and mine["step_time_s"] > h100
    assert main(["plan", *BASE, "--device-profile", "tpu"]) == 2
    assert "--device-profile must be one of" in capsys.readouterr().err
    assert all(p.source for p in timing.PROFILES.values())


def test_max_seq_rows_carry_their_step_time() -> None:
    r = plan.max_seq(plan.PlanInput(config=LLAMA_8B, seq_len=1, world_size=8, device_bytes=80 << 30))
    runs = [run for row in r.rows for run in (row.checkpointing, row.hsoffload) if run.seq_len]
    assert runs and all(run.step_time_s and run.step_time_s > 0 for run in runs)
    # Every cell carries its copies' overhead: none without hsoffload, hidden copies (a fraction of a percent) with.
    assert all(row.checkpointing.step_overhead == 0 for row in r.rows if row.checkpointing.seq_len)
    assert all(0 < row.hsoffload.step_overhead < 0.01 for row in r.rows if row.hsoffload.seq_len)
    assert r.device_profile == "h100-sxm"


def test_max_seq_marks_the_fastest_combination_that_fits(capsys: pytest.CaptureFixture[str]) -> None:
    args = [LLAMA_8B, "--max-seq", "--world-size", "8", "--device-gib", "80"]
    r = _json(capsys, *args)
    f = r["fastest"]
    cells = {(row["knobs"], col): row[col] for row in r["rows"] for col in ("checkpointing", "hsoffload")}
    # By default it compares at the longest length any combination fits; the cell it names fits that length.
    assert f["seq_len"] == max(c["seq_len"] for c in cells.values())
    assert cells[(f["knobs"], f["column"])]["seq_len"] >= f["seq_len"]
    # There only sequence parallelism reaches: 8 ranks share each sequence.
    assert "sequence parallel 8" in f["knobs"]
    assert f["tokens_per_s"] == pytest.approx(f["seq_len"] / 8 / f["step_time_s"])
    # At a length every combination fits, the most tokens per second per rank wins: checkpointing alone (hsoffload's
    # copies only add time) on a combination without sequence parallelism (its step is shorter, but 8 ranks then
    # share one sequence); compared per rank, not per step.
    short = _json(capsys, *args, "--seq-len", "8192")["fastest"]
    assert short["seq_len"] == 8192 and short["column"] == "checkpointing"
    assert "sequence parallel" not in short["knobs"]
    sp = _json(capsys, LLAMA_8B, "--seq-len", "8192", "--world-size", "8", "--device-gib", "80", "--chunked-loss",
               "--sequence-parallel", "8")
    assert sp["step_time_s_checkpointing"] < short["step_time_s"]
    assert 8192 / 8 / sp["step_time_s_checkpointing"] < short["tokens_per_s"]
    assert main(["plan", *args, "--seq-len", "8192"]) == 0
    assert "fastest at 8,192 tokens:" in capsys.readouterr().out
    # Past every combination's longest, nothing is named.
    assert _json(capsys, *args, "--seq-len", str(64 << 20))["fastest"] is None
