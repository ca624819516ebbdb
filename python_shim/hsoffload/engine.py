"""The one door from Python to the compiled extension (libhsoffload.so): every `torch.ops.hsoffload` op and
`torch.classes.hsoffload` class the package uses is reached through the typed functions and the two classes here
(`EngineScope`, `InitSkipRecord`), and no other module names them (tests/tools/test_engine_door.py). The schemas and
their argument names are in docs/ops.md.

Importing it loads the op library (`_loader.load_library`), so only the offload and loading wings import it: the
planner and `import hsoffload` stay free of torch. Process-wide counters come back as the dataclasses of `stats.py`;
the classes' methods mirror the custom classes one for one (their stats are the engine's `Dict(str, int)`, which
`stats.from_engine` names). Thread-safety: the engine serialises every call; nothing here holds state of its own.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ._loader import load_library
from .stats import BudgetStats, CpuMeterStats, OffloadStats, PoolStats, from_engine

load_library()

_ops = torch.ops.hsoffload
_classes = torch.classes.hsoffload

# The saved-tensor hooks' ops, the overloads themselves rather than wrappers: the hooks call them once per saved
# tensor, where a Python frame around each would be a measurable share of the cost (docs/ops.md).
offload_pack: Callable[..., torch.Tensor] = _ops.offload_pack.default
"""`offload_pack(Tensor x, int scope=-1, bool capturing=False) -> Tensor`: the pack hook (a handle tensor)."""
offload_unpack: Callable[[torch.Tensor], torch.Tensor] = _ops.offload_unpack.default
"""`offload_unpack(Tensor handle) -> Tensor`: the unpack hook (bit-identical to what was packed)."""
mark_hidden_state: Callable[[torch.Tensor], torch.Tensor] = _ops.mark_hidden_state.default
"""`mark_hidden_state(Tensor(a!) x) -> Tensor(a!)`: marks x in this thread's current scope; returns x."""


class EngineScope:
    """One engine offload scope (`torch.classes.hsoffload.OffloadScope`, docs/ops.md "Classes"): configuration,
    marks and counters. `hsoffload.OffloadScope` (the Python context manager) owns one."""

    __slots__ = ("_obj",)

    def __init__(self, **options: object) -> None:
        """`options`: the engine options of the table in options.py, by name (`OffloadConfig.engine_kwargs()`)."""
        self._obj = _classes.OffloadScope(**options)

    def enter(self) -> None:
        """Makes the scope this thread's current one (refused while it is active)."""
        self._obj.enter()

    def exit(self) -> None:
        """Leaves the scope (on the entering thread, innermost first)."""
        self._obj.exit()

    def active(self) -> bool:
        return bool(self._obj.active())

    def id(self) -> int:
        """The process-unique id `offload_pack` takes as `scope`."""
        return int(self._obj.id())

    def mark(self, x: torch.Tensor) -> None:
        """Marks `x` in this scope (from any thread)."""
        self._obj.mark(x)

    def is_marked(self, x: torch.Tensor) -> bool:
        """Whether a pack of `x` now would find a mark (x itself or an alias of the same view and version)."""
        return bool(self._obj.is_marked(x))

    def begin_group(self) -> None:
        """Packs from now until `end_group` form one prefetch group (a decoder layer's tensors)."""
        self._obj.begin_group()

    def end_group(self) -> None:
        self._obj.end_group()

    def release_restores(self) -> None:
        """Gives back restores held for unpacks that may never come (a backward graph task that ended early)."""
        self._obj.release_restores()

    def stats(self) -> dict[str, int]:
        """This scope's counters by name (`HSOFFLOAD_OFFLOAD_STATS`; `stats.OffloadStats` names them)."""
        return dict(self._obj.stats())

    def offloaded(self) -> tuple[int, int]:
        """This scope's offloaded_tensors and offloaded_bytes alone (read at every decoder layer's start and end)."""
        tensors, nbytes = self._obj.offloaded()
        return int(tensors), int(nbytes)

    def spill_stats(self) -> dict[str, int]:
        """The scope's spill store's counters by name (`HSOFFLOAD_SPILL_STATS`; zeros without spill_dir)."""
        return dict(self._obj.spill_stats())

    def first_host_alloc_error(self) -> str:
        """What the scope's first failed host allocation raised ("" if none)."""
        return str(self._obj.first_host_alloc_error())

    def set_prefetch_depth(self, depth: int) -> None:
        """Host-copy groups restored ahead of backward from now on."""
        self._obj.set_prefetch_depth(int(depth))

    def prefetch_depth(self) -> int:
        return int(self._obj.prefetch_depth())

    def tracked_state(self) -> int:
        """Marks and records this scope still tracks (0 once graphs are freed)."""
        return int(self._obj.tracked_state())


