"""`hsoffload demo`: a tiny Llama trained for a few steps with and without hidden-state offload.

Two copies of the model from one seed take the same batches: one with plain (non-reentrant)
gradient checkpointing, one inside `hsoffload.offload_hidden_states`. The demo checks that every
loss and every gradient is bit-identical, prints what was offloaded, and plots the saved-activation
bytes resident on the device over one step, measured by `SavedBytesTimeline` (see bench/common.py).
On a CPU, offload copies CPU tensors (`offload_cpu_tensors=True`) so that data really moves.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

import torch

from . import workloads as common
from .workloads import SavedBytesTimeline, hidden_state_bytes, pyplot, tiny_llama
from ..targets import enable_checkpointing

logger = logging.getLogger("hsoffload")


@dataclasses.dataclass
class DemoStep:
    step: int
    loss_plain: float
    loss_offload: float
    loss_equal: bool
    grads_equal: bool
    offloaded_tensors: int
    offloaded_bytes: int
    wait_ms: float
    step_ms_plain: float
    step_ms_offload: float


@dataclasses.dataclass
class DemoResult:
    device: str
    layers: int
    batch: int
    seq: int
    steps: list[DemoStep]
    peak_plain: Optional[int]  # peak device memory (CUDA: max_memory_allocated) or saved-activation bytes (CPU)
    peak_offload: Optional[int]
    peak_what: str
    saved_peak_plain: int
    saved_peak_offload: int
    host_peak_offload: int
    expected_hidden_bytes: int
    plot: Optional[str]
    all_equal: bool
    timeline: dict[str, list[dict[str, Any]]]
    forward_end_event: dict[str, Optional[int]]


def _grads_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        if na != nb or (pa.grad is None) != (pb.grad is None):
            return False
        if pa.grad is not None and not torch.equal(pa.grad, pb.grad):
            return False
    return True


def run_demo(
    *,
    device: Optional[torch.device] = None,
    steps: int = 3,
    layers: int = 4,
    batch: int = 2,
    seq: int = 256,
    plot: Optional[str] = "hsoffload_demo.png",
    seed: int = 0,
) -> DemoResult:
    import hsoffload

    device = device or common.default_device()
    shape = tiny_llama(layers=layers)
    plain = common.build_model(shape, seed=seed, device=device)
    offl = common.build_model(shape, seed=seed, device=device)
    for m in (plain, offl):
        enable_checkpointing(m, {"use_reentrant": False})
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    opt_offl = torch.optim.AdamW(offl.parameters(), lr=1e-3)
    scope = hsoffload.offload_hidden_states(offl, offload_cpu_tensors=device.type == "cpu")

    rows: list[DemoStep] = []
    timelines: dict[str, SavedBytesTimeline] = {}
    peaks: dict[str, Optional[int]] = {"plain": None, "offload": None}
    for i in range(steps):
        data = common.make_batch(shape, batch, seq, seed=seed + i, device=device)
        last = i == steps - 1  # instrument the last step (pool warm, nothing first-time)
        before = scope.stats

        tl_plain = SavedBytesTimeline(model=plain) if last else None
        loss_p, dt_p, peak = _timed_step(plain, data, tl_plain if tl_plain is not None else common.nested(),
                                         tl_plain, device)
        peaks["plain"] = peak if last else peaks["plain"]
        tl_off = SavedBytesTimeline(scope, scope=scope, model=offl) if last else None
        ctx = common.nested(scope, tl_off) if tl_off is not None else scope
        loss_o, dt_o, peak = _timed_step(offl, data, ctx, tl_off, device)
        peaks["offload"] = peak if last else peaks["offload"]

        after = scope.stats
        grads_ok = _grads_equal(plain, offl)
        for opt in (opt_plain, opt_offl):
            opt.step()
            opt.zero_grad(set_to_none=True)
        rows.append(
            DemoStep(
                step=i,
                loss_plain=loss_p.item(),
                loss_offload=loss_o.item(),
                loss_equal=bool(torch.equal(loss_p, loss_o)),
                grads_equal=grads_ok,
                offloaded_tensors=after.offloaded_tensors - before.offloaded_tensors,
                offloaded_bytes=after.offloaded_bytes - before.offloaded_bytes,
                wait_ms=(after.wait_ns - before.wait_ns) / 1e6,
                step_ms_plain=dt_p * 1e3,
                step_ms_offload=dt_o * 1e3,
            )
        )
        if tl_plain is not None and tl_off is not None:
            timelines = {"plain": tl_plain, "offload": tl_off}
    hsoffload.unpatch()

    result = _demo_result(device, shape, layers, batch, seq, rows, peaks, timelines)
    if plot:
        result.plot = write_plot(result, plot)
    return result


def _demo_result(device: torch.device, shape: Any, layers: int, batch: int, seq: int, rows: list[DemoStep],
                 peaks: dict[str, Optional[int]], timelines: dict[str, SavedBytesTimeline]) -> DemoResult:
    """The demo's figures: the steps, the peaks (CUDA's allocator, or the instrumented saved bytes), the timelines."""
    cuda = device.type == "cuda"
    tl_p, tl_o = timelines["plain"], timelines["offload"]
    if cuda:
        peak_what = "peak CUDA memory allocated during the last step (torch.cuda.max_memory_allocated)"
    else:
        peak_what = "peak saved-activation bytes held on the device during the last step (instrumented)"
        peaks = {"plain": tl_p.peak_device_bytes, "offload": tl_o.peak_device_bytes}
    result = DemoResult(
        device=str(device),
        layers=layers,
        batch=batch,
        seq=seq,
        steps=rows,
        peak_plain=peaks["plain"],
        peak_offload=peaks["offload"],
        peak_what=peak_what,
        saved_peak_plain=tl_p.peak_device_bytes,
        saved_peak_offload=tl_o.peak_device_bytes,
        host_peak_offload=tl_o.peak_host_bytes,
        expected_hidden_bytes=hidden_state_bytes(shape, batch, seq, torch.get_default_dtype()),
        plot=None,
        all_equal=all(r.loss_equal and r.grads_equal for r in rows),
        timeline={k: [dataclasses.asdict(e) for e in t.events] for k, t in timelines.items()},
        forward_end_event={k: t.forward_end_event for k, t in timelines.items()},
    )
    return result


def _timed_step(model: torch.nn.Module, data: Any, ctx: Any, timeline: Optional[SavedBytesTimeline],
                device: torch.device) -> tuple[torch.Tensor, float, Optional[int]]:
    """One training step in `ctx`: its loss, its time and, on CUDA, its peak allocated bytes."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    loss = common.train_step(model, data, ctx, on_forward_done=timeline.forward_done if timeline is not None else None)
    common.synchronize(device)
    elapsed = time.perf_counter() - t0
    return loss, elapsed, torch.cuda.max_memory_allocated(device) if cuda else None


