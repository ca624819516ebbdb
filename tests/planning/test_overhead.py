"""What the process holds beyond its tensors (hsoffload.planning.overhead): named terms by the collectives in use,
each overridable; the verdict and --max-seq compare what the process reserves with the device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hsoffload import plan
from hsoffload.planning import overhead
from hsoffload.tools.cli import main

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B = str(REPO / "configs" / "llama-8b-shape.json")
QWEN3_4B = str(REPO / "configs" / "qwen3-4b-shape.json")
GIB = 1 << 30


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_terms_follow_the_collectives_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    one = _json(capsys, LLAMA_8B, "--seq-len", "8192", "--device-gib", "80")["overhead"]
    assert set(one) == {"cuda_context", "cublas_workspaces", "fragmentation"}
    fsdp = _json(capsys, LLAMA_8B, "--seq-len", "8192", "--world-size", "8", "--device-gib", "80")["overhead"]
    assert fsdp["nccl_data_parallel"] == overhead.NCCL_COMMUNICATOR and "nccl_sequence_parallel" not in fsdp
    ddp = _json(capsys, LLAMA_8B, "--seq-len", "8192", "--world-size", "8", "--no-fsdp")["overhead"]
    assert ddp["nccl_data_parallel"] == overhead.NCCL_COMMUNICATOR  # DDP's all-reduce needs one too
    ulysses = _json(capsys, LLAMA_8B, "--seq-len", "65536", "--world-size", "8", "--sequence-parallel", "8")["overhead"]
    assert ulysses["nccl_sequence_parallel"] == overhead.NCCL_ALL_TO_ALL
    ring = _json(capsys, LLAMA_8B, "--seq-len", "65536", "--world-size", "8", "--sequence-parallel", "8",
                 "--sequence-parallel-kind", "ring")["overhead"]
    assert ring["nccl_sequence_parallel"] == overhead.NCCL_COMMUNICATOR


def test_reserved_is_the_peak_plus_the_terms_and_decides_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    p = _json(capsys, LLAMA_8B, "--seq-len", "65536", "--world-size", "8", "--sequence-parallel", "8",
              "--device-gib", "80", "--host-ram-gib", "2048")
    assert p["device_reserved_bytes"] == p["device_peak_bytes"] + sum(p["overhead"].values())
    assert p["overhead"]["fragmentation"] == int(p["device_peak_bytes"] * 0.05)
    # A device between the tensors' peak and what the process reserves: the tensors fit, the process does not.
    between = (p["device_peak_bytes"] + p["device_reserved_bytes"]) / 2 / GIB
    tight = _json(capsys, LLAMA_8B, "--seq-len", "65536", "--world-size", "8", "--sequence-parallel", "8",
                  "--device-gib", f"{between:.4f}", "--host-ram-gib", "2048")
    assert tight["device_peak_bytes"] < tight["input"]["device_bytes"] < tight["device_reserved_bytes"]
    assert tight["verdict"] == "does not fit"


def test_overhead_and_fragmentation_are_overridable(capsys: pytest.CaptureFixture[str]) -> None:
    given = _json(capsys, LLAMA_8B, "--seq-len", "8192", "--world-size", "8", "--overhead-gib", "3",
                  "--fragmentation", "0.1")["overhead"]
    assert given["overhead_given"] == 3 * GIB and set(given) == {"overhead_given", "fragmentation"}
    none = _json(capsys, LLAMA_8B, "--seq-len", "8192", "--world-size", "8", "--overhead-gib", "0",
                 "--fragmentation", "0")
    assert none["device_reserved_bytes"] == none["device_peak_bytes"]
    assert main(["plan", LLAMA_8B, "--seq-len", "8192", "--fragmentation", "1.5"]) == 2
    assert "--fragmentation must be in [0, 1)" in capsys.readouterr().err


def test_without_overhead_max_seq_is_the_tensors_only_limit() -> None:
    """--overhead-gib 0 --fragmentation 0 gives back the tensors-only search (docs/benchmarks.md, row 7: 29,696)."""
    inp = plan.PlanInput(config=QWEN3_4B, seq_len=1, device_bytes=int(79.6 * GIB), optimizer="adamw_param_dtype")
    bare = plan.max_seq(plan.PlanInput(**{**inp.__dict__, "overhead_bytes": 0, "fragmentation": 0.0}))
    full = plan.max_seq(inp)
    assert bare.rows[0].checkpointing.seq_len == 29_696
    assert full.rows[0].checkpointing.seq_len < bare.rows[0].checkpointing.seq_len
    assert full.rows[0].checkpointing.reserved_bytes <= 79.6 * GIB


def test_zero3_buckets_from_a_deepspeed_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hidden = 4096
    (tmp_path / "auto.json").write_text(json.dumps({"zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}}))
    (tmp_path / "zero2.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert overhead.zero3_bucket_elements(str(REPO / "configs/deepspeed-zero3-defaults.json"), hidden) == 550_000_000
    assert overhead.zero3_bucket_elements(str(tmp_path / "auto.json"), hidden) == hidden * hidden + int(
        0.9 * hidden * hidden)
    assert overhead.zero3_bucket_elements(str(tmp_path / "zero2.json"), hidden) == 0
    p = _json(capsys, LLAMA_8B, "--seq-len", "8192", "--world-size", "8", "--deepspeed-config",
              str(tmp_path / "auto.json"))
    assert p["overhead"]["zero3_buckets"] == (hidden * hidden + int(0.9 * hidden * hidden)) * 2
    (tmp_path / "bad.json").write_text("{")
    assert main(["plan", LLAMA_8B, "--seq-len", "8192", "--deepspeed-config", str(tmp_path / "bad.json")]) == 2
    assert "--deepspeed-config" in capsys.readouterr().err
