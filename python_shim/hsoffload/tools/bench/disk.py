"""`hsoffload bench --suite disk`: the spill tier against the file system it spills to, in one run.

1. The file system alone: sequential write (fsync'd when buffered) and read of the same bytes in 8 MiB blocks, with
   O_DIRECT when the file system accepts it (as the spill tier does), else buffered (the page cache may then
   serve the reads: the table says which).
2. The spill tier: the same bytes as 64 MiB saved tensors, packed with max_host_bytes=0 (everything spills);
   write GB/s = bytes / time until the I/O threads have written them all; read GB/s = bytes / time to unpack
   them all in reverse order (read-back prefetch on).
3. Hidden behind compute: the same unpacks with a matmul between them that takes about as long as one read;
   hidden = 1 - (unpack wait with compute) / (read time without compute).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from typing import Any, Optional

import torch

from .. import workloads as common

_BLOCK = 8 << 20
_TENSOR = 64 << 20


def _fs_sequential(directory: str, tensors: list[torch.Tensor]) -> dict[str, Any]:
    """Sequential write (the same bytes the spill tier writes: a storage layer that compresses or dedupes would
    flatter a synthetic pattern) and read of one file in 8 MiB blocks through one aligned buffer."""
    import fcntl

    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    flat = [t.view(torch.uint8).reshape(-1) for t in tensors]
    buf = mmap.mmap(-1, _BLOCK)  # page-aligned: O_DIRECT needs aligned buffers
    view = torch.frombuffer(buf, dtype=torch.uint8)
    fd, path = tempfile.mkstemp(dir=directory, prefix=".hsoffload-bench-")
    os.unlink(path)
    direct = True
    try:
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)  # type: ignore[attr-defined]
            os.pwrite(fd, buf, 0)
        except (OSError, AttributeError):
            direct = False
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~getattr(os, "O_DIRECT", 0))
        t0 = time.perf_counter()
        for off in range(0, nbytes, _BLOCK):
            chunk = flat[off // _TENSOR]
            view.copy_(chunk[off % _TENSOR : off % _TENSOR + _BLOCK])
            os.pwrite(fd, buf, off)
        if not direct:
            os.fsync(fd)  # buffered: count the page cache's write-back too (O_DIRECT writes, like the spill's, need none)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for off in range(0, nbytes, _BLOCK):
            os.preadv(fd, [buf], off)
        read_s = time.perf_counter() - t0
    finally:
        del view
        os.close(fd)
        buf.close()
    return {"direct_io": direct, "write_gbps": nbytes / write_s / 1e9, "read_gbps": nbytes / read_s / 1e9}


def _first_touch_gbps(nbytes: int) -> float:
    """Fresh host memory, allocated and written once: what a restore to a CPU destination pays on top of the read."""
    t0 = time.perf_counter()
    for _ in range(nbytes // _TENSOR):
        torch.empty(_TENSOR, dtype=torch.uint8).fill_(1)
    return nbytes / (time.perf_counter() - t0) / 1e9


def _spill_pass(directory: str, tensors: list[torch.Tensor], compute_s: float) -> dict[str, Any]:
    import hsoffload
    from ... import engine  # noqa: PLC0415  (loads the op library: only when this suite runs)

    total = sum(t.numel() * t.element_size() for t in tensors)
    a = torch.randn(256, 256)
    scope = hsoffload.OffloadScope(
        offload_cpu_tensors=True, min_offload_size=0, max_host_bytes=0, spill_dir=directory, spill_prefetch_depth=2
    )
    with scope:
        io0 = scope.spill_stats()  # the store is shared by every scope spilling there: count from here
        t0 = time.perf_counter()
        handles = []
        for t in tensors:
            scope.mark(t)
            handles.append(engine.offload_pack(t, scope.id))
        if scope.stats.spilled_bytes < total:
            raise RuntimeError("hsoffload bench: the disk suite expected every tensor to spill")
        while scope.spill_stats()["bytes_written"] < io0["bytes_written"] + total:
            time.sleep(0.0005)
            if time.perf_counter() - t0 > 600:
                raise RuntimeError("hsoffload bench: spill writes did not finish within 600 s")
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for h in reversed(handles):
            out = engine.offload_unpack(h)
            del out
            if compute_s > 0:
                end = time.perf_counter() + compute_s
                while time.perf_counter() < end:
                    a = torch.tanh(a @ a)
        read_wall_s = time.perf_counter() - t0
        stats = scope.stats
        io = scope.spill_stats()
    del handles
    return {
        "bytes": total,
        "write_s": write_s,
        "read_wall_s": read_wall_s,
        "read_io_s": (io["read_ns"] - io0["read_ns"]) / 1e9,
        "wait_s": stats.spill_read_wait_ns / 1e9,
        "direct_io": bool(io["direct_io"]),
    }


def run(spill_dir: Optional[str], mib: int, quick: bool, repeats: Optional[int] = None) -> dict[str, Any]:
    base = spill_dir or os.environ.get("HSOFFLOAD_SPILL_DIR") or tempfile.gettempdir()
    nbytes = max(_TENSOR, (128 if quick else mib) << 20) // _TENSOR * _TENSOR
    repeats = repeats or (1 if quick else 3)
    fs_runs, bare_runs = [], []
    with tempfile.TemporaryDirectory(dir=base, prefix="hsoffload-disk-bench-") as directory:
        tensors = [torch.randn(_TENSOR // 4) for _ in range(nbytes // _TENSOR)]
        # Alternate file system and spill passes: a shared (virtual) disk drifts over seconds, and the ratio of
        # medians of interleaved runs is what is comparable.
        for _ in range(repeats):
            fs_runs.append(_fs_sequential(directory, tensors))
            bare_runs.append(_spill_pass(directory, tensors, compute_s=0.0))
        per_read = common.median([b["read_io_s"] for b in bare_runs]) / len(tensors)
        busy = _spill_pass(directory, tensors, compute_s=per_read)
        touch = _first_touch_gbps(nbytes)
    fs = {
        "direct_io": fs_runs[0]["direct_io"],
        "write_gbps": common.median([r["write_gbps"] for r in fs_runs]),
        "read_gbps": common.median([r["read_gbps"] for r in fs_runs]),
    }
    spill_write = common.median([nbytes / b["write_s"] / 1e9 for b in bare_runs])
    spill_read = common.median([nbytes / b["read_wall_s"] / 1e9 for b in bare_runs])
    read_io = common.median([b["read_io_s"] for b in bare_runs])
    hidden = 1.0 - busy["wait_s"] / read_io if read_io > 0 else float("nan")
    return {
        "environment": common.environment(),
        "directory": base,
        "bytes": nbytes,
        "repeats": repeats,
        "fs": fs,
        "fs_runs": fs_runs,
        "spill": {"write_gbps": spill_write, "read_gbps": spill_read, "direct_io": bare_runs[0]["direct_io"]},
        "spill_runs": bare_runs,
        "write_ratio": spill_write / fs["write_gbps"],
        "read_ratio": spill_read / fs["read_gbps"],
        "goal": 0.8,
        "compute_between_reads_s": per_read,
        "hidden_fraction": max(0.0, min(1.0, hidden)),
        "busy": busy,
        "first_touch_gbps": touch,
    }


def report(r: dict[str, Any]) -> str:
    ff = common.fmt_float
    fs, sp = r["fs"], r["spill"]
    rows = [
        ["file system alone", "O_DIRECT" if fs["direct_io"] else "buffered", ff(fs["write_gbps"]), ff(fs["read_gbps"])],
        ["hsoffload spill", "O_DIRECT" if sp["direct_io"] else "buffered", ff(sp["write_gbps"]), ff(sp["read_gbps"])],
        ["spill / file system", "", ff(r["write_ratio"]), ff(r["read_ratio"])],
    ]
    title = (
        f"Spill tier vs the file system of {r['directory']}, {common.fmt_bytes(r['bytes'])} in 64 MiB tensors, "
        f"medians of {r['repeats']} interleaved runs (goal >= {r['goal']}x)"
    )
    text = common.table(["", "I/O", "write GB/s", "read GB/s"], rows, title)
    text += (
        f"\nFresh host memory, first touch: {ff(r['first_touch_gbps'])} GB/s (a restore to a CPU destination pays "
        f"this on top of the read; a GPU destination is device memory)"
        f"\nRead-back hidden behind compute: {r['hidden_fraction'] * 100:.0f}% (a {r['compute_between_reads_s'] * 1e3:.1f} ms "
        f"matmul loop between unpacks; unpack waited {r['busy']['wait_s'] * 1e3:.1f} ms in all)"
    )
    return text
