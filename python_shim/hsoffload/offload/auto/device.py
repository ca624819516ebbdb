"""The device as policy auto measures it: its allocator's figures (`DeviceMemory`), a copy's time to the host and
back, the default budget, and the probe's forked RNG."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Callable, Iterator, Optional

import torch

from ... import engine
from ..._logging import log_once

logger = logging.getLogger("hsoffload")


BUDGET_FRACTION = 0.95  # without device_budget: at most this share of the device's memory
HEADROOM_FRACTION = 0.02  # without device_budget: this share of the device left free beside what the process holds


def default_budget(total: int, outside: Optional[int] = None) -> int:
    """The device budget without device_budget (the one rule, docs/usage.md): at most BUDGET_FRACTION of the
    device's memory, and at most that memory less what the process holds outside the allocator (`outside`, known
    after full steps: the CUDA context, communicators' buffers; other processes too) less HEADROOM_FRACTION of it."""
    budget = int(total * BUDGET_FRACTION)
    if outside is not None:
        budget = min(budget, int(total - outside - total * HEADROOM_FRACTION))
    return budget
COPY_REPEATS = 3  # a probe's copy time: the fastest of this many round trips of the layer's input


class DeviceMemory:
    """The allocator's figures for one device, by torch.cuda's names on the device's module (torch.cuda, or an
    out-of-tree backend's module that has them); None where it has none. A CPU device reads hsoffload's CPU meter
    (a counting allocator in front of the CPU allocator, installed here): what it lent since, the host pool's copies
    not counted."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._mod = getattr(torch, device.type, None) if device.type != "cpu" else None
        self._meter = False  # True: a CPU device, counted by hsoffload's CPU meter
        self._timing = self._events_time()  # decided steps are then timed by events, without a synchronize
        if device.type == "cpu":
            if engine.cpu_meter_install():
                self._meter = True
                log_once("auto-cpu-meter", logging.INFO, "hsoffload: policy auto on the CPU: memory is counted by "
                         "hsoffload's counting CPU allocator from now on (what was allocated before is not counted; "
                         "offloaded copies are host memory, not the device's)")

    def _call(self, name: str, *args: Any) -> Any:
        fn = getattr(self._mod, name, None)
        return fn(*args) if fn is not None else None

    def allocated(self) -> Optional[int]:
        if self._meter:
            return int(engine.cpu_meter_stats().allocated_bytes)
        return self._call("memory_allocated", self.device)

    def peak(self) -> Optional[int]:
        if self._meter:
            return int(engine.cpu_meter_stats().peak_allocated_bytes)
        return self._call("max_memory_allocated", self.device)

    def reserved_peak(self) -> Optional[int]:
        """The caching allocator's reserved high-water mark (what the device really gives the process's tensors:
        allocated plus the cache's unused blocks); None where the device keeps no such figure (the CPU meter)."""
        if self._meter:
            return None
        return self._call("max_memory_reserved", self.device)

    def outside_allocator(self) -> Optional[int]:
        """Device bytes in use that the allocator does not hold (the CUDA context, communicators' buffers, other
        processes): used minus reserved; None where unknown."""
        if self._meter:
            return None
        try:
            info = self._call("mem_get_info", self.device)
        except RuntimeError:
            return None
        reserved = self._call("memory_reserved", self.device)
        if info is None or reserved is None:
            return None
        return max(0, int(info[1]) - int(info[0]) - int(reserved))

    def empty_cache(self) -> None:
        """Give the allocator's unused cached blocks back (where it caches), so that the reserved peak that follows
        is the coming steps' own."""
        if not self._meter:
            self._call("empty_cache")

    def reset_peak(self) -> None:
        if self._meter:
            engine.cpu_meter_reset_peak()
        else:
            self._call("reset_peak_memory_stats", self.device)

    def total(self) -> Optional[int]:
        try:
            info = self._call("mem_get_info", self.device)
        except RuntimeError:
            return None
        return None if info is None else int(info[1])

    def synchronize(self) -> None:
        """Wait for everything queued on the device (every stream)."""
        if self._mod is not None:
            self._call("synchronize", self.device)

    def timing_event(self) -> Optional[Any]:
        """An event recorded now on the current stream, that times (None on the CPU, or where the device's events do
        not: then times are host clocks after a synchronize)."""
        if self._mod is None or not self._timing:
            return None
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def _events_time(self) -> bool:
        """Whether the device's events measure elapsed time (asked once: record two, wait, read)."""
        if self._mod is None:
            return False
        try:
            a = torch.Event(device=self.device, enable_timing=True)
            b = torch.Event(device=self.device, enable_timing=True)
            a.record()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) >= 0.0
        except (RuntimeError, TypeError, NotImplementedError):
            return False

    def synchronize_compute(self) -> None:
        """Wait for the current stream only (compute), not the side streams' copies: a layer's compute time."""
        if self._mod is not None:
            event = torch.Event(device=self.device)
            event.record()
            event.synchronize()


def copy_time_s(x: torch.Tensor, sync_time: Callable[[], float], repeats: int = COPY_REPEATS) -> float:
    """One direction of a copy of `x` to pinned host memory and back (the slower), each direction the fastest of
    `repeats` round trips: the link's speed is what the copies can reach; a copy measured while its thread waited
    for a core (a busy host) or behind another process's transfer is slower, never faster."""
    pin = x.device.type != "cpu"
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=pin)
    back = torch.empty_like(x)
    out_s, in_s = math.inf, math.inf
    for _ in range(repeats):
        t0 = sync_time()
        host.copy_(x.detach(), non_blocking=pin)
        t1 = sync_time()
        back.copy_(host, non_blocking=pin)
        t2 = sync_time()
        out_s, in_s = min(out_s, t1 - t0), min(in_s, t2 - t1)
    return max(out_s, in_s)


@contextlib.contextmanager
def _forked_rng(device: torch.device) -> Iterator[None]:
    """The CPU generator, and the device's where its module has one, as they were after the block (the probe's
    dropout must not move the step's)."""
    mod = getattr(torch, device.type, None)
    if device.type != "cpu" and mod is not None and hasattr(mod, "get_rng_state"):
        with torch.random.fork_rng(devices=[device], device_type=device.type):
            yield
    else:
        with torch.random.fork_rng(devices=[]):
            yield