class InitSkipRecord:
    """One RAM-efficient load's record (`torch.classes.hsoffload.InitSkipRecord`, docs/ops.md): the storages this
    process must not initialise, the writes into them that were dropped, the last skip decision."""

    __slots__ = ("_obj",)

    def __init__(self) -> None:
        self._obj = _classes.InitSkipRecord()

    def is_flagged(self, t: torch.Tensor) -> bool:
        """Whether `t` shares storage with a recorded tensor that is still alive."""
        return bool(self._obj.is_flagged(t))

    def note_dropped_write(self, nbytes: int) -> None:
        """Counts a write the caller dropped (`nbytes >= 0`)."""
        self._obj.note_dropped_write(int(nbytes))

    def stats(self) -> dict[str, int]:
        """The record's counters by name (`HSOFFLOAD_INIT_SKIP_STATS`; `stats.InitSkipStats` names them)."""
        return dict(self._obj.stats())

    def skip(self) -> bool:
        """The last decision: whether this process skips init."""
        return bool(self._obj.skip())

    def reason(self) -> str:
        """Why (the last decision, in words)."""
        return str(self._obj.reason())

    def clear(self) -> None:
        self._obj.clear()


def skip_init_non_rank0(tensors: Sequence[torch.Tensor], rank: int, local_rank: int, fsdp_enabled: bool,
                        cpu_ram_efficient_loading: bool, record: Optional[InitSkipRecord] = None) -> list[bool]:
    """FSDP RAM-efficient loading: per tensor, whether this process skips initialising it (recorded in `record`)."""
    flags = _ops.skip_init_non_rank0(list(tensors), int(rank), int(local_rank), bool(fsdp_enabled),
                                     bool(cpu_ram_efficient_loading), None if record is None else record._obj)
    return [bool(f) for f in flags]


def skip_init_zero3(tensors: Sequence[torch.Tensor], group_rank: int, zero3_enabled: bool,
                    record: Optional[InitSkipRecord] = None) -> list[bool]:
    """ZeRO-3 RAM-efficient loading: per tensor, whether this process receives only its partition (skips init)."""
    flags = _ops.skip_init_zero3(list(tensors), int(group_rank), bool(zero3_enabled),
                                 None if record is None else record._obj)
    return [bool(f) for f in flags]


def lazy_zeros_like(like: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor of `like`'s shape and dtype that reads as zeros and holds no resident memory until
    written (`like` may be on meta)."""
    return _ops.lazy_zeros_like(like)


# ------------------------------------------------------------------------------------------ process-wide functions


def process_stats() -> OffloadStats:
    """Every scope's counters summed over the process (`pool_bytes`: the pool's now)."""
    return from_engine(OffloadStats, _ops.process_stats())


def pool_stats() -> PoolStats:
    """What the process-wide host pool holds now."""
    return from_engine(PoolStats, _ops.pool_stats())


def set_pool_limit(max_bytes: int) -> None:
    """Bounds the host pool's held bytes (>= 0; -1: follow the host budget again, as by default)."""
    _ops.set_pool_limit(int(max_bytes))


def pool_limit() -> int:
    """The host pool's bound now, in bytes."""
    return int(_ops.pool_limit())


def empty_pool() -> None:
    """Frees every idle slab of the host pool (and the accelerator's cached pinned blocks)."""
    _ops.empty_pool()


def reserve_host(nbytes: int, pinned: bool) -> int:
    """Makes `nbytes` free in the pool now (pinned: for accelerator copies); returns the pool's free bytes of that
    kind, less than asked only where the pool limit stops it."""
    return int(_ops.reserve_host(int(nbytes), bool(pinned)))


def set_host_budget(max_bytes: int) -> None:
    """The process-wide host budget: bytes >= 0, or -1 for auto (80 % of MemAvailable / the local size)."""
    _ops.set_host_budget(int(max_bytes))


def budget_stats() -> BudgetStats:
    """The engine's host budget now (an auto limit is resolved by the first call)."""
    return from_engine(BudgetStats, _ops.budget_stats())


def local_size() -> tuple[int, str]:
    """The ranks on this node and the variable that said so ("" when none did), as the engine decides it."""
    ranks, name = _ops.local_size()
    return int(ranks), str(name)


def cpu_meter_install() -> bool:
    """Installs the CPU meter (idempotent); False if another allocator keeps its place."""
    return bool(_ops.cpu_meter_install())


def cpu_meter_stats() -> CpuMeterStats:
    """What the CPU meter counted (what the CPU allocator lent since it was installed, and its peak)."""
    return from_engine(CpuMeterStats, _ops.cpu_meter_stats())


def cpu_meter_reset_peak() -> None:
    """The CPU meter's peak := what it has lent now."""
    _ops.cpu_meter_reset_peak()


def engine_detects_capture() -> bool:
    """True where the engine tells graph capture itself (torch >= 2.13); else the pack hook passes `capturing`."""
    return bool(_ops.engine_detects_capture())


def side_streams(device: torch.device) -> list[int]:
    """The ids of the process's device->host and host->device side streams on the accelerator `device`."""
    return [int(s) for s in _ops.side_streams(device)]
