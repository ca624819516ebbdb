"""Process-wide host memory for offload: the host pool and the host budget, and the process's counters.

Thin readers and setters over the engine's process-wide ops (through the door, `hsoffload.engine`). The pool is the
pinned memory that holds host copies (bounded by the pool limit, `OffloadConfig.max_pool_bytes`); the budget bounds
the offloaded bytes resident in it (`max_host_bytes`), past which packs spill or stay on the device.
Thread-safety: the engine serialises every call. The state held here (the room left to other libraries such as
ZeRO-Offload, `set_host_room`, and the limit this module set as auto's resolution) is guarded by `_auto_lock`;
it is process-wide by intent, as the budget it feeds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from types import ModuleType
from typing import Optional, Union

import torch

from .. import engine
from .._logging import log_once
from ..options import AUTO_HOST_BUDGET_FRACTION, parse_bytes
from ..stats import BudgetStats, OffloadStats, PoolStats

logger = logging.getLogger("hsoffload")


def _engine() -> ModuleType:
    """The engine's process-wide functions: the door (`hsoffload.engine`), for callers that read its figures raw."""
    return engine


def process_stats() -> OffloadStats:
    """Counters summed over every scope in this process."""
    return engine.process_stats()


cumulative_stats = process_stats  # the name docs/usage.md used before process_stats


def pool_stats() -> PoolStats:
    """What the process-wide host pool holds now."""
    return engine.pool_stats()


def set_pool_limit(max_pool_bytes: int) -> None:
    """Bound the process-wide host pool (bytes); idle slabs over the limit are released (pinned ones to the system).
    By default the pool's bound follows the host budget (`max_host_bytes` plus the slab granularity's 1/16); an
    explicit bound stops that, and -1 makes it follow the budget again."""
    engine.set_pool_limit(int(max_pool_bytes))


def reserve_host(nbytes: Union[int, str], pinned: Optional[bool] = None) -> int:
    """Pin (allocate) `nbytes` of host memory in the process-wide pool now, before the first step, so that no pack
    pays for a pinned allocation (~0.1-0.3 s per GiB, and it stalls the device's streams). `nbytes`: bytes or a
    string such as "8GiB" (what `hsoffload plan` reports as host bytes). `pinned`: default, pinned iff an
    accelerator is available. Returns the pool's free bytes of that kind, which is less than asked only where the
    pool limit (`max_pool_bytes`) stops it (logged)."""
    value = parse_bytes(nbytes, "reserve_host")
    if value == "auto":
        raise ValueError("hsoffload.reserve_host: pass a number of bytes (or e.g. '8GiB'), not 'auto'")
    if pinned is None:
        pinned = bool(torch.accelerator.is_available()) if hasattr(torch, "accelerator") else False
    free = engine.reserve_host(int(value), bool(pinned))
    if free < int(value):
        logger.warning(
            "hsoffload: reserve_host(%d) got %d bytes: the host pool's limit (%d bytes, max_pool_bytes) stops it",
            int(value), free, engine.pool_limit(),
        )
    return free


def empty_pool() -> None:
    """Free every idle host buffer of the pool."""
    engine.empty_pool()


# ---------------------------------------------------------------------------------------------------------------
# The "auto" budget: 80 % of what MemAvailable at first use leaves once the host memory other libraries pin on the
# node's ranks (ZeRO-Offload's model states, `set_host_room`) is set aside, split between the ranks of the node -- the
# planner's host side (plan.HostSide) with MemAvailable for RAM. The engine computes 80 % of MemAvailable / the local
# size, which only the engine decides (csrc/local_size.cpp: HSOFFLOAD_LOCAL_WORLD_SIZE, then the launcher's
# variables); where room is left, the shim resolves "auto" itself from the engine's figures and sets that limit
# (remembered as auto's resolution).

# Launchers' names for this rank's index on the node: a rank that has one but no local size shares the node with
# others (warned once).
LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID")

_auto_lock = threading.Lock()  # guards _room_bytes and _auto_limit
_room_bytes = 0  # host bytes left to other libraries on this rank (set_host_room)
_auto_limit: Optional[int] = None  # the limit the shim set as auto's resolution (None: the engine's own auto)


