"""The `hsoffload` command: the demo runs on a CPU and proves bit-identity, the CPU benchmark suite
writes the JSON it promises. Nothing here asserts on a time."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hsoffload



def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # Exactly the package (and op library) this test process imported: installed by `make test`, or the
    # source tree with a local build.
    package_root = str(Path(hsoffload.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env["HSOFFLOAD_LIBRARY"] = str(hsoffload.load_library())
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a GPU machine
    return subprocess.run(
        [sys.executable, "-m", "hsoffload", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
def test_demo_on_cpu_writes_plot_and_reports_equal_losses(tmp_path: Path) -> None:
    png = tmp_path / "demo.png"
    out = tmp_path / "demo.json"
    proc = _run(["demo", "--steps", "2", "--seq", "128", "--plot", str(png), "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bit-identical with and without offload: yes" in proc.stdout
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(out.read_text())
    assert result["device"] == "cpu"
    assert result["all_equal"] is True
    layers = result["layers"]
    for step in result["steps"]:
        assert step["loss_equal"] and step["grads_equal"]
        assert step["loss_plain"] == step["loss_offload"]
        assert step["offloaded_tensors"] == layers  # it engaged: one hidden state per layer
        assert step["offloaded_bytes"] == result["expected_hidden_bytes"]
    # The instrumented step: offload removed exactly the hidden states from the device.
    assert result["saved_peak_plain"] - result["saved_peak_offload"] == result["expected_hidden_bytes"]
    assert result["host_peak_offload"] == result["expected_hidden_bytes"]


@pytest.mark.slow
def test_bench_cpu_quick_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    proc = _run(["bench", "--suite", "cpu", "--quick", "--no-progress", "--json", str(out), "--plot", str(png)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert set(data) >= {"environment", "cpu"}
    cpu = data["cpu"]
    assert set(cpu) >= {"suite", "quick", "environment", "pool", "hook_calls", "step"}
    assert cpu["quick"] is True
    pool = cpu["pool"]
    for key in ("held_over_offloaded", "peak_held_bytes", "peak_inflight_offloaded_bytes", "goal", "meets_goal"):
        assert key in pool
    assert pool["peak_inflight_offloaded_bytes"] > 0
    assert pool["peak_held_bytes"] >= pool["peak_inflight_offloaded_bytes"]  # the pool holds what is in flight
    assert pool["engine_peak_valid"] is True
    # Bytes, not times: held <= 1.05 x in flight and >= 95 % of packs after the first step without a new slab.
    assert pool["meets_goal"] is True, pool
    cases = {(r["case"], r["tensor_bytes"]) for r in cpu["hook_calls"]}
    assert ("passthrough", 4096) in cases and any(c == "marked" for c, _ in cases)
    for r in cpu["hook_calls"]:
        for key in ("hsoffload_pack_us", "hsoffload_unpack_us", "python_pack_us", "python_unpack_us"):
            assert r[key] > 0 and math.isfinite(r[key])
    step = cpu["step"]
    assert 0 < step["hook_share"]["hook_share"] < 1
    methods = {r["method"]: r for r in step["methods"]}
    assert methods["checkpointing"]["available"] and methods["hsoffload"]["available"]
    assert methods["hsoffload"]["counters"]["offloaded_tensors"] > 0
    # Each policy under its checkpointing setup: it moved bytes and the graph kept fewer on the device than the
    # same setup's baseline (TRL's rows are skipped on a CPU, with the reason).
    rows = {(r["setup"], r["method"]): r for r in cpu["policies"]["rows"]}
    for setup, ours, base in (("full", "hsoffload[hidden_states]", "checkpointing"), ("sac", "hsoffload[sac]", "sac"),
                              ("none", "hsoffload[all]", "no checkpointing")):
        assert rows[(setup, ours)]["moved_bytes"] > 0, rows[(setup, ours)]
        if setup != "sac":  # SAC's cache is not a saved tensor: the timeline cannot see what it keeps
            assert rows[(setup, ours)]["resident_peak_bytes"] < rows[(setup, base)]["resident_peak_bytes"]
    assert rows[("sac", "hsoffload[sac]")]["moved_bytes"] > 2 * rows[("full", "hsoffload[hidden_states]")]["moved_bytes"]
    # TRL's rows: skipped with the reason, which is the missing accelerator where trl imports, and trl itself where
    # it does not (the GPU image has no trl).
    try:
        import trl.models.activation_offloading  # noqa: F401
        expected = "accelerator"
    except Exception:
        expected = "trl not importable"
    for setup in ("full", "none"):
        row = rows[(setup, "trl OffloadActivations")]
        assert not row["available"] and expected in row["reason"], row
    assert png.is_file()


@pytest.mark.slow
def test_bench_gpu_suite_refuses_without_cuda(tmp_path: Path) -> None:
    proc = _run(["bench", "--suite", "gpu"], tmp_path)
    assert proc.returncode == 2
    assert "needs CUDA" in proc.stderr


@pytest.mark.parametrize("argv", [["bench", "--seqs", "8k,32k", "--layers", "2", "--suite", "cpu"], ["demo", "--steps", "1"]])
def test_cli_parses(argv: list[str]) -> None:
    from hsoffload.tools.cli import build_parser

    args = build_parser().parse_args(argv)
    if argv[0] == "bench":
        assert args.seqs == [8192, 32768]


@pytest.mark.parametrize(
    "argv, names",
    [
        (["demo", "--seq", "1"], "--seq"),
        (["demo", "--steps", "0"], "--steps"),
        (["demo", "--batch", "0"], "--batch"),
        (["demo", "--layers", "0"], "--layers"),
        (["demo", "--threads", "-1"], "--threads"),
        (["demo", "--device", "cuda:99"], "--device"),
        (["demo", "--device", "no-such-device"], "--device"),
        (["demo", "--plot", "/nonexistent/x.png"], "--plot"),
        (["demo", "--json", "/nonexistent/x.json"], "--json"),
        (["bench", "--steps", "0"], "--steps"),
        (["bench", "--warmup", "-1"], "--warmup"),
        (["bench", "--seqs", "1,8k"], "--seqs"),
        (["bench", "--budget-gib", "0"], "--budget-gib"),
        (["bench", "--json", "/nonexistent/b.json"], "--json"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(argv: list[str], names: str, capsys, tmp_path: Path) -> None:
    from hsoffload.tools import cli

    os.chdir(tmp_path)  # a default --plot must not land in the checkout
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and names in err[0] and err[0].startswith(f"hsoffload {argv[0]}: error:"), err


def test_plot_into_a_directory_is_refused(tmp_path: Path, capsys) -> None:
    from hsoffload.tools import cli

    assert cli.main(["demo", "--plot", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_disk_quick_reports_spill_next_to_the_file_system(tmp_path: Path) -> None:
    out = tmp_path / "disk.json"
    proc = _run(["bench", "--suite", "disk", "--quick", "--spill-dir", str(tmp_path), "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    disk = json.loads(out.read_text())["disk"]
    for side in ("fs", "spill"):
        assert disk[side]["write_gbps"] > 0 and disk[side]["read_gbps"] > 0
    assert 0.0 <= disk["hidden_fraction"] <= 1.0
    assert "spill / file system" in proc.stdout and "hidden behind compute" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["disk.json"]  # nothing left in the spill directory


@pytest.mark.slow
def test_plan_and_bench_arguments_are_checked(tmp_path: Path) -> None:
    proc = _run(["bench", "--suite", "disk", "--spill-dir", str(tmp_path / "nope")], tmp_path)
    assert proc.returncode == 2 and "--spill-dir" in proc.stderr
    proc = _run(["plan", str(tmp_path), "--seq-len", "-3"], tmp_path)
    assert proc.returncode == 2 and "--seq-len" in proc.stderr


@pytest.mark.slow
def test_demo_does_not_import_the_benchmark_package(tmp_path: Path) -> None:
    code = "import sys, hsoffload.tools.demo; print(sorted(m for m in sys.modules if m.startswith('hsoffload.tools.bench')))"
    env = dict(os.environ, PYTHONPATH=str(Path(hsoffload.__file__).resolve().parent.parent),
               HSOFFLOAD_LIBRARY=str(hsoffload.load_library()))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
