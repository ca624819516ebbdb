"""CPU suite: runs anywhere in seconds.

1. `pool`: host-pool bytes held / bytes in flight for a run whose sequence length changes every step.
   Runs first: the engine's `peak_held_bytes` is a process-lifetime high-water mark.
2. `hook_calls`: cost per pack/unpack call of the hsoffload ops (passthrough and marked tensors)
   against a pure-Python saved_tensors_hooks pair that does the same work.
3. `step`: a tiny Llama step: time spent in the hooks as a share of the step, and step time side by
   side for the methods that run on a CPU.
4. `policies`: each offload policy under its checkpointing setup against that setup's baseline and the peers
   (`bench/policies.py`).

On a CPU the "device" is the CPU itself, so hsoffload runs with `offload_cpu_tensors=True` to make
it copy bytes; the absolute times describe this machine only, the ratios are measured side by side.
"""

from __future__ import annotations

import gc
import logging
import random
import time
import weakref
from typing import Any, Callable, Optional

import torch

from .. import workloads as common
from ..workloads import Progress, median, tiny_llama
from .peers import HsOffload, Method, all_methods

logger = logging.getLogger("hsoffload")

POOL_GOAL = 1.05  # peak host bytes held / peak offloaded bytes in flight
POOL_REUSE_GOAL = 0.95  # packs after the first step served without a new slab


# ---------------------------------------------------------------------------
# Pool: held bytes / bytes offloaded with variable sequence lengths


def bench_pool(quick: bool, progress: Progress, seed: int = 0) -> dict[str, Any]:
    """Host bytes held by the pool vs offloaded bytes in flight, sequence lengths uniform in [L/2, L].

    The workload is the pool's alone: 8 "layers" whose saved input is a marked bf16 hidden state of seq x 4096
    (a Llama-8B-wide layer input), with one cheap elementwise op each, through real autograd and the real hooks;
    ordinary memory stands in for pinned (on a GPU the slabs are pinned, of the same power-of-two sizes, which
    torch's caching host allocator serves without rounding).
    """
    import hsoffload

    layers, hidden = 8, 4096
    longest = 2048 if quick else 4096
    steps = 30 if quick else 100
    rng = random.Random(seed)
    seqs = [rng.randint(longest // 2, longest) for _ in range(steps)]
    weights = [torch.ones(hidden, dtype=torch.bfloat16, requires_grad=True) for _ in range(layers)]
    hsoffload.empty_pool()
    before = hsoffload.pool_stats()
    held_peak = inflight_peak = 0
    first_step: Optional[Any] = None
    for i, seq in enumerate(seqs):
        x = torch.full((seq, hidden), 0.5, dtype=torch.bfloat16)
        with hsoffload.OffloadScope(offload_cpu_tensors=True, min_offload_size=0) as scope:
            h = x
            for w in weights:
                h = hsoffload.mark_hidden_state(h) * w  # saves h (offloaded) and w (a leaf: passes through)
            held_peak = max(held_peak, hsoffload.pool_stats().held_bytes)
            inflight_peak = max(inflight_peak, scope.stats.offloaded_bytes)
            h.float().sum().backward()
        del h
        if i == 0:
            first_step = hsoffload.pool_stats()
        progress.update(f"pool seq={seq}")
    stats = hsoffload.pool_stats()
    for w in weights:
        w.grad = None
    assert first_step is not None
    later_acquires = stats.acquires - first_step.acquires
    later_reuses = stats.reuses - first_step.reuses
    ratio = held_peak / inflight_peak if inflight_peak else float("nan")
    reuse_share = later_reuses / later_acquires if later_acquires else float("nan")
    result = {
        "steps": steps,
        "layers": layers,
        "hidden": hidden,
        "seq_lengths": seqs,
        "peak_inflight_offloaded_bytes": inflight_peak,
        "peak_held_bytes": held_peak,
        "engine_peak_held_bytes": stats.peak_held_bytes,
        "engine_peak_valid": before.peak_held_bytes == 0,
        "held_over_offloaded": ratio,
        "slabs": stats.slabs,
        "allocations": stats.allocations - before.allocations,
        "acquires": stats.acquires - before.acquires,
        "reuses": stats.reuses - before.reuses,
        "unpooled": stats.unpooled - before.unpooled,
        "reuse_share_after_first_step": reuse_share,
        "goal": POOL_GOAL,
        "reuse_goal": POOL_REUSE_GOAL,
        "meets_goal": ratio <= POOL_GOAL and reuse_share >= POOL_REUSE_GOAL,
    }
    hsoffload.empty_pool()
    return result


# ---------------------------------------------------------------------------
# Per-call cost of the hooks


class PythonOffloadHooks:
    """Reference: the same work as the hsoffload ops, in Python. Marks are checked by identity and
    version (through a weak reference), marked tensors are copied to a fresh host tensor in pack and
    back to a fresh device tensor in unpack; anything else passes through."""

    def __init__(self) -> None:
        self.marks: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}

    def mark(self, x: torch.Tensor) -> torch.Tensor:
        self.marks[id(x)] = (weakref.ref(x), x._version)
        return x

    def pack(self, x: torch.Tensor) -> Any:
        entry = self.marks.get(id(x))
        if entry is None or entry[0]() is not x or entry[1] != x._version:
            return x
        host = torch.empty(x.shape, dtype=x.dtype, device="cpu")
        host.copy_(x)
        return (host, x.device)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        host, device = packed
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        out.copy_(host)
        return out


def _time_calls(
    pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor], tensors: list[torch.Tensor], repeats: int
) -> tuple[float, float]:
    """Median over `repeats` rounds of the per-call time (ns) of pack over `tensors`, then of unpack in reverse."""
    pack_ns: list[float] = []
    unpack_ns: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        handles = [pack(x) for x in tensors]
        t1 = time.perf_counter_ns()
        for h in reversed(handles):  # backward order, as autograd unpacks (and as prefetch expects)
            unpack(h)
        t2 = time.perf_counter_ns()
        del handles  # return host buffers before the next round, as autograd would
        pack_ns.append((t1 - t0) / len(tensors))
        unpack_ns.append((t2 - t1) / len(tensors))
    return median(pack_ns), median(unpack_ns)