def write_plot(result: DemoResult, path: str) -> Optional[str]:
    plt = pyplot("demo")
    if plt is None:
        return None
    mib = float(1 << 20)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    # x: saved-tensor hook events (pack, unpack, free) in order. Both runs save the same tensors in
    # the same order, so the curves line up; wall time would mostly show machine noise.
    for key, label in (("plain", "checkpointing only: on device"), ("offload", "hsoffload: on device")):
        ev = result.timeline[key]
        ax.step(range(len(ev)), [e["device_bytes"] / mib for e in ev], where="post", label=label)
    ev = result.timeline["offload"]
    ax.step(range(len(ev)), [e["host_bytes"] / mib for e in ev], "--", where="post", label="hsoffload: on host")
    fwd_end = result.forward_end_event.get("offload")
    if fwd_end is not None:
        ax.axvline(fwd_end - 0.5, color="grey", lw=0.8, ls=":")
        ax.text(fwd_end, ax.get_ylim()[1] * 0.95, " backward", fontsize=8, color="grey", va="top")
    ax.set_xlabel("saved-tensor events within one training step (pack / unpack / free, in order)")
    ax.set_ylabel("saved-activation bytes held (MiB)")
    ax.set_title(
        f"Tiny Llama, {result.layers} layers, batch {result.batch} x seq {result.seq}, device {result.device}\n"
        "bytes kept alive by saved-tensor handles (parameters excluded; recompute transients not shown)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def format_result(result: DemoResult) -> str:
    fb = common.fmt_bytes
    rows = [
        [
            r.step,
            f"{r.loss_plain:.6f}",
            f"{r.loss_offload:.6f}",
            "yes" if r.loss_equal else "NO",
            "yes" if r.grads_equal else "NO",
            r.offloaded_tensors,
            fb(r.offloaded_bytes),
            f"{r.wait_ms:.3f}",
            f"{r.step_ms_plain:.0f} / {r.step_ms_offload:.0f}",
        ]
        for r in result.steps
    ]
    out = [
        common.table(
            ["step", "loss (ckpt)", "loss (offload)", "loss equal", "grads equal", "offloaded", "bytes", "wait ms", "step ms ckpt/offl"],
            rows,
            f"hsoffload demo: tiny Llama ({result.layers} layers, batch {result.batch}, seq {result.seq}) on {result.device}",
        ),
        "",
        f"{result.peak_what}: checkpointing {fb(result.peak_plain)}, hsoffload {fb(result.peak_offload)}",
        f"saved-activation bytes on the device at peak: {fb(result.saved_peak_plain)} -> {fb(result.saved_peak_offload)} "
        f"(hidden states, layers x batch x seq x hidden: {fb(result.expected_hidden_bytes)}; "
        f"on host at peak: {fb(result.host_peak_offload)})",
        "losses and gradients bit-identical with and without offload: " + ("yes" if result.all_equal else "NO"),
    ]
    if result.plot:
        out.append(f"plot: {result.plot}")
    return "\n".join(out)
