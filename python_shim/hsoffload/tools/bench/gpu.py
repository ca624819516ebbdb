"""GPU suite: Llama-3-8B layer dimensions, bf16, batch 1, non-reentrant checkpointing; every method
side by side in one process on one model.

Per method and sequence length: median step time after warm-up, peak allocated and reserved device
memory, peak pinned host bytes in use and owned (the CUDA host allocator's `active_bytes.peak` and
`allocated_bytes.peak`; the latter includes its cache, which it rounds to powers of two). Then, per
method, one profiled step whose memcpy records give the achieved D2H/H2D bandwidth, compared with a
pinned-copy peak measured at the start on the same machine; and the longest sequence that fits a
fixed device-memory budget (predicted from the peaks at two lengths, where memory is linear in the
length with SDPA attention, then verified with one step under
`torch.cuda.set_per_process_memory_fraction`).

The model is head-less (`LlamaModel`; loss = mean square of the last hidden state): at 128k tokens
the LM head's fp32 logits alone would be 64 GiB, which is not what hidden-state offload is about.

Everything is ordered cheapest first and guarded by `--time-limit`: a measurement is started only
if its predicted duration (the step time at the longest shorter length already measured, scaled
quadratically with the length: an upper bound when step time is c + a*seq + b*seq^2) ends before
the limit. With `--json`, the results so far are rewritten after every measurement, so a run that
is killed from outside still leaves what it measured. This module imports on a CPU-only machine;
`run` needs CUDA.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import tempfile
import time
from typing import Any, Optional

import torch

from .. import workloads as common
from ...planning.memory import ModelShape
from ..workloads import Progress, hidden_state_bytes, llama3_8b, median
from .peers import Method, all_methods

logger = logging.getLogger("hsoffload")

GOALS = {
    "step_overhead_max": 0.005,  # vs plain checkpointing, at >= 32k tokens
    "freed_min": 0.99,  # of the theoretical hidden-state bytes
    "bandwidth_min": 0.90,  # of the measured pinned-copy peak
}


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _cleanup() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # Pinned blocks cached by the CUDA host allocator for the previous method would count in the
    # next method's `allocated_bytes` (owned) peak; give them back (completed blocks only).
    empty_host = getattr(torch._C, "_host_emptyCache", None)
    if empty_host is not None:
        try:
            empty_host()
        except Exception:
            logger.debug("hsoffload bench: emptying the pinned host cache failed", exc_info=True)


# What the CLI's --trace step (one profiled step of 8B-wide layers, its export and plot) is given of --time-limit.
TRACE_RESERVE_S = 45.0

# Setup, warm allocation and teardown around the timed steps of one measurement (generous).
_OVERHEAD_S = 8.0


def _predict_step_s(rows: list[dict[str, Any]], method: str, seq: int) -> Optional[float]:
    """Step time at `seq`, scaled quadratically from the longest length up to `seq` measured (this
    method's rows, else the slowest method's). None when nothing that short was measured."""
    done = [r for r in rows if r.get("status") == "ok" and r.get("step_s") and r["seq"] <= seq]
    own = [r for r in done if r["method"] == method]
    pool = own or done
    if not pool:
        return None
    longest = max(r["seq"] for r in pool)
    step = max(r["step_s"] for r in pool if r["seq"] == longest)
    return step * (seq / longest) ** 2


def _time_left_for(predicted_s: Optional[float], deadline: float) -> bool:
    return predicted_s is None or time.monotonic() + predicted_s <= deadline


def _skip_reason(predicted_s: float, deadline: float) -> str:
    return f"skipped: time limit (predicted {predicted_s:.0f} s, {max(0.0, deadline - time.monotonic()):.0f} s left)"


def _host_stats() -> dict[str, Any]:
    try:
        return dict(torch.cuda.host_memory_stats())
    except Exception:  # older torch or no CUDA context yet
        return {}


def _reset_host_peak() -> None:
    reset = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
    if reset is not None:
        try:
            reset()
        except Exception:
            logger.debug("hsoffload bench: reset_peak_host_memory_stats failed", exc_info=True)


def _host_peak(key: str) -> Optional[int]:
    """`active_bytes.peak` (pinned blocks handed out: in use, including what the hsoffload pool keeps)
    or `allocated_bytes.peak` (pinned blocks the CUDA host allocator owns, its cache included)."""
    value = _host_stats().get(key)
    return int(value) if value is not None else None


# ---------------------------------------------------------------------------
# Pinned-copy peak


def pinned_copy_peak(device: torch.device, nbytes: int = 1 << 30, reps: int = 5) -> dict[str, float]:
    """Best-of-`reps` GB/s of one large pinned<->device copy each way, on a side stream."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    out: dict[str, float] = {"bytes": float(nbytes)}
    for name, dst, src in (("d2h_gbps", host, dev), ("h2d_gbps", dev, host)):
        best = 0.0
        for _ in range(reps + 1):  # first one warms up
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
            end.synchronize()
            best = max(best, nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
        out[name] = best
    del host, dev
    _cleanup()
    return out


# ---------------------------------------------------------------------------
# Measurements


def _teardown(method: Method, model: torch.nn.Module) -> None:
    """Undo `method.setup` (also after a failed setup) and give back pinned and device memory."""
    try:
        method.teardown(model)
    except Exception:  # a half set-up peer; the next method sets the model up again
        logger.warning("hsoffload bench: teardown of %s failed", method.name, exc_info=True)
    model.zero_grad(set_to_none=True)
    if method.name == "hsoffload":
        import hsoffload

        hsoffload.empty_pool()
    _cleanup()


def _steps(
    method: Method, model: torch.nn.Module, batch: dict[str, torch.Tensor], n: int, device: torch.device
) -> list[float]:
    times = []
    for _ in range(n):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        common.train_step(model, batch, method.context())
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return times


def measure(
    method: Method,
    model: torch.nn.Module,
    shape: ModelShape,
    seq: int,
    warmup: int,
    steps: int,
    device: torch.device,
) -> dict[str, Any]:
    row: dict[str, Any] = {"method": method.name, "seq": seq}
    batch = common.make_batch(shape, 1, seq, seed=seq, device=device, labels=False)
    try:
        method.setup(model)
        _cleanup()
        _steps(method, model, batch, warmup, device)
        torch.cuda.reset_peak_memory_stats(device)
        _reset_host_peak()
        times = _steps(method, model, batch, steps, device)
        row.update(
            status="ok",
            step_s=median(times),
            step_times_s=times,
            peak_allocated=torch.cuda.max_memory_allocated(device),
            peak_reserved=torch.cuda.max_memory_reserved(device),
            host_pinned_peak=_host_peak("active_bytes.peak"),
            host_pinned_owned_peak=_host_peak("allocated_bytes.peak"),
            counters=method.counters(),
        )
    except Exception as exc:
        model.zero_grad(set_to_none=True)
        row.update(status="oom" if _is_oom(exc) else "error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
    finally:
        del batch
        _teardown(method, model)
    return row


def profile_copies(
    method: Method, model: torch.nn.Module, shape: ModelShape, seq: int, device: torch.device
) -> dict[str, Any]:
    """One profiled step (after one warm-up): bytes and busy time of every D2H/H2D memcpy."""
    from torch.profiler import ProfilerActivity, profile

    batch = common.make_batch(shape, 1, seq, seed=seq, device=device, labels=False)
    out: dict[str, Any] = {"method": method.name, "seq": seq}
    trace = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
    trace.close()
    try:
        method.setup(model)
        _steps(method, model, batch, 1, device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _steps(method, model, batch, 1, device)
        prof.export_chrome_trace(trace.name)
        with open(trace.name) as f:
            events = json.load(f).get("traceEvents", [])
        for direction in ("DtoH", "HtoD"):
            copies = [
                e
                for e in events
                if e.get("cat") == "gpu_memcpy" and direction in str(e.get("name", "")) and e.get("dur", 0) > 0
            ]
            nbytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in copies)
            busy_us = sum(float(e["dur"]) for e in copies)
            key = direction.lower()
            out[f"{key}_copies"] = len(copies)
            out[f"{key}_bytes"] = nbytes
            out[f"{key}_busy_ms"] = busy_us / 1e3
            out[f"{key}_gbps"] = nbytes / (busy_us / 1e6) / 1e9 if busy_us > 0 else None
        out["status"] = "ok"
    except Exception as exc:
        model.zero_grad(set_to_none=True)
        out.update(status="oom" if _is_oom(exc) else "error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
    finally:
        os.unlink(trace.name)
        del batch
        _teardown(method, model)
    return out


def longest_fit(
    method: Method,
    model: torch.nn.Module,
    shape: ModelShape,
    rows: list[dict[str, Any]],
    budget_bytes: int,
    device: torch.device,
    deadline: float,
) -> dict[str, Any]:
    """Predict the longest length under `budget_bytes` from the peaks at the two longest measured
    lengths, then verify it (rounded down to 1k) with one step under a memory-fraction cap, stepping
    down 6% after an OOM (at most 3 tries)."""
    ok = sorted((r for r in rows if r["method"] == method.name and r.get("status") == "ok"), key=lambda r: r["seq"])
    out: dict[str, Any] = {"method": method.name, "budget_bytes": budget_bytes}
    if len(ok) < 2:
        out["status"] = "skipped: needs two measured lengths"
        return out
    a, b = ok[-2], ok[-1]
    slope = (b["peak_reserved"] - a["peak_reserved"]) / (b["seq"] - a["seq"])
    if slope <= 0:
        out["status"] = "skipped: peak memory does not grow with length"
        return out
    predicted = int(b["seq"] + (budget_bytes - b["peak_reserved"]) / slope)
    out["predicted_seq"] = predicted
    total = torch.cuda.get_device_properties(device).total_memory
    candidate = max(1024, predicted // 1024 * 1024)
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
    try:
        for _ in range(3):
            step = _predict_step_s(rows, method.name, candidate)
            predicted_s = None if step is None else step + _OVERHEAD_S
            if time.monotonic() > deadline or not _time_left_for(predicted_s, deadline):
                out["status"] = "time limit" if predicted_s is None else _skip_reason(predicted_s, deadline)
                break
            batch = common.make_batch(shape, 1, candidate, seed=candidate, device=device, labels=False)
            try:
                method.setup(model)
                _cleanup()
                _steps(method, model, batch, 1, device)
                out.update(status="ok", verified_seq=candidate)
                break
            except Exception as exc:
                model.zero_grad(set_to_none=True)
                if not _is_oom(exc):
                    out.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
                    break
                out.setdefault("oom_at", []).append(candidate)
                candidate = max(1024, int(candidate * 0.94) // 1024 * 1024)
            finally:
                del batch
                _teardown(method, model)
        else:
            out["status"] = "no fit within 3 tries"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    return out


# ---------------------------------------------------------------------------


def _select(names: Optional[str]) -> list[Method]:
    methods = all_methods(cpu=False)
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        unknown = set(wanted) - {m.name for m in methods} - {"axolotl", "deepspeed"}
        if unknown:
            raise SystemExit(f"hsoffload bench: unknown method(s) {sorted(unknown)}")
        methods = [m for m in methods if m.name in wanted or (m.name == "deepspeed" and "axolotl" in wanted)]
    return methods


def run(args: argparse.Namespace, progress_enabled: bool = True) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise RuntimeError("hsoffload bench: the GPU suite needs CUDA")
    start = time.monotonic()
    # With --trace, the CLI profiles one more step after this suite: keep its time inside --time-limit too.
    deadline = start + args.time_limit - (TRACE_RESERVE_S if getattr(args, "trace", None) else 0.0)
    device = torch.device("cuda", torch.cuda.current_device())
    seqs = sorted(args.seqs)
    fit_layers = args.fit_layers or args.layers
    methods = _select(args.methods)
    usable: list[Method] = []
    skipped: list[dict[str, Any]] = []
    for m in methods:
        ok, why = m.available()
        (usable.append(m) if ok else skipped.append({"method": m.name, "reason": why}))
    result: dict[str, Any] = {
        "suite": "gpu",
        "environment": common.environment(),
        "config": {
            "layers": args.layers,
            "seqs": seqs,
            "steps": args.steps,
            "warmup": args.warmup,
            "budget_gib": args.budget_gib,
            "fit_layers": fit_layers,
            "dtype": "bfloat16",
            "batch": 1,
            "time_limit_s": args.time_limit,
        },
        "goals": GOALS,
        "notes": [
            "freed_over_hidden compares peak allocated memory: at the backward peak hsoffload holds the "
            "restored input of the layer being recomputed plus the prefetched one (prefetch_depth 1), so "
            "its ceiling is (layers - 2) / layers of the hidden-state bytes, not 1",
        ],
        "skipped_methods": skipped,
        "errors": [],
    }
    json_path = getattr(args, "json", None)

    def save() -> None:
        """Rewrite --json with the results so far (the CLI writes the final file at the end)."""
        if not json_path:
            return
        try:
            common.write_json(json_path, {"environment": result["environment"], "gpu": result, "partial": True})
        except Exception:
            logger.warning("hsoffload bench: could not write partial results to %s", json_path, exc_info=True)

    # Time is spent where it matters most first: plain checkpointing and hsoffload come first at
    # every length (usable keeps all_methods' order), and their fits run before the longest length.
    key = [m for m in usable if m.name in ("checkpointing", "hsoffload")]
    peers = [m for m in usable if m.name not in ("checkpointing", "hsoffload")]
    total = 1 + len(seqs) * len(usable) + 2 * len(usable)
    progress = Progress(total, "hsoffload bench gpu", progress_enabled)
    rows: list[dict[str, Any]] = []
    result["runs"] = rows
    try:
        progress.note("pinned-copy peak")
        result["copy_peak"] = pinned_copy_peak(device)
        progress.update("copy peak")

        shape = llama3_8b(args.layers, 4 * max(seqs))
        model = common.build_model(
            shape, seed=0, device=device, dtype=torch.bfloat16, causal_lm=False, attn_implementation="sdpa"
        )
        # Short lengths first, the longest last: a time-boxed run still covers the cheap ones.
        save()
        for seq in seqs:
            for m in usable:
                step = _predict_step_s(rows, m.name, seq)
                predicted = None if step is None else step * (args.warmup + args.steps) + _OVERHEAD_S
                if time.monotonic() > deadline or not _time_left_for(predicted, deadline):
                    why = "skipped: time limit" if predicted is None else _skip_reason(predicted, deadline)
                    rows.append({"method": m.name, "seq": seq, "status": why})
                    progress.update()
                    continue
                progress.note(f"{m.name} seq={seq}")
                row = measure(m, model, shape, seq, args.warmup, args.steps, device)
                row["hidden_state_bytes"] = hidden_state_bytes(shape, 1, seq, torch.bfloat16)
                if predicted is not None:
                    row["predicted_s"] = predicted
                rows.append(row)
                if row["status"] == "error":
                    result["errors"].append(row)
                save()
                progress.update(f"{m.name} seq={seq}")
            if seq == seqs[min(1, len(seqs) - 1)]:
                # After the second length, before the expensive longest runs: bandwidth, and the
                # longest fit of the two methods the suite is about (the peers' fits come last).
                _bandwidth(args, result, usable, model, shape, rows, device, deadline, progress)
                _fits(args, result, key, model, shape, rows, device, deadline, progress, fit_layers)
                save()
        _fits(args, result, peers, model, shape, rows, device, deadline, progress, fit_layers)
        del model
        _cleanup()
        if time.monotonic() + 60 < deadline:
            # The planner's predicted step peak against torch.cuda.max_memory_allocated at Llama-3-8B width (4
            # layers): the first GPU run validates `hsoffload plan` (docs/benchmarks.md).
            from . import gpu_peak

            progress.note("planner vs allocator")
            result["planner_vs_allocator"] = gpu_peak.run(device, deadline=deadline - 60)
            save()
        else:
            result["planner_vs_allocator"] = {"status": "skipped", "reason": "time limit: under 60 s left"}
        if time.monotonic() + 60 < deadline:
            # The CPU suite's policy rows, on this GPU (a tiny model, seconds): each offload policy under its
            # checkpointing setup against the baseline, TRL's OffloadActivations and save_on_cpu.
            from . import policies

            progress.note("policies")
            result["policies"] = policies.run(False, Progress(0, "", False), device=device, seq=8192)
            save()
        else:
            result["policies_skipped"] = "time limit: under 60 s left for the policy rows"
    except Exception as exc:  # report what was measured before the failure
        logger.exception("hsoffload bench: the GPU suite stopped early")
        result["errors"].append({"method": None, "seq": None, "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
    finally:
        result["summary"] = summarize(rows, result)
        progress.close()
        result["elapsed_s"] = time.monotonic() - start
        save()
    return result


def _bandwidth(
    args: argparse.Namespace,
    result: dict[str, Any],
    usable: list[Method],
    model: torch.nn.Module,
    shape: ModelShape,
    rows: list[dict[str, Any]],
    device: torch.device,
    deadline: float,
    progress: Progress,
) -> None:
    ran = sorted({r["seq"] for r in rows if r.get("status") == "ok"})
    prof_seq = args.profile_seq or (32768 if 32768 in ran else (ran[-1] if ran else min(args.seqs)))
    bw: list[dict[str, Any]] = []
    for m in usable:
        if m.name == "checkpointing":
            progress.update()
            continue
        step = _predict_step_s(rows, m.name, prof_seq)
        predicted = None if step is None else 2 * 1.5 * step + _OVERHEAD_S  # warm-up + profiled step
        if time.monotonic() > deadline or not _time_left_for(predicted, deadline):
            why = "skipped: time limit" if predicted is None else _skip_reason(predicted, deadline)
            bw.append({"method": m.name, "seq": prof_seq, "status": why})
        else:
            progress.note(f"profile {m.name}")
            entry = profile_copies(m, model, shape, prof_seq, device)
            if entry["status"] == "error":
                result["errors"].append(entry)
            bw.append(entry)
        progress.update(f"profile {m.name}")
    result["bandwidth"] = bw


def _fits(
    args: argparse.Namespace,
    result: dict[str, Any],
    methods: list[Method],
    model: torch.nn.Module,
    shape: ModelShape,
    rows: list[dict[str, Any]],
    device: torch.device,
    deadline: float,
    progress: Progress,
    fit_layers: int,
) -> None:
    """The longest fitting length of each of `methods`, appended to result["fit"]."""
    fits: list[dict[str, Any]] = result.setdefault("fit", [])
    budget = int(args.budget_gib * (1 << 30))
    if fit_layers != shape.layers:
        if not fits:
            fits.append({"status": "skipped: --fit-layers differs from --layers (one model per process)"})
        return
    for m in methods:
        if time.monotonic() > deadline:
            fits.append({"method": m.name, "status": "skipped: time limit"})
        else:
            progress.note(f"fit {m.name}")
            fits.append(longest_fit(m, model, shape, rows, budget, device, deadline))
        progress.update(f"fit {m.name}")


def summarize(rows: list[dict[str, Any]], result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per method and length: ratios to plain checkpointing, and the goals."""
    base = {r["seq"]: r for r in rows if r["method"] == "checkpointing" and r.get("status") == "ok"}
    peak = result.get("copy_peak", {})
    layers = int(result.get("config", {}).get("layers") or 0)
    bw = {b["method"]: b for b in result.get("bandwidth", []) if b.get("status") == "ok"}
    out = []
    for r in rows:
        if r.get("status") != "ok":
            continue
        b = base.get(r["seq"])
        s: dict[str, Any] = {"method": r["method"], "seq": r["seq"]}
        if b is not None:
            s["step_overhead"] = r["step_s"] / b["step_s"] - 1.0
            freed = b["peak_allocated"] - r["peak_allocated"]
            s["freed_bytes"] = freed
            s["freed_over_hidden"] = freed / r["hidden_state_bytes"]
            if layers > 2:  # see result["notes"]: the ceiling at the backward peak is (layers - 2) / layers
                s["freed_over_ceiling"] = freed / (r["hidden_state_bytes"] * (layers - 2) / layers)
        m_bw = bw.get(r["method"])
        if m_bw and peak:
            for d in ("d2h", "h2d"):
                if m_bw.get(f"{d}_gbps"):
                    s[f"{d}_over_peak"] = m_bw[f"{d}_gbps"] / peak[f"{d}_gbps"]
        out.append(s)
    return out


def report(result: dict[str, Any]) -> str:
    fb, ff = common.fmt_bytes, common.fmt_float
    cfg = result["config"]
    env = result["environment"]
    lines = [
        f"GPU suite on {env.get('gpu')}: Llama-3-8B layer dims, {cfg['layers']} layers, bf16, batch 1 "
        f"(torch {env['torch']}, transformers {env.get('transformers')})",
    ]
    peak = result.get("copy_peak")
    if peak:
        lines.append(f"pinned-copy peak: D2H {peak['d2h_gbps']:.1f} GB/s, H2D {peak['h2d_gbps']:.1f} GB/s")
    if result.get("planner_vs_allocator"):
        from . import gpu_peak

        lines.append("\n".join(gpu_peak.report(result["planner_vs_allocator"])))
    if result.get("policies"):
        from . import policies

        lines.append(policies.report(result["policies"]))
    elif result.get("policies_skipped"):
        lines.append("offload policy rows skipped: " + result["policies_skipped"])
    summ = {(s["method"], s["seq"]): s for s in result.get("summary", [])}
    rows = []
    for r in result.get("runs", []):
        s = summ.get((r["method"], r["seq"]), {})
        if r.get("status") != "ok":
            rows.append([r["seq"], r["method"], r.get("status"), "", "", "", "", "", ""])
            continue
        rows.append(
            [
                r["seq"],
                r["method"],
                f"{r['step_s'] * 1e3:.0f}",
                f"{s['step_overhead'] * 100:+.2f}%" if "step_overhead" in s else "",
                fb(r["peak_allocated"]),
                fb(r["peak_reserved"]),
                fb(r.get("host_pinned_peak")),
                fb(s.get("freed_bytes")),
                f"{s['freed_over_hidden'] * 100:.1f}%" if "freed_over_hidden" in s else "",
            ]
        )
    lines.append(
        common.table(
            ["seq", "method", "step ms", "vs ckpt", "peak alloc", "peak reserved", "host pinned", "freed", "freed/hidden"],
            rows,
        )
    )
    bw_rows = []
    for b in result.get("bandwidth", []):
        if b.get("status") != "ok":
            bw_rows.append([b.get("method"), b.get("seq", ""), b.get("status"), "", "", ""])
            continue
        bw_rows.append(
            [
                b["method"],
                b["seq"],
                f"{ff(b.get('dtoh_gbps'))} GB/s",
                f"{ff(b.get('htod_gbps'))} GB/s",
                fb(b.get("dtoh_bytes")),
                b.get("dtoh_copies"),
            ]
        )
    if bw_rows:
        lines.append(common.table(["method", "seq", "D2H", "H2D", "D2H bytes", "D2H copies"], bw_rows, "Copy bandwidth (profiled step)"))
    fit_rows = [
        [f.get("method", ""), f.get("predicted_seq", ""), f.get("verified_seq", ""), f.get("status")]
        for f in result.get("fit", [])
    ]
    if fit_rows:
        lines.append(
            common.table(
                ["method", "predicted", "verified", "status"],
                fit_rows,
                f"Longest sequence within {cfg['budget_gib']} GiB ({cfg['fit_layers']} layers)",
            )
        )
    for s in result.get("skipped_methods", []):
        lines.append(f"skipped {s['method']}: {s['reason']}")
    for e in result.get("errors", []):
        lines.append(f"error {e.get('method')} seq={e.get('seq')}: {e.get('error')}")
    lines.append(f"elapsed {result.get('elapsed_s', 0):.0f} s")
    return "\n\n".join(lines)


def plot(result: dict[str, Any], path: str) -> Optional[str]:
    """Step time and peak allocated memory per method and length, and the longest fitting length."""
    plt = common.pyplot("bench")
    if plt is None:
        return None
    runs = [r for r in result.get("runs", []) if r.get("status") == "ok"]
    methods = sorted({r["method"] for r in runs}, key=lambda n: (n != "checkpointing", n != "hsoffload", n))
    seqs = sorted({r["seq"] for r in runs})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), dpi=110)
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        by_seq = {r["seq"]: r for r in runs if r["method"] == m}
        xs = [j + i * width for j, s in enumerate(seqs) if s in by_seq]
        axes[0].bar(xs, [by_seq[s]["step_s"] for s in seqs if s in by_seq], width, label=m)
        axes[1].bar(xs, [by_seq[s]["peak_allocated"] / (1 << 30) for s in seqs if s in by_seq], width, label=m)
    for ax, ylabel in ((axes[0], "median step time (s)"), (axes[1], "peak allocated (GiB)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(seqs))], [f"{s // 1024}k" for s in seqs])
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fits = [f for f in result.get("fit", []) if f.get("verified_seq")]
    if fits:
        axes[2].bar([f["method"] for f in fits], [f["verified_seq"] / 1024 for f in fits])
        axes[2].set_ylabel(f"longest verified length (k tokens) in {result['config']['budget_gib']} GiB")
        axes[2].tick_params(axis="x", labelsize=7, rotation=20)
    env = result["environment"]
    fig.suptitle(
        f"{env.get('gpu')}: Llama-3-8B layer dims x {result['config']['layers']}, bf16, batch 1 (torch {env['torch']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
