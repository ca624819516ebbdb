"""The counters the engine exports, as typed Python records.

The engine defines each counter once (csrc/include/hsoffload/stats.h) and its ops return them by name; every
dataclass here lists the same names once, and `from_engine` refuses a library whose names differ (a build of another
version). Integrations derive their keys from `dataclasses.fields` of these classes, so a new counter is one line in
C++ and one line here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class OffloadStats:
    """Counters of one scope (`scope.stats`), or of the whole process (`hsoffload.process_stats()`)."""

    saved_tensors_seen: int = 0  # every tensor that reached pack
    marked_tensors: int = 0  # marks whose tensor reached pack (each mark once)
    offloaded_tensors: int = 0  # marked tensors whose bytes went to host (shared storage counts once)
    restored_tensors: int = 0  # unpacks of offloaded tensors
    skipped_marked_tensors: int = 0  # marked but kept in place (CPU, too small, empty, no plain storage)
    offloaded_bytes: int = 0  # bytes copied device -> host (or spilled)
    restored_bytes: int = 0  # bytes copied host -> device
    prefetch_hits: int = 0  # restores served by a prefetch issued earlier
    wait_ns: int = 0  # host time the hooks blocked: unpacks not prefetched, packs waiting for host budget
    pool_bytes: int = dataclasses.field(default=0, metadata={"snapshot": True})  # host pool bytes held now
    spilled_tensors: int = 0  # offloaded tensors whose copy went to spill_dir (oldest host copies first)
    spilled_bytes: int = 0  # their bytes (included in offloaded_bytes)
    spill_read_wait_ns: int = 0  # host time unpack waited for spilled tensors to be read back
    kept_on_device_tensors: int = 0  # over the host budget, left in place (no spill_dir, or no room in time)
    pack_wait_ns: int = 0  # host time packs waited for spill writes to free host budget (included in wait_ns)
    spill_write_errors: int = dataclasses.field(default=0, metadata={"snapshot": True})  # failed spill writes
    spilled_from_device_tensors: int = 0  # spilled straight from device memory: no host copy could make room
    captured_passthrough: int = 0  # marked tensors saved during a graph capture (CUDA graphs): left in place
    prefetch_oom: int = 0  # prefetches not started for lack of device memory (the unpack copied on demand)
    prefetch_dropped: int = 0  # prefetched blocks given back after an out-of-memory (a prefetch or a needed restore)
    host_alloc_failures: int = 0  # host (pinned) allocations that failed at pack (later packs of the entry: kept only)
    released_restores: int = 0  # prefetched or held restores given back when a graph task ended early / at exit
    side_use_holds: int = 0  # device blocks held until a side stream's copy of them completed (never tagged)


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """What the process-wide host pool holds (`hsoffload.pool_stats()`)."""

    held_bytes: int = 0
    in_use_bytes: int = 0
    cached_bytes: int = 0
    peak_held_bytes: int = 0
    allocations: int = 0  # slabs (and unpooled buffers) obtained from the allocator
    reuses: int = 0  # blocks served by existing slabs
    unpooled: int = 0
    acquires: int = 0  # blocks handed out
    slabs: int = 0  # slabs held now
    unpooled_bytes: int = 0  # unpooled blocks lent now (outside held_bytes)
    pinned_bytes: int = 0  # pinned bytes held for offload now: pinned slabs, unpooled blocks and spill staging
    staging_bytes: int = 0  # the spill tier's staging chunks (pinned ones count against an explicit pool limit)


@dataclasses.dataclass(frozen=True)
class BudgetStats:
    """The process-wide host budget (`max_host_bytes`): offloaded bytes resident in host memory."""

    limit: int = 0
    in_flight: int = 0
    peak: int = 0  # since the limit was last set
    refused: int = 0  # reservations that did not fit (a pack may try more than once: after spill writes freed room)
    is_auto: bool = True
    mem_available: int = 0  # what "auto" was computed from
    local_world_size: int = 1
    host_bytes: int = 0  # host bytes the pool holds now (slabs + unpooled blocks); pool_stats() tells the same


@dataclasses.dataclass(frozen=True)
class CpuMeterStats:
    """The CPU meter (`torch.ops.hsoffload.cpu_meter_stats()`): what the counting CPU allocator lent
    since it was installed (policy "auto" reads it when the device is the CPU)."""

    installed: bool = False
    allocated_bytes: int = dataclasses.field(default=0, metadata={"snapshot": True})  # lent now, the host pool's not
    peak_allocated_bytes: int = 0  # since the last reset
    host_bytes: int = dataclasses.field(default=0, metadata={"snapshot": True})  # lent now to the host pool, spill


@dataclasses.dataclass(frozen=True)
class SpillStats:
    """I/O counters of a scope's spill store (`scope.spill_stats()`; zeros without spill_dir)."""

    bytes_written: int = 0
    bytes_read: int = 0
    write_ns: int = 0
    read_ns: int = 0
    files: int = 0  # spill files open now
    direct_io: int = 0  # 1 if the store writes with O_DIRECT
    staging_bytes: int = 0  # host bytes of the I/O threads' staging chunks (2 x 8 MiB)


@dataclasses.dataclass(frozen=True)
class InitSkipStats:
    """Counters of one FSDP RAM-efficient load's record (`InitSkipRecord.stats()`)."""

    flagged_tensors: int = 0  # tensors whose init was skipped (a tensor listed twice counts twice)
    flagged_storages: int = 0  # distinct storages recorded
    flagged_bytes: int = 0  # their bytes
    dropped_writes: int = 0  # writes into them that init made and hsoffload dropped
    dropped_bytes: int = 0  # bytes those writes would have written
    live_storages: int = dataclasses.field(default=0, metadata={"snapshot": True})  # recorded storages alive now


def is_snapshot(field: "dataclasses.Field[Any]") -> bool:
    """A counter that reports a level now (bytes held), not a total that only grows: logged as is, never as a
    difference."""
    return bool(field.metadata.get("snapshot", False))


def names(cls: type) -> tuple[str, ...]:
    """The counter names of a stats class, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(cls))


def from_engine(cls: type[T], values: Mapping[str, Any]) -> T:
    """`cls` from what an engine op returned (a dict by counter name). Raises if the op library reports other
    counters than this package knows: the library and the package were built from different versions."""
    expected = names(cls)
    if set(values) != set(expected):
        raise RuntimeError(
            f"hsoffload: the op library reports the {cls.__name__} counters {sorted(values)}, this Python package "
            f"expects {sorted(expected)}; they come from different versions: rebuild and reinstall hsoffload "
            "(python -m pip install --no-build-isolation --no-deps . , or make install)"
        )
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    return cls(**{k: (bool(v) if types[k] in (bool, "bool") else int(v)) for k, v in values.items()})
