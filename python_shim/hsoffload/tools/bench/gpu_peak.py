"""GPU check of `hsoffload plan`'s device-peak model at real widths: one real training step (forward, backward,
AdamW step) of `LlamaForCausalLM` with Llama-3-8B's layer dimensions (4 layers) and of `Qwen3MoeForCausalLM` with
Qwen3-30B-A3B's (2 MoE layers, the experts as transformers runs them by default: grouped_mm), bf16, SDPA, at a few
lengths, with checkpointing alone and with hidden-state offload; `torch.cuda.max_memory_allocated()` (reset before
the measured step, minus what was allocated before the model was built) against the planner's prediction from the
same config and settings.

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

from ...planning import plan
from ...targets import enable_checkpointing

logger = logging.getLogger("hsoffload")

# Llama-3-8B's layer and vocabulary dimensions (configs/llama-8b-shape.json), with fewer layers to fit any GPU.
LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "max_position_embeddings": 131072,
}
# Qwen3-30B-A3B's dimensions (configs/qwen3-30b-a3b-shape.json): 128 experts, 8 per token.
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "norm_topk_prob": True, "vocab_size": 151936, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "max_position_embeddings": 131072,
}
# name -> (config fields, decoder layers, lengths); measured in this order, cheapest length first within each.
MODELS: dict[str, tuple[dict[str, Any], int, tuple[int, ...]]] = {
    "llama-3-8b": (LLAMA3_8B, 4, (4096, 8192, 16384)),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, 2, (4096, 16384)),
}
METHODS = ("checkpointing", "hidden_states")
_STEP_BUDGET_S = 60.0  # a measurement is started only with this much time left before the deadline


def write_config(folder: Path, layers: int, shape: Optional[dict[str, Any]] = None) -> Path:
    """A config.json of `shape`'s dimensions (default Llama-3-8B's) with `layers` decoder layers."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({**(shape or LLAMA3_8B), "num_hidden_layers": layers}))
    return path


def predict(config: Path, seq: int, method: str, device_bytes: Optional[int] = None,
            experts_implementation: Optional[str] = None) -> dict[str, Any]:
    """The planner's figures for one step of `method` at `seq` tokens (bf16, SDPA, one rank, torch's AdamW)."""
    p = plan.plan(plan.PlanInput(
        config=str(config), seq_len=seq, dtype="bfloat16", attn="sdpa", optimizer="adamw_param_dtype",
        policy="hidden_states", host_ram_bytes=1 << 40, device_bytes=device_bytes or (1 << 40),
        experts_implementation=experts_implementation,
    ))
    key = "device_peak_bytes" if method == "hidden_states" else "device_peak_bytes_checkpointing"
    return {"predicted_peak": getattr(p, key), "peak_phase": p.peak_phase, "dominant_term": p.dominant_term,
            "experts_implementation": p.input.experts_implementation}


def _measure(config: Path, seq: int, method: str, device: torch.device) -> tuple[int, Optional[str]]:
    """Peak allocated bytes of the second training step, above what was allocated before the model existed, and
    the experts implementation transformers chose (None for a dense model)."""
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
    experts = getattr(model.config, "_experts_implementation", None) if data.get("num_experts") else None
    try:
        model.train()
        enable_checkpointing(model, {"use_reentrant": False})
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
        return peak, experts
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()


def _row(name: str, config: Path, seq: int, method: str, device: torch.device, total: int,
         deadline: Optional[float]) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name, "method": method, "seq": seq, **predict(config, seq, method, total)}
    if deadline is not None and time.monotonic() + _STEP_BUDGET_S > deadline:
        row["status"] = "skipped: time limit"
    elif row["predicted_peak"] > 0.9 * total:
        row["status"] = "skipped: predicted not to fit"
    else:
        try:
            row["measured_peak"], experts = _measure(config, seq, method, device)
            if experts != row["experts_implementation"]:  # plan what transformers ran
                row.update(predict(config, seq, method, total, experts_implementation=experts))
            row["error"] = (row["predicted_peak"] - row["measured_peak"]) / row["measured_peak"]
            row["status"] = "ok"
        except torch.OutOfMemoryError as exc:
            row.update(status="oom", detail=str(exc)[:200])
        except Exception as exc:  # noqa: BLE001  (recorded, the suite goes on)
            logger.exception("hsoffload bench: planner check failed for %s at seq %d (%s)", name, seq, method)
            row.update(status="error", detail=f"{type(exc).__name__}: {str(exc)[:300]}")
    return row


def run(
    device: Optional[torch.device] = None,
    models: Sequence[str] = tuple(MODELS),
    methods: Sequence[str] = METHODS,
    deadline: Optional[float] = None,
) -> dict[str, Any]:
    """Measured against predicted peaks; per model of `models` (keys of MODELS, in order) rows cheapest first,
    stopping at `deadline` (time.monotonic()); an OOM or error is recorded in its row."""
    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "no CUDA device (torch.cuda.is_available() is False)"}
    device = device or torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            shape, layers, seqs = MODELS[name]
            config = write_config(Path(tmp) / name, layers, shape)
            for seq in sorted(seqs):
                for method in methods:
                    rows.append(_row(name, config, seq, method, device, total, deadline))
    measured = [r for r in rows if r["status"] == "ok"]
    worst = max(measured, key=lambda r: abs(r["error"])) if measured else None
    return {
        "status": "ok" if measured else "no measurement",
        "model": "; ".join(f"{name}: {MODELS[name][1]} layers" for name in models) + ", bf16, SDPA, AdamW, batch 1",
        "device": torch.cuda.get_device_name(device),
        "device_bytes": total,
        "rows": rows,
        "worst_error": worst["error"] if worst else None,
        "worst": {"model": worst["model"], "method": worst["method"], "seq": worst["seq"]} if worst else None,
    }


def report(result: dict[str, Any]) -> list[str]:
    """Text lines for the suite's summary."""
    if result.get("status") == "skipped":
        return [f"planner vs max_memory_allocated: skipped ({result['reason']})"]
    gib = float(1 << 30)
    lines = [f"planner vs max_memory_allocated ({result['model']}, {result['device']}):"]
    for r in result["rows"]:
        name = r.get("model", "llama-3-8b") + (f" ({r['experts_implementation']})"
                                               if r.get("experts_implementation") else "")
        if r["status"] == "ok":
            lines.append(f"  {name:<28}{r['method']:<14}{r['seq']:>8}  measured {r['measured_peak'] / gib:7.2f} GiB  "
                         f"predicted {r['predicted_peak'] / gib:7.2f} GiB  {r['error']:+6.1%}  ({r['peak_phase']})")
        else:
            lines.append(f"  {name:<28}{r['method']:<14}{r['seq']:>8}  {r['status']} (predicted "
                         f"{r['predicted_peak'] / gib:.2f} GiB)")
    if result.get("worst_error") is not None:
        lines.append(f"  worst error {result['worst_error']:+.1%}")
    return lines
