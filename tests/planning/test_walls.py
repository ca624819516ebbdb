"""The kernels' walls (hsoffload.planning.walls): `--max-seq` stops below the first a setup meets and names it,
`--seq-len` past one is never "fits", a silently wrong kernel is the loudest verdict, and the offload warns at run time
when a marked hidden state is past the 32-bit index wall."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from hsoffload import plan
from hsoffload.planning import walls
from hsoffload.tools.cli import main

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B = str(REPO / "configs" / "llama-8b-shape.json")
ALST = [LLAMA_8B, "--device-gib", "79.6", "--attn", "flash", "--fused-kernels", "liger"]


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_alst_on_one_h100_stops_at_the_index_wall_and_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    """ALST trains 500,000 tokens on one H100 and fails at 555,000 (an illegal memory access): the plan stops in
    between, at the wall, and says which; without the tiled MLP the memory limit comes first."""
    r = _json(capsys, *ALST, "--max-seq", "--cpu-offload", "params")
    rows = {row["knobs"]: row for row in r["rows"]}
    full = rows["+ chunked loss + tiled MLP"]["hsoffload"]
    assert 500_000 <= full["seq_len"] < 524_288 and full["wall"]["name"] == "liger_rms_norm_int32"
    assert full["peak_bytes"] < 79.6 * (1 << 30) * 0.7  # memory was not the limit
    given = rows["as given"]["hsoffload"]
    assert given["wall"] is None and given["seq_len"] < full["seq_len"]  # memory first, named by its dominant term
    assert main(["plan", *ALST, "--max-seq", "--cpu-offload", "params"]) == 0
    assert "wall liger_rms_norm_int32: tokens x hidden per rank passes 2^31 elements at 524,288" in \
        capsys.readouterr().out


def test_alst_on_eight_h100_stops_within_15_percent_of_what_it_measured(capsys: pytest.CaptureFixture[str]) -> None:
    """ALST's 8-GPU runs stop at 475-485K tokens per rank (3.8M over 8): the plan's wall within 15 %."""
    r = _json(capsys, *ALST, "--max-seq", "--cpu-offload", "optimizer", "--world-size", "8",
              "--sequence-parallel", "8")
    longest = max(row["hsoffload"]["seq_len"] for row in r["rows"])
    assert abs(longest / 8 - 480_000) <= 0.15 * 480_000
    assert all(row["hsoffload"]["wall"]["name"] == "liger_rms_norm_int32" for row in r["rows"]
               if row["hsoffload"]["seq_len"] == longest)


def test_seq_len_past_a_wall_never_fits(capsys: pytest.CaptureFixture[str]) -> None:
    common = [*ALST, "--cpu-offload", "params", "--tiled-mlp", "128", "--host-ram-gib", "4096"]
    below = _json(capsys, *common, "--seq-len", "523264")
    past = _json(capsys, *common, "--seq-len", "524288")
    assert below["verdict"] == "fits" and below["walls"] == []
    assert past["verdict"] == "does not run" and past["device_peak_bytes"] < past["input"]["device_bytes"]
    assert {w["name"] for w in past["walls"]} == {"liger_rms_norm_int32", "flash_attention_2_int32"}
    assert all(w["first_seq_len"] == 524_288 and w["source"] for w in past["walls"])


@pytest.mark.parametrize("wall", walls.WALLS, ids=lambda w: w.name)
def test_every_wall_turns_the_verdict_at_its_first_length(wall: walls.Wall) -> None:
    """For each wall, a setup it applies to: one token below its first length the wall is not met, at it the
    verdict is the wall's (never "fits") however much memory there is."""
    shape = plan.model_shape(LLAMA_8B)
    knobs = [dict(attn=a, fused_kernels=f, attention_mask=m) for a in ("sdpa", "flash") for f in ("none", "liger")
             for m in (False, True)]
    kw = next(k for k in knobs if wall.applies(plan.setup_of(plan.PlanInput(config=LLAMA_8B, seq_len=1, **k), shape)))
    first = walls._first_seq_len(wall, shape, plan.setup_of(plan.PlanInput(config=LLAMA_8B, seq_len=1, **kw), shape))
    roomy = dict(device_bytes=1 << 62, host_ram_bytes=1 << 62, torch_version="2.14.1", **kw)
    at = plan.plan(plan.PlanInput(config=LLAMA_8B, seq_len=first, **roomy))
    assert at.verdict == wall.consequence and wall.name in {h.name for h in at.walls}
    before = plan.plan(plan.PlanInput(config=LLAMA_8B, seq_len=first - 1, **roomy))
    assert wall.name not in {h.name for h in before.walls}
    assert wall.source and wall.fix and wall.consequence in (walls.CRASH, walls.SILENT)
    # The first lengths docs/usage.md's table gives for Llama-3-8B on one rank (not from the code under test).
    assert first == {"liger_rms_norm_int32": 524_288, "flash_attention_2_int32": 524_288,
                     "sdpa_mem_efficient_masked_uint32": 65_537, "arange_uint32": 4_294_967_297}[wall.name]


