"""hsoffload.tools.bench.gpu_peak on any machine: its predictions at Llama-3-8B and Qwen3-30B-A3B width, its report, and a
clear skip without CUDA.
The measurement itself runs in the GPU suite (`make gpu-check`), where it writes both figures into bench.json."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hsoffload.tools.bench import gpu_peak


def test_predictions_at_8b_width(tmp_path: Path) -> None:
    config = gpu_peak.write_config(tmp_path, layers=4)
    rows = {(m, s): gpu_peak.predict(config, s, m) for m in gpu_peak.METHODS for s in (4096, 8192, 16384)}
    for method in gpu_peak.METHODS:
        peaks = [rows[(method, s)]["predicted_peak"] for s in (4096, 8192, 16384)]
        assert peaks == sorted(peaks) and peaks[-1] < 80 * (1 << 30)
    # At 16k tokens the float32 loss dominates a 4-layer model.
    assert rows[("hidden_states", 16384)]["dominant_term"] == "logits"
    assert rows[("hidden_states", 16384)]["predicted_peak"] <= rows[("checkpointing", 16384)]["predicted_peak"]


def test_moe_predictions_at_30b_a3b_width(tmp_path: Path) -> None:
    shape, layers, seqs = gpu_peak.MODELS["qwen3-30b-a3b"]
    config = gpu_peak.write_config(tmp_path, layers, shape)
    for experts in ("grouped_mm", "eager"):
        peaks = [gpu_peak.predict(config, s, "hidden_states", experts_implementation=experts) for s in seqs]
        assert all(p["experts_implementation"] == experts for p in peaks)
        assert [p["predicted_peak"] for p in peaks] == sorted(p["predicted_peak"] for p in peaks)


def test_report_names_each_model_and_its_experts() -> None:
    gib = 1 << 30
    result = {"status": "ok", "model": "m", "device": "d", "worst_error": 0.05, "rows": [
        {"model": "llama-3-8b", "method": "checkpointing", "seq": 4096, "status": "ok", "measured_peak": 10 * gib,
         "predicted_peak": 10.5 * gib, "error": 0.05, "peak_phase": "head backward", "experts_implementation": None},
        {"model": "qwen3-30b-a3b", "method": "hidden_states", "seq": 16384, "status": "skipped: time limit",
         "predicted_peak": 30 * gib, "experts_implementation": "grouped_mm"},
    ]}
    lines = gpu_peak.report(result)
    assert "llama-3-8b" in lines[1] and "+5.0%" in lines[1]
    assert "qwen3-30b-a3b (grouped_mm)" in lines[2] and "skipped: time limit" in lines[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path is for machines without CUDA")
def test_run_without_cuda_is_skipped() -> None:
    result = gpu_peak.run()
    assert result["status"] == "skipped" and "CUDA" in result["reason"]
    assert gpu_peak.report(result)[0].startswith("planner vs max_memory_allocated: skipped")