def bench_hook_calls(quick: bool, progress: Progress) -> list[dict[str, Any]]:
    import hsoffload
    from ... import engine  # noqa: PLC0415  (loads the op library: only when this suite runs)

    cases = [("passthrough", 4 << 10, False), ("marked", 64 << 10, True), ("marked", 4 << 20, True)]
    repeats = 5 if quick else 15
    rows: list[dict[str, Any]] = []
    for kind, nbytes, marked in cases:
        count = 200 if nbytes <= (64 << 10) else 16
        tensors = [torch.randn(nbytes // 4) for _ in range(count)]
        # hsoffload: the scope's own pack/unpack hooks, the exact callables autograd calls. The
        # passthrough case has no marks by design: silence the scope's "nothing was marked" warning.
        scope = hsoffload.OffloadScope(offload_cpu_tensors=True, min_offload_size=0)
        level = logger.level
        if not marked:
            logger.setLevel(logging.ERROR)
        try:
            with scope:
                if marked:
                    for x in tensors:
                        engine.mark_hidden_state(x)
                _time_calls(scope.pack_hook, scope.unpack_hook, tensors, 1)  # warm the pool
                hs_pack, hs_unpack = _time_calls(scope.pack_hook, scope.unpack_hook, tensors, repeats)
        finally:
            logger.setLevel(level)
        stats = scope.stats
        if marked and stats.offloaded_tensors == 0:
            raise RuntimeError("hsoffload bench: marked tensors were not offloaded; the measurement would be void")
        # Floor of any op call from Python: one dispatcher round trip that does no work.
        alias = torch.ops.aten.alias.default
        floor_pack, floor_unpack = _time_calls(alias, alias, tensors, repeats)
        ref = PythonOffloadHooks()
        if marked:
            for x in tensors:
                ref.mark(x)
        _time_calls(ref.pack, ref.unpack, tensors, 1)
        py_pack, py_unpack = _time_calls(ref.pack, ref.unpack, tensors, repeats)
        rows.append(
            {
                "case": kind,
                "tensor_bytes": nbytes,
                "calls_per_round": count,
                "hsoffload_pack_us": hs_pack / 1e3,
                "hsoffload_unpack_us": hs_unpack / 1e3,
                "python_pack_us": py_pack / 1e3,
                "python_unpack_us": py_unpack / 1e3,
                "hsoffload_over_python": (hs_pack + hs_unpack) / (py_pack + py_unpack),
                "dispatcher_floor_us": (floor_pack + floor_unpack) / 2 / 1e3,
            }
        )
        progress.update(f"hooks {kind} {common.fmt_bytes(nbytes)}")
        hsoffload.empty_pool()
    return rows


# ---------------------------------------------------------------------------
# A tiny-model step: hook-time share and methods side by side


def _run_steps(
    method: Method,
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    steps: int,
    progress: Progress,
) -> list[float]:
    times: list[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        common.train_step(model, batch, method.context())
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        progress.update(f"step {method.name}")
    return times


def bench_step(quick: bool, progress: Progress, seed: int = 0) -> dict[str, Any]:
    shape = tiny_llama(layers=4)
    seq = 512
    batch_size = 2
    model = common.build_model(shape, seed=seed, device=torch.device("cpu"))
    batch = common.make_batch(shape, batch_size, seq, seed=seed, device=torch.device("cpu"))
    warmup, steps = (1, 3) if quick else (2, 9)

    # Hook share: hsoffload's hooks timed from the inside over instrumented steps.
    hs = HsOffload(offload_cpu_tensors=True)
    hs.setup(model)
    share_steps: list[float] = []
    hook_ns: list[int] = []
    hook_calls = 0
    for i in range(warmup + steps):
        timeline = common.SavedBytesTimeline(hs.scope, model=model, record=False)
        t0 = time.perf_counter_ns()
        common.train_step(model, batch, common.nested(hs.scope, timeline))
        dt = time.perf_counter_ns() - t0
        model.zero_grad(set_to_none=True)
        if i >= warmup:
            share_steps.append(dt)
            hook_ns.append(timeline.hook_ns)
            hook_calls = timeline.hook_calls
        progress.update("hook share")
    hs.teardown(model)
    share = {
        "hook_calls_per_step": hook_calls,
        "hook_ms_per_step": median(hook_ns) / 1e6,
        "step_ms": median(share_steps) / 1e6,
        "hook_share": median([h / s for h, s in zip(hook_ns, share_steps)]),
        "note": "time inside the hsoffload pack/unpack hooks (including the copies of 4 decoder-layer inputs) / step time",
    }

    # Side by side, interleaved rounds so drift on a shared machine hits every method alike.
    methods = [m for m in all_methods(cpu=True)]
    rows: list[dict[str, Any]] = []
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    usable: list[Method] = []
    for m in methods:
        ok, why = m.available()
        if ok:
            usable.append(m)
        else:
            rows.append({"method": m.name, "available": False, "reason": why})
    failed: dict[str, str] = {}
    for r in range(warmup + steps):
        for m in usable:
            if m.name in failed:
                continue
            try:
                m.setup(model)
                t = _run_steps(m, model, batch, 1, progress)
                counters = m.counters()
                m.teardown(model)
            except Exception as exc:  # report the peer's failure, keep measuring the others
                logger.warning("hsoffload bench: %s failed: %s", m.name, exc)
                failed[m.name] = f"{type(exc).__name__}: {exc}"
                continue
            if r >= warmup:
                times[m.name] += t
            if r == warmup + steps - 1:
                m.final_counters = counters  # type: ignore[attr-defined]
    base = median(times.get("checkpointing", []))
    for m in usable:
        if m.name in failed:
            rows.append({"method": m.name, "available": False, "reason": failed[m.name]})
            continue
        med = median(times[m.name])
        rows.append(
            {
                "method": m.name,
                "available": True,
                "description": m.description,
                "step_ms": med * 1e3,
                "vs_checkpointing": med / base if base == base else float("nan"),
                "steps_timed": len(times[m.name]),
                "counters": getattr(m, "final_counters", {}),
            }
        )
    return {
        "model": dataclasses_asdict(shape),
        "batch": batch_size,
        "seq": seq,
        "hook_share": share,
        "methods": rows,
    }


def dataclasses_asdict(obj: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(obj)


# ---------------------------------------------------------------------------


def run(quick: bool, progress_enabled: bool = True, parts: Optional[list[str]] = None) -> dict[str, Any]:
    parts = parts or ["pool", "hook_calls", "step", "policies"]
    warmup, steps = (1, 3) if quick else (2, 9)
    total = 0
    if "pool" in parts:
        total += 8 if quick else 24
    if "hook_calls" in parts:
        total += 3
    if "step" in parts:
        total += (warmup + steps) * (1 + 3)
    if "policies" in parts:
        total += (3 if quick else 9) * 8
    progress = Progress(total, "hsoffload bench cpu", progress_enabled)
    torch.manual_seed(0)
    out: dict[str, Any] = {"suite": "cpu", "quick": quick, "environment": common.environment()}
    try:
        if "pool" in parts:
            out["pool"] = bench_pool(quick, progress)
        if "hook_calls" in parts:
            out["hook_calls"] = bench_hook_calls(quick, progress)
        if "step" in parts:
            out["step"] = bench_step(quick, progress)
        if "policies" in parts:
            from . import policies

            out["policies"] = policies.run(quick, progress)
    finally:
        progress.close()
        gc.collect()
    return out


def report(result: dict[str, Any]) -> str:
    """The tables printed at the end of `hsoffload bench --suite cpu`."""
    fb, ff = common.fmt_bytes, common.fmt_float
    parts: list[str] = []
    if "hook_calls" in result:
        rows = [
            [
                r["case"],
                fb(r["tensor_bytes"]),
                ff(r["hsoffload_pack_us"]),
                ff(r["hsoffload_unpack_us"]),
                ff(r["python_pack_us"]),
                ff(r["python_unpack_us"]),
                ff(r["hsoffload_over_python"]),
                ff(r["dispatcher_floor_us"]),
            ]
            for r in result["hook_calls"]
        ]
        parts.append(
            common.table(
                ["case", "tensor", "hs pack us", "hs unpack us", "py pack us", "py unpack us", "hs/py", "op floor us"],
                rows,
                "Per-call cost: hsoffload hooks vs a pure-Python saved_tensors_hooks pair (median per call; "
                "op floor = one torch.ops.aten.alias call, the cost of any op call from Python)",
            )
        )
    if "step" in result:
        s = result["step"]["hook_share"]
        parts.append(
            f"Hook time in a tiny-Llama step (batch {result['step']['batch']}, seq {result['step']['seq']}, "
            f"4 layers, offload_cpu_tensors=True): {ff(s['hook_ms_per_step'])} ms of {ff(s['step_ms'])} ms "
            f"= {s['hook_share'] * 100:.2f}% ({s['hook_calls_per_step']} hook calls)"
        )
        rows = []
        for r in result["step"]["methods"]:
            if not r["available"]:
                rows.append([r["method"], "-", "-", "skipped: " + r["reason"]])
            else:
                off = r["counters"].get("offloaded_bytes")
                rows.append([r["method"], ff(r["step_ms"]), ff(r["vs_checkpointing"]), fb(off) if off else ""])
        parts.append(common.table(["method", "step ms", "x ckpt", "offloaded/step or note"], rows, "CPU step time side by side"))
    if "policies" in result:
        from . import policies

        parts.append(policies.report(result["policies"]))
    if "pool" in result:
        p = result["pool"]
        verdict = "meets" if p["meets_goal"] else "MISSES"
        parts.append(
            f"Host pool, {p['steps']} steps x {p['layers']} layers, hidden {p['hidden']} bf16, sequence lengths "
            f"{min(p['seq_lengths'])}..{max(p['seq_lengths'])}: peak held {fb(p['peak_held_bytes'])} / peak in flight "
            f"{fb(p['peak_inflight_offloaded_bytes'])} = {p['held_over_offloaded']:.4f} (goal <= {p['goal']}); packs "
            f"after the first step without a new slab {p['reuse_share_after_first_step'] * 100:.1f}% (goal >= "
            f"{p['reuse_goal'] * 100:.0f}%): {verdict}; {p['slabs']} slabs, {p['allocations']} allocations for "
            f"{p['acquires']} packs, {p['unpooled']} unpooled"
        )
    return "\n\n".join(parts)


def plot(result: dict[str, Any], path: str) -> Optional[str]:
    """Two panels: per-call cost (hsoffload vs Python) and CPU step time per method."""
    plt = common.pyplot("bench")
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    calls = result.get("hook_calls", [])
    if calls:
        ax = axes[0]
        labels = [f"{r['case']}\n{common.fmt_bytes(r['tensor_bytes'])}" for r in calls]
        xs = range(len(calls))
        hs = [r["hsoffload_pack_us"] + r["hsoffload_unpack_us"] for r in calls]
        py = [r["python_pack_us"] + r["python_unpack_us"] for r in calls]
        ax.bar([x - 0.2 for x in xs], hs, 0.4, label="hsoffload ops")
        ax.bar([x + 0.2 for x in xs], py, 0.4, label="pure-Python hooks")
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("pack + unpack per tensor (us, log)")
        ax.set_title("per-call cost", fontsize=9)
        ax.legend(fontsize=8)
    methods = [r for r in result.get("step", {}).get("methods", []) if r.get("available")]
    if methods:
        ax = axes[1]
        ax.bar([r["method"] for r in methods], [r["step_ms"] for r in methods])
        ax.set_ylabel("median step time (ms)")
        ax.set_title("tiny Llama step on this CPU, side by side", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
