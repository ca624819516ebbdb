"""The emulated asynchronous accelerator of the test suite, as torch device ``"hsemu"``.

``load()`` builds ``libhsoffload_emu.so`` (tests/device/emu/*.cpp, CMake option HSOFFLOAD_BUILD_EMU) against the running
torch if needed, loads it and registers it as PyTorch's PrivateUse1 backend named ``hsemu``. From then on the process
has an accelerator whose streams are worker threads, whose copies can be delayed and whose freed memory is poisoned
(NaN), so that a missing event wait or ``record_stream`` in hsoffload's engine shows up as wrong values. It becomes
the process's accelerator (``pin_memory()`` pins for it), so load it only in processes meant for it: the suite runs
tests/device/emu in a child pytest (tests/device/test_emu_device.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Iterator

import torch

logger = logging.getLogger("hsoffload.tests.emu")

ROOT = Path(__file__).resolve().parents[3]
DEVICE = "hsemu"
_STAT_FIELDS = (
    "async_copies", "sync_copies", "cross_stream_waits", "device_allocs", "device_reuses", "deferred_frees",
    "pinned_deferred_frees", "host_syncs", "job_errors", "allocated_bytes", "peak_allocated_bytes",
)
_loaded = False  # process-wide: a PrivateUse1 backend can be registered once


def _tool(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = shutil.which(name) or (str(beside) if beside.exists() else None)
    if found is None:
        raise RuntimeError(f"hsemu: {name} not found; install it (pip install {name}) to build the emulated device")
    return found


def build() -> Path:
    """Builds libhsoffload_emu.so for the running torch (incremental) and returns its path."""
    env_lib = os.environ.get("HSOFFLOAD_EMU_LIBRARY")
    if env_lib:
        return Path(env_lib)
    build_dir = ROOT / "build" / f"emu-{torch.__version__}"
    cmake = _tool("cmake")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    generator = ["-G", "Ninja"] if shutil.which("ninja", path=env["PATH"]) else []
    build_dir.mkdir(parents=True, exist_ok=True)
    # One build at a time: the suite's children (tests/device/test_emu_device.py) start side by side under xdist.
    with open(build_dir.parent / f"{build_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (build_dir / "CMakeCache.txt").exists():
            subprocess.run(
                [cmake, "-S", str(ROOT), "-B", str(build_dir), *generator, "-DHSOFFLOAD_BUILD_EMU=ON",
                 f"-DHSOFFLOAD_PYTHON={sys.executable}"],
                check=True, capture_output=True, text=True, env=env,
            )
        built = subprocess.run([cmake, "--build", str(build_dir), "--target", "hsoffload_emu"], capture_output=True,
                               text=True, env=env)
    if built.returncode != 0:
        raise RuntimeError(f"hsemu: building the emulated device failed:\n{built.stdout[-4000:]}{built.stderr[-4000:]}")
    return build_dir / "libhsoffload_emu.so"


def _device_module() -> types.ModuleType:
    """The `torch.hsemu` module PyTorch asks a PrivateUse1 backend for (autocast, seeding, device queries)."""
    mod = types.ModuleType("torch.hsemu")
    mod.is_available = lambda: True  # type: ignore[attr-defined]
    mod.is_initialized = lambda: True  # type: ignore[attr-defined]
    mod.device_count = lambda: 1  # type: ignore[attr-defined]
    mod.current_device = lambda: 0  # type: ignore[attr-defined]
    mod._is_in_bad_fork = lambda: False  # type: ignore[attr-defined]
    mod.manual_seed_all = lambda seed: None  # type: ignore[attr-defined]  (compute uses the CPU generator)
    mod.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]  # type: ignore[attr-defined]
    mod.synchronize = lambda device=None: synchronize()  # type: ignore[attr-defined]
    mod.is_current_stream_capturing = lambda: bool(torch.ops.hsemu.is_current_stream_capturing())  # type: ignore[attr-defined]
    # Memory queries under torch.cuda's names (what hsoffload's policy "auto" reads of a device).
    mod.memory_allocated = lambda device=None: stats()["allocated_bytes"]  # type: ignore[attr-defined]
    mod.max_memory_allocated = lambda device=None: stats()["peak_allocated_bytes"]  # type: ignore[attr-defined]
    mod.reset_peak_memory_stats = lambda device=None: reset_peak()  # type: ignore[attr-defined]
    # A caching allocator's reserved bytes: the emulated allocator caches nothing, so reserved is allocated plus the
    # slack a test sets (`reserved_slack`: a cache's unused blocks, fragmentation).
    mod.memory_reserved = lambda device=None: stats()["allocated_bytes"] + _reserved_slack[0]  # type: ignore[attr-defined]
    mod.max_memory_reserved = lambda device=None: stats()["peak_allocated_bytes"] + _reserved_slack[0]  # type: ignore[attr-defined]

    def mem_get_info(device: object = None) -> tuple[int, int]:
        total = int(torch.ops.hsemu.device_capacity())
        if total == 0:
            raise RuntimeError("hsemu: the device's capacity is unlimited (set_device_capacity sets one)")
        return total - stats()["allocated_bytes"] - _reserved_slack[0], total

    mod.mem_get_info = mem_get_info  # type: ignore[attr-defined]
    return mod


def load() -> None:
    """Builds (if needed) and registers the emulated device as ``hsemu`` in this process (idempotent)."""
    global _loaded  # the process-wide fact "the backend is registered"; it cannot be undone
    if _loaded:
        return
    library = build()
    torch.ops.load_library(str(library))
    torch.utils.rename_privateuse1_backend(DEVICE)
    torch._register_device_module(DEVICE, _device_module())
    _loaded = True
    logger.debug("hsemu: loaded %s", library)


def set_copy_delay(h2d_us: int, d2h_us: int, d2d_us: int) -> None:
    torch.ops.hsemu.set_copy_delay(h2d_us, d2h_us, d2d_us)


@contextlib.contextmanager
def _three_kinds(get: str, set_: Any, values: tuple[int, int, int]) -> Iterator[None]:
    """`set_(*values)` (h2d, d2h, d2d) inside the block, what `torch.ops.hsemu.<get>()` gave before it after it."""
    before = list(getattr(torch.ops.hsemu, get)())
    set_(*values)
    try:
        yield
    finally:
        set_(*before)


def copy_delay(h2d_us: int = 0, d2h_us: int = 0, d2d_us: int = 0) -> contextlib.AbstractContextManager[None]:
    """Delays every queued copy of each kind by that many microseconds inside the block."""
    return _three_kinds("copy_delay", set_copy_delay, (h2d_us, d2h_us, d2d_us))


def set_copy_rate(h2d_bytes_per_s: int, d2h_bytes_per_s: int, d2d_bytes_per_s: int) -> None:
    torch.ops.hsemu.set_copy_rate(h2d_bytes_per_s, d2h_bytes_per_s, d2d_bytes_per_s)


def copy_rate(h2d_bytes_per_s: int = 0, d2h_bytes_per_s: int = 0,
              d2d_bytes_per_s: int = 0) -> contextlib.AbstractContextManager[None]:
    """Inside the block a queued copy of n bytes also sleeps n / rate (0: unlimited): copy time proportional to
    bytes, as on a bus of that bandwidth."""
    return _three_kinds("copy_rate", set_copy_rate, (h2d_bytes_per_s, d2h_bytes_per_s, d2d_bytes_per_s))


@contextlib.contextmanager
def stream(stream_id: int) -> Iterator[None]:
    """Makes `stream_id` the current stream of this thread inside the block."""
    before = int(torch.ops.hsemu.current_stream())
    torch.ops.hsemu.set_stream(stream_id)
    try:
        yield
    finally:
        torch.ops.hsemu.set_stream(before)


def sleep(us: int) -> None:
    """Stalls the current stream: work queued after this runs `us` microseconds later."""
    torch.ops.hsemu.sleep(us)


def synchronize() -> None:
    torch.ops.hsemu.synchronize()


def new_stream() -> int:
    return int(torch.ops.hsemu.new_stream())


def stats() -> dict[str, int]:
    """Cumulative counters, and two gauges of the device allocator: ``allocated_bytes`` (live blocks, rounded to
    512 bytes as CUDA's allocator counts them) and ``peak_allocated_bytes`` (their high-water mark since
    `reset_peak`)."""
    return dict(zip(_STAT_FIELDS, (int(v) for v in torch.ops.hsemu.stats())))


def reset_peak() -> None:
    """Starts a new high-water mark at the bytes allocated now (like torch.cuda.reset_peak_memory_stats)."""
    torch.ops.hsemu.reset_peak()


@contextlib.contextmanager
def capture() -> Iterator[None]:
    """Emulated graph capture of the current stream inside the block; raises at its end if the block did what CUDA
    forbids during a capture (pinned allocation, captured-event queries, syncs, waits on outside events, a fork never
    joined back): the capture failed."""
    torch.ops.hsemu.begin_capture()
    try:
        yield
    finally:
        violations = list(torch.ops.hsemu.end_capture())
    if violations:
        raise RuntimeError("hsemu: graph capture failed: " + "; ".join(violations))


@contextlib.contextmanager
def event_fault() -> Iterator[None]:
    """Inside the block every event query and synchronize raises, as after a sticky device error (a device-side
    assert): the context is dead."""
    torch.ops.hsemu.set_event_fault(True)
    try:
        yield
    finally:
        torch.ops.hsemu.set_event_fault(False)


_reserved_slack = [0]  # bytes the device module reports reserved beyond allocated (set by reserved_slack)


@contextlib.contextmanager
def reserved_slack(nbytes: int) -> Iterator[None]:
    """Inside the block the device module's `memory_reserved` / `max_memory_reserved` report `nbytes` more than is
    allocated (what a caching allocator's cache and fragmentation add); nothing else changes."""
    before = _reserved_slack[0]
    _reserved_slack[0] = nbytes
    try:
        yield
    finally:
        _reserved_slack[0] = before


@contextlib.contextmanager
def device_capacity(nbytes: int) -> Iterator[None]:
    """Inside the block the device allocator hands out at most `nbytes` at once; beyond it raises OutOfMemoryError."""
    before = int(torch.ops.hsemu.device_capacity())
    torch.ops.hsemu.set_device_capacity(nbytes)
    try:
        yield
    finally:
        torch.ops.hsemu.set_device_capacity(before)


def is_high_priority(stream_id: int) -> bool:
    return bool(torch.ops.hsemu.is_high_priority(stream_id))


@contextlib.contextmanager
def pinned_alloc_fault() -> Iterator[None]:
    """Inside the block every pinned host allocation raises (pinned memory exhausted)."""
    torch.ops.hsemu.set_pinned_alloc_fault(True)
    try:
        yield
    finally:
        torch.ops.hsemu.set_pinned_alloc_fault(False)
