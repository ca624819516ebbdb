"""The step-time model (hsoffload.planning.timing): every plan and --max-seq row carries a predicted step, its parts
add up, copies that compute hides cost only the pipeline's fill, and copies slower than compute show in full."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
    # Hidden copies cost the pipeline's fill only: one copy each way.
    assert p["step_parts"]["exposed_d2h"] == pytest.approx(p["transfer_s_per_layer"])
    assert 0 < p["step_overhead"] < 0.01
    assert main(["plan", *BASE]) == 0
    assert "against checkpointing only" in capsys.readouterr().out


def test_copies_slower_than_compute_show_in_full(capsys: pytest.CaptureFixture[str]) -> None:
    overheads = [_json(capsys, *BASE, "--bandwidth", str(gbps))["step_overhead"] for gbps in (50, 2, 0.5, 0.1)]
    assert overheads == sorted(overheads) and overheads[-1] > 0.3
    slow = _json(capsys, *BASE, "--bandwidth", "0.1")
    layers, copy = 32, slow["transfer_s_per_layer"]
    assert slow["step_parts"]["exposed_d2h"] == pytest.approx(layers * copy - layers * slow["forward_s_per_layer"]
                                                              + slow["forward_s_per_layer"])


def test_pipeline_fill_and_throughput() -> None:
    assert timing._pipeline(10, compute=2.0, copy=1.0) == pytest.approx(1.0)  # hidden: the last copy's fill
    assert timing._pipeline(10, compute=1.0, copy=3.0) == pytest.approx(10 * 3 + 1 - 10)  # copy-bound
    assert timing._pipeline(0, compute=1.0, copy=3.0) == 0.0


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
    assert r.device_profile == "h100-sxm"
