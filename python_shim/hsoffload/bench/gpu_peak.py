"""GPU check of `hsoffload plan`'s device-peak model at Llama-3-8B width: one real training step (forward, backward,
AdamW step) of `LlamaForCausalLM` with 8B layer dimensions, bf16, SDPA, at a few lengths, with checkpointing alone
and with hidden-state offload; `torch.cuda.max_memory_allocated()` (reset before the measured step, minus what was
allocated before the model was built) against the planner's prediction from the same config and settings.

The measured step is the second (steady state: AdamW's moments exist, gradients were freed by
``zero_grad(set_to_none=True)``); torch's AdamW keeps bf16 moments for bf16 parameters, which the planner is told
(`optimizer="adamw_param_dtype"`). The emulated-device test (tests/device/emu/test_device_peak.py) does the same on tiny
models in CI; this is the check at real width, where flash attention and the loss dominate.

Entry point for the GPU suite: ``run(device, deadline=...)`` -> a JSON-able dict (``rows``, ``worst_error``);
``report(result)`` -> text lines. Imports on a CPU-only machine; `run` needs CUDA.
"""

from __future__ import annotations

import gc
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from .. import plan

logger = logging.getLogger("hsoffload")

# Llama-3-8B's layer and vocabulary dimensions (configs/llama-8b-shape.json), with fewer layers to fit any GPU.
LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "max_position_embeddings": 131072,
}
METHODS = ("checkpointing", "hidden_states")
_STEP_BUDGET_S = 60.0  # a measurement is started only with this much time left before the deadline


def write_config(folder: Path, layers: int) -> Path:
    """A config.json of Llama-3-8B's dimensions with `layers` decoder layers."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({**LLAMA3_8B, "num_hidden_layers": layers}))
    return path


def predict(config: Path, seq: int, method: str, device_bytes: Optional[int] = None) -> dict[str, Any]:
    """The planner's figures for one step of `method` at `seq` tokens (bf16, SDPA, one rank, torch's AdamW)."""
    p = plan.plan(plan.PlanInput(
        config=str(config), seq_len=seq, dtype="bfloat16", attn="sdpa", optimizer="adamw_param_dtype",
        policy="hidden_states", host_ram_bytes=1 << 40, device_bytes=device_bytes or (1 << 40),
    ))
    key = "device_peak_bytes" if method == "hidden_states" else "device_peak_bytes_checkpointing"
    return {"predicted_peak": p[key], "peak_phase": p["peak_phase"], "dominant_term": p["dominant_term"]}


def _measure(config: Path, seq: int, method: str, device: torch.device) -> int:
    """Peak allocated bytes of the second training step, above what was allocated before the model existed."""
    import transformers

    import hsoffload

    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    data = json.loads(config.read_text())
    cfg = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    try:
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = torch.randint(3, cfg.vocab_size, (1, seq), device=device)
        peak = 0
        for _ in range(2):
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            if method == "hidden_states":
                with hsoffload.offload_hidden_states(model):
                    model(input_ids=ids, labels=ids).loss.backward()
            else:
                model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - before
        return peak
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()


def run(
    device: Optional[torch.device] = None,
    layers: int = 4,
    seqs: Sequence[int] = (4096, 8192, 16384),
    methods: Sequence[str] = METHODS,
    deadline: Optional[float] = None,
) -> dict[str, Any]:
    """Measured against predicted peaks; rows cheapest first, stopping at `deadline` (time.monotonic()) or an OOM."""
    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "no CUDA device (torch.cuda.is_available() is False)"}
    device = device or torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(Path(tmp), layers)
        for seq in sorted(seqs):
            for method in methods:
                row: dict[str, Any] = {"method": method, "seq": seq, **predict(config, seq, method, total)}
                if deadline is not None and time.monotonic() + _STEP_BUDGET_S > deadline:
                    row["status"] = "skipped: time limit"
                elif row["predicted_peak"] > 0.9 * total:
                    row["status"] = "skipped: predicted not to fit"
                else:
                    try:
                        row["measured_peak"] = _measure(config, seq, method, device)
                        row["error"] = (row["predicted_peak"] - row["measured_peak"]) / row["measured_peak"]
                        row["status"] = "ok"
                    except torch.OutOfMemoryError as exc:
                        row.update(status="oom", detail=str(exc)[:200])
                    except Exception as exc:  # noqa: BLE001  (recorded, the suite goes on)
                        logger.exception("hsoffload bench: planner check failed at seq %d (%s)", seq, method)
                        row.update(status="error", detail=f"{type(exc).__name__}: {str(exc)[:300]}")
                rows.append(row)
    measured = [r for r in rows if r["status"] == "ok"]
    worst = max(measured, key=lambda r: abs(r["error"])) if measured else None
    return {
        "status": "ok" if measured else "no measurement",
        "model": f"LlamaForCausalLM, Llama-3-8B dimensions, {layers} layers, bf16, SDPA, AdamW, batch 1",
        "device": torch.cuda.get_device_name(device),
        "device_bytes": total,
        "rows": rows,
        "worst_error": worst["error"] if worst else None,
        "worst": {"method": worst["method"], "seq": worst["seq"]} if worst else None,
    }


def report(result: dict[str, Any]) -> list[str]:
    """Text lines for the suite's summary."""
    if result.get("status") == "skipped":
        return [f"planner vs max_memory_allocated: skipped ({result['reason']})"]
    gib = float(1 << 30)
    lines = [f"planner vs max_memory_allocated ({result['model']}, {result['device']}):"]
    for r in result["rows"]:
        if r["status"] == "ok":
            lines.append(f"  {r['method']:<14}{r['seq']:>8}  measured {r['measured_peak'] / gib:7.2f} GiB  predicted "
                         f"{r['predicted_peak'] / gib:7.2f} GiB  {r['error']:+6.1%}  ({r['peak_phase']})")
        else:
            lines.append(f"  {r['method']:<14}{r['seq']:>8}  {r['status']} (predicted "
                         f"{r['predicted_peak'] / gib:.2f} GiB)")
    if result.get("worst_error") is not None:
        lines.append(f"  worst error {result['worst_error']:+.1%}")
    return lines