def local_size() -> tuple[int, str]:
    """The number of ranks on this node and the variable it came from, as the engine decides it (the precedence is
    in docs/usage.md, "Host budget"), or (1, "") when no variable names it. Logs a warning once when this rank has a
    local rank but no local size: every rank then takes the whole node's share."""
    ranks, name = engine.local_size()
    if not name:
        held = [var for var in LOCAL_RANK_VARS if os.environ.get(var, "").strip()]
        if held:
            log_once(
                "local-size-missing",
                logging.WARNING,
                "hsoffload: this process has a local rank (%s) but no local size, so the auto host budget "
                "(max_host_bytes=auto) assumes it is alone on the node and may take 80%% of its RAM on every rank; "
                "set HSOFFLOAD_LOCAL_WORLD_SIZE (or LOCAL_WORLD_SIZE) to the number of ranks per node, or pass "
                "max_host_bytes explicitly",
                ", ".join(held),
            )
    return int(ranks), str(name)


def set_host_room(nbytes: Union[int, str]) -> None:
    """Leave `nbytes` of host memory per rank to another library that pins it, such as ZeRO-Offload's model states
    (hsoffload.integrations.deepspeed computes them): an "auto" budget resolved from now on is 80 % of MemAvailable
    less every local rank's room, split between them. Does not change an explicit max_host_bytes. Memory the library
    pinned before the budget is resolved is out of MemAvailable already and is then set aside twice (safe side)."""
    global _room_bytes
    value = parse_bytes(nbytes, "set_host_room")
    if value == "auto":
        raise ValueError("hsoffload.set_host_room: pass a number of bytes (or e.g. '8GiB'), not 'auto'")
    with _auto_lock:
        changed = _room_bytes != int(value)
        _room_bytes = int(value)
    if changed and (_auto_limit is not None or budget_stats().is_auto):
        set_host_budget("auto")  # resolved again at the next use, with the room


def host_room() -> int:
    """The bytes `set_host_room` leaves to other libraries on this rank."""
    return _room_bytes


def budget_stats() -> BudgetStats:
    """The process-wide host budget now (an "auto" limit is resolved by this call if it was not yet)."""
    stats = engine.budget_stats()
    with _auto_lock:
        ours = _auto_limit is not None and not stats.is_auto and stats.limit == _auto_limit
    if ours:
        return dataclasses.replace(stats, is_auto=True, local_world_size=local_size()[0])
    return stats


def set_host_budget(max_host_bytes: Union[int, str]) -> None:
    """Set the process-wide host budget now: bytes, or "auto" (recomputed from MemAvailable at its next use)."""
    global _auto_limit
    value = parse_bytes(max_host_bytes, "max_host_bytes")
    with _auto_lock:
        _auto_limit = None
    engine.set_host_budget(-1 if value == "auto" else int(value))


def _resolve_auto() -> BudgetStats:
    """Resolve an auto budget with the room left to others (see above); the engine's own figure without room."""
    global _auto_limit
    engine_stats = engine.budget_stats()  # resolves the engine's auto
    if not engine_stats.is_auto:
        return budget_stats()
    room = host_room()
    if room == 0:
        return engine_stats  # the engine's own figure is right
    local = engine_stats.local_world_size
    limit = max(0, int((engine_stats.mem_available - room * local) * AUTO_HOST_BUDGET_FRACTION) // local)
    engine.set_host_budget(limit)
    with _auto_lock:
        _auto_limit = limit
    return budget_stats()


def apply_host_budget(wanted: Union[int, str, None]) -> None:
    """What a scope entry does with its max_host_bytes. None keeps the budget as it is; "auto" keeps an auto limit
    resolved at first use (it is not recomputed each step, when MemAvailable already excludes what we offloaded)."""
    now = _resolve_auto()
    if wanted is None or wanted == "auto":
        if wanted == "auto" and not now.is_auto:
            set_host_budget("auto")
            now = _resolve_auto()
        if not now.is_auto:
            return
        local, name = local_size()
        log_once(
            "auto-budget",
            logging.INFO,
            "hsoffload: host budget max_host_bytes=auto: %.2f GiB = 80%% of MemAvailable %.2f GiB%s / %s %d",
            now.limit / 2**30,
            now.mem_available / 2**30,
            f" less {host_room() / 2**30:.2f} GiB per rank left to other host users (set_host_room)"
            if host_room()
            else "",
            name or "LOCAL_WORLD_SIZE (unset: no launcher variable names the local size)",
            local,
        )
    elif now.is_auto or now.limit != wanted:
        set_host_budget(wanted)