def test_sdpa_with_a_mask_past_65536_tokens_is_silently_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    base = [LLAMA_8B, "--device-gib", "4096", "--host-ram-gib", "4096", "--world-size", "8", "--sequence-parallel",
            "8"]
    assert _json(capsys, *base, "--seq-len", "65536", "--attention-mask")["walls"] == []
    wrong = _json(capsys, *base, "--seq-len", "65544", "--attention-mask")
    assert wrong["verdict"] == "silently wrong" and wrong["walls"][0]["name"] == "sdpa_mem_efficient_masked_uint32"
    assert _json(capsys, *base, "--seq-len", "65544")["walls"] == []  # padding-free: SDPA's causal path
    assert main(["plan", *base, "--seq-len", "65544", "--attention-mask"]) == 0
    assert "verdict: SILENTLY WRONG" in capsys.readouterr().out


def test_a_released_fix_lifts_a_wall(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch wall reads the planned torch (--torch); a kernel library's reads that library's installed version."""
    fixed = tuple(dataclasses.replace(w, fixed_in="4.10.0") if w.name == "arange_uint32" else
                  dataclasses.replace(w, fixed_in="2.8.3") if w.name == "flash_attention_2_int32" else w
                  for w in walls.WALLS)
    monkeypatch.setattr(walls, "WALLS", fixed)
    inp = plan.PlanInput(config=LLAMA_8B, seq_len=1 << 32 | 1, device_bytes=1 << 62, host_ram_bytes=1 << 62)
    assert plan.plan(dataclasses.replace(inp, torch_version="4.9.1")).verdict == "silently wrong"
    assert plan.plan(dataclasses.replace(inp, torch_version="4.10.0+cu130")).walls == []
    flash = plan.PlanInput(config=LLAMA_8B, seq_len=524_288, attn="flash", device_bytes=1 << 62,
                           host_ram_bytes=1 << 62, torch_version="9.9")  # --torch does not lift flash-attn's wall
    monkeypatch.setattr(walls, "installed_version", lambda package: None)
    assert plan.plan(flash).verdict == "does not run"
    monkeypatch.setattr(walls, "installed_version", lambda package: "2.8.3" if package == "flash-attn" else None)
    assert plan.plan(flash).verdict == "fits"


def test_the_offload_warns_once_at_the_index_wall(caplog: pytest.LogCaptureFixture) -> None:
    """A marked hidden state of 2^31 elements: one warning, in the planner's words (an expanded tensor: no bytes)."""
    from hsoffload._logging import forget_logged
    from hsoffload.offload import patch as hpatch

    forget_logged()
    layer = torch.nn.Linear(4, 4)
    small = torch.zeros(1, 1024, 4096)
    huge = torch.zeros(1, 1, 4096).expand(1, 524_288, 4096)
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        hpatch._pass_hidden_states_first(layer, (small,), {}, True)
        assert not caplog.records
        for _ in range(2):
            hpatch._pass_hidden_states_first(layer, (huge,), {}, True)
    assert len(caplog.records) == 1
    assert "tokens x hidden per rank passes 2^31 elements" in caplog.records[0].getMessage()


def test_every_marking_path_goes_through_the_wall_check() -> None:
    """The patch marks a layer's hidden_states in one place (both the call path and transformers >= 5.23's
    at-checkpoint path use it), so the run-time warning cannot miss a path."""
    source = (REPO / "python_shim/hsoffload/offload/patch.py").read_text()
    assert source.count("_engine.mark_hidden_state(") == 1  # the op, through the door (hsoffload.engine)
    assert source.count("_mark_hidden_state(layer, ") >= 2
