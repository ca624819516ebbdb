"""hsoffload.bench.gpu_peak on any machine: its predictions at Llama-3-8B width, and a clear skip without CUDA.
The measurement itself runs in the GPU suite (`make gpu-check`), where it writes both figures into bench.json."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hsoffload.bench import gpu_peak


def test_predictions_at_8b_width(tmp_path: Path) -> None:
    config = gpu_peak.write_config(tmp_path, layers=4)
    rows = {(m, s): gpu_peak.predict(config, s, m) for m in gpu_peak.METHODS for s in (4096, 8192, 16384)}
    for method in gpu_peak.METHODS:
        peaks = [rows[(method, s)]["predicted_peak"] for s in (4096, 8192, 16384)]
        assert peaks == sorted(peaks) and peaks[-1] < 80 * (1 << 30)
    # At 16k tokens the float32 loss dominates a 4-layer model.
    assert rows[("hidden_states", 16384)]["dominant_term"] == "logits"
    assert rows[("hidden_states", 16384)]["predicted_peak"] <= rows[("checkpointing", 16384)]["predicted_peak"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path is for machines without CUDA")
def test_run_without_cuda_is_skipped() -> None:
    result = gpu_peak.run()
    assert result["status"] == "skipped" and "CUDA" in result["reason"]
    assert gpu_peak.report(result)[0].startswith("planner vs max_memory_allocated: skipped")
