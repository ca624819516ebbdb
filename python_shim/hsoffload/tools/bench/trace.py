"""`hsoffload bench --trace FILE`: one offloaded training step under torch.profiler, written as a Chrome/Perfetto
trace, and a per-layer timeline PNG of copies against compute drawn from it.

The engine marks its steps as profiler ranges (`hsoffload::pack`, `copy_to_host`, `spill`, `unpack`,
`copy_to_device`, `prefetch`, `wait_spill_read`, and on the I/O threads `spill_write`, `spill_read`); on a GPU the
trace also has the copy and compute kernels on their streams.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

import torch

from .. import workloads as common
from ...targets import enable_checkpointing

logger = logging.getLogger("hsoffload")

# Timeline rows: (label, predicate on a Chrome trace event)
_ROWS = (
    ("compute (device kernels)", lambda e: e.get("cat") == "kernel"),
    ("device -> host copies", lambda e: e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")),
    ("host -> device copies", lambda e: e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")),
    ("hsoffload::copy_to_host", lambda e: e.get("name") == "hsoffload::copy_to_host"),
    ("hsoffload::copy_to_device", lambda e: e.get("name") == "hsoffload::copy_to_device"),
    ("hsoffload::pack / unpack", lambda e: e.get("name") in ("hsoffload::pack", "hsoffload::unpack")),
    ("hsoffload::spill I/O", lambda e: e.get("name") in ("hsoffload::spill_write", "hsoffload::spill_read")),
    ("matmuls (CPU ops)", lambda e: e.get("cat") == "cpu_op" and e.get("name", "").startswith("aten::mm")),
)


def run(path: str, device: Optional[torch.device] = None, layers: int = 4, seq: int = 256) -> dict[str, Any]:
    """Profiles one step with hidden-state offload and writes the trace to `path`; returns what it saw."""
    import hsoffload
    from torch.profiler import ProfilerActivity, profile

    device = device or common.default_device()
    if device.type == "cpu":
        shape = common.tiny_llama(layers=layers, max_positions=max(4096, seq))
    else:
        shape = common.llama3_8b(layers=layers, max_seq=seq)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    # SDPA, as the GPU suite's model (eager attention's memory is quadratic in the length; the trace compares no bits).
    model = common.build_model(
        shape, seed=0, device=device, dtype=dtype, causal_lm=device.type == "cpu", attn_implementation="sdpa"
    )
    enable_checkpointing(model, {"use_reentrant": False})
    batch = common.make_batch(shape, 1, seq, seed=1, device=device, labels=device.type == "cpu")
    scope = hsoffload.offload_hidden_states(model, offload_cpu_tensors=device.type == "cpu", min_offload_size=0)
    common.train_step(model, batch, scope)  # warm-up: the traced step is a steady one
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        common.train_step(model, batch, scope)
        common.synchronize(device)
    prof.export_chrome_trace(path)
    names = sorted({e.name for e in prof.events() if e.name.startswith("hsoffload::")})
    return {"path": path, "device": str(device), "layers": layers, "seq": seq, "ranges": names}


def plot(trace_path: str, png_path: str, title: str = "") -> Optional[str]:
    """A timeline PNG of `trace_path`: one row per kind of work, copies against compute."""
    plt = common.pyplot("bench --trace")
    if plt is None:
        return None
    events = [e for e in json.loads(open(trace_path).read()).get("traceEvents", []) if e.get("ph") == "X"]
    rows = [(label, [e for e in events if pick(e)]) for label, pick in _ROWS]
    rows = [(label, evs) for label, evs in rows if evs]
    if not rows:
        logger.warning("hsoffload bench --trace: the trace has no events to draw")
        return None
    t0 = min(e["ts"] for _, evs in rows for e in evs)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.5))
    for i, (label, evs) in enumerate(rows):
        ax.broken_barh([((e["ts"] - t0) / 1e3, max(e.get("dur", 0), 1) / 1e3) for e in evs], (i - 0.4, 0.8))
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_xlabel("ms")
    ax.set_title(title or "one training step with hidden-state offload: copies against compute")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
