"""Offload policies side by side: for each checkpointing setup, the baseline without offload, hsoffload's policy for
that setup, and the peers a user of that setup would pick (TRL's `OffloadActivations`, `save_on_cpu`).

Setups: full checkpointing (policy "hidden_states"), selective checkpointing that keeps matmul outputs (policy "sac"),
no checkpointing (policy "all"). Per row: median step time, its ratio to the same setup's baseline, the bytes the
method moved off the device per step, and the peak of saved-activation bytes the autograd graph keeps on the device
(measured by `SavedBytesTimeline` around the method's hooks; on a GPU also the allocator's peak). Rounds are
interleaved so drift on a shared machine hits every method alike.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import time
import weakref
from typing import Any, Callable, Optional

import torch

from .. import workloads as common
from ..workloads import Progress, median, tiny_llama
from ...targets import disable_checkpointing, enable_checkpointing

logger = logging.getLogger("hsoffload")

SAC_OPS = ("mm.default", "bmm.default", "addmm.default")


def _sac_context_fn() -> Callable[[], Any]:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = {getattr(torch.ops.aten, name.split(".")[0]).default for name in SAC_OPS}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def _checkpointing(model: torch.nn.Module, setup: str) -> None:
    disable_checkpointing(model)
    if setup == "full":
        enable_checkpointing(model, {"use_reentrant": False})
    elif setup == "sac":
        enable_checkpointing(model, {"use_reentrant": False, "context_fn": _sac_context_fn()})


class _Row:
    """One method under one checkpointing setup: `context(model)` is entered around each step."""

    def __init__(self, setup: str, name: str, context: Callable[[torch.nn.Module], Any], note: str = "") -> None:
        self.setup, self.name, self.context, self.note = setup, name, context, note
        self.times: list[float] = []
        self.moved: list[int] = []
        self.resident: list[int] = []
        self.device_peak: list[int] = []
        self.error: Optional[str] = None


def _hsoffload(policy: str, cpu: bool) -> Callable[[torch.nn.Module], Any]:
    def make(model: torch.nn.Module) -> Any:
        import hsoffload

        return hsoffload.offload_hidden_states(model, policy=policy, offload_cpu_tensors=cpu)

    return make


def _save_on_cpu(cpu: bool) -> Callable[[torch.nn.Module], Any]:
    def make(model: torch.nn.Module) -> Any:
        return torch.autograd.graph.save_on_cpu(pin_memory=not cpu)

    return make


def _trl_available() -> tuple[bool, str]:
    try:
        importlib.import_module("trl.models.activation_offloading")
    except Exception as exc:  # not installed, or its import failed
        return False, f"trl not importable ({type(exc).__name__})"
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return False, "OffloadActivations needs an accelerator (it reads torch.accelerator.current_accelerator())"
    return True, ""


# One TRL context per model (get_act_offloading_ctx_manager adds hooks to the output head); the bench runs on one
# thread.
_trl_contexts: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()


def _trl(model: torch.nn.Module) -> Any:
    if model not in _trl_contexts:
        mod = importlib.import_module("trl.models.activation_offloading")
        _trl_contexts[model] = mod.get_act_offloading_ctx_manager(model, use_pin_memory=True, use_streams=True)
    return _trl_contexts[model]


_SAVE_ON_CPU_NOTE = {
    False: "every saved tensor, parameters included",
    True: "every saved tensor; on a CPU its copies are no-ops (tensor.cpu() returns the tensor): time not comparable",
}


def _rows(cpu: bool) -> list[_Row]:
    rows = [
        _Row("full", "checkpointing", lambda m: contextlib.nullcontext(), "baseline"),
        _Row("full", "hsoffload[hidden_states]", _hsoffload("hidden_states", cpu)),
        _Row("full", "save_on_cpu", _save_on_cpu(cpu), _SAVE_ON_CPU_NOTE[cpu]),
        _Row("sac", "sac", lambda m: contextlib.nullcontext(), "baseline: " + ", ".join(SAC_OPS) + " kept"),
        _Row("sac", "hsoffload[sac]", _hsoffload("sac", cpu)),
        _Row("none", "no checkpointing", lambda m: contextlib.nullcontext(), "baseline"),
        _Row("none", "hsoffload[all]", _hsoffload("all", cpu)),
        _Row("none", "save_on_cpu", _save_on_cpu(cpu), _SAVE_ON_CPU_NOTE[cpu]),
    ]
    ok, why = _trl_available()
    trl_rows = [_Row("full", "trl OffloadActivations", _trl), _Row("none", "trl OffloadActivations", _trl)]
    for r in trl_rows:
        if not ok:
            r.error = "skipped: " + why
    rows[3:3] = trl_rows[:1]
    rows.append(trl_rows[1])
    return rows


def _step(row: _Row, model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> None:
    import hsoffload

    ctx = row.context(model)
    scope = ctx if isinstance(ctx, hsoffload.OffloadScope) else None
    moves_everything = isinstance(ctx, torch.autograd.graph.save_on_cpu)
    # The timeline calls the method's hooks itself; TRL's keep per-step state of their own: entered as they are,
    # TRL's rows report the allocator's peak only (GPU).
    measurable = scope is not None or moves_everything or isinstance(ctx, contextlib.nullcontext)
    inner = ctx if scope is not None or moves_everything else None
    timeline = common.SavedBytesTimeline(inner, scope=scope, model=model, record=False) if measurable else ctx
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    common.synchronize(device)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if scope is not None:
            stack.enter_context(ctx)  # entered for its layer tracking; the timeline calls its hooks
        common.train_step(model, batch, timeline)
    common.synchronize(device)
    row.times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    if scope is not None:
        row.moved.append(scope.stats.offloaded_bytes)
    elif moves_everything:
        row.moved.append(timeline.peak_device_bytes)
    if measurable:
        row.resident.append(0 if moves_everything else timeline.peak_device_bytes)
    if device.type == "cuda":
        row.device_peak.append(torch.cuda.max_memory_allocated(device) - base)


def run(quick: bool, progress: Progress, device: Optional[torch.device] = None, seq: Optional[int] = None) -> dict[str, Any]:
    device = device or torch.device("cpu")
    seq = seq or (256 if quick else 512)
    cpu = device.type == "cpu"
    # Positions cover `seq` (the GPU suite asks for 8192, beyond the tiny shape's 4096); SDPA as the GPU suite's
    # model uses (eager attention's memory is quadratic in the length; these rows compare no bits).
    shape = tiny_llama(layers=4, max_positions=max(4096, seq))
    model = common.build_model(shape, seed=0, device=device, attn_implementation="sdpa")
    batch = common.make_batch(shape, 2, seq, seed=0, device=device)
    warmup, steps = (1, 2) if quick else (2, 7)
    rows = _rows(cpu)
    for r in range(warmup + steps):
        for row in rows:
            if row.error is not None and not row.times:
                continue
            _checkpointing(model, row.setup)
            try:
                _step(row, model, batch, device)
            except Exception as exc:  # report the method's failure, keep measuring the others
                logger.warning("hsoffload bench: %s (%s) failed: %s", row.name, row.setup, exc)
                row.error = f"{type(exc).__name__}: {exc}"
                continue
            if r < warmup:
                row.times.clear()
                row.moved.clear()
                row.resident.clear()
                row.device_peak.clear()
            progress.update(f"policies {row.name}")
    import hsoffload

    hsoffload.unpatch()
    disable_checkpointing(model)
    out = []
    base = {r.setup: median(r.times) for r in rows if r.note.startswith("baseline") and r.times}
    for row in rows:
        if row.error is not None:
            out.append({"setup": row.setup, "method": row.name, "available": False, "reason": row.error})
            continue
        med = median(row.times)
        out.append(
            {
                "setup": row.setup,
                "method": row.name,
                "available": True,
                "step_ms": med * 1e3,
                "vs_baseline": med / base[row.setup] if row.setup in base else float("nan"),
                "moved_bytes": int(median(row.moved)) if row.moved else 0,
                "resident_peak_bytes": int(median(row.resident)) if row.resident else None,
                "device_peak_bytes": int(median(row.device_peak)) if row.device_peak else None,
                "note": row.note,
            }
        )
    return {"model": "tiny Llama, 4 layers, hidden 256, vocab 1024", "batch": 2, "seq": seq, "device": str(device), "rows": out}


def report(result: dict[str, Any]) -> str:
    fb, ff = common.fmt_bytes, common.fmt_float
    rows = []
    for r in result["rows"]:
        if not r["available"]:
            rows.append([r["setup"], r["method"], "-", "-", "-", "-", r["reason"]])
            continue
        peak = r["resident_peak_bytes"]
        peak_s = fb(peak) if peak is not None else "-"
        if r.get("device_peak_bytes") is not None:
            peak_s += f" (alloc {fb(r['device_peak_bytes'])})"
        rows.append(
            [r["setup"], r["method"], ff(r["step_ms"]), ff(r["vs_baseline"]), fb(r["moved_bytes"]), peak_s, r["note"]]
        )
    return common.table(
        ["ckpt", "method", "step ms", "x baseline", "moved/step", "saved on device (peak)", "note"],
        rows,
        f"Offload policies side by side ({result['model']}, batch {result['batch']}, seq {result['seq']}, "
        f"{result['device']}; saved on device = saved-tensor bytes the graph holds on the device at its peak, "
        "SAC's cache not included)",
    )
