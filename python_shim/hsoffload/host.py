"""Process-wide host memory for offload: the host pool and the host budget, and the process's counters.

Thin readers and setters over the engine's static ops (`torch.classes.hsoffload.OffloadScope.*`). The pool is the
pinned memory that holds host copies (bounded by the pool limit, `OffloadConfig.max_pool_bytes`); the budget bounds
the offloaded bytes resident in it (`max_host_bytes`), past which packs spill or stay on the device.
Thread-safety: the engine serialises every call; nothing here holds state of its own.
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch

from ._logging import log_once
from .config import parse_bytes
from .stats import BudgetStats, OffloadStats, PoolStats, from_engine

logger = logging.getLogger("hsoffload")


def _engine() -> type:
    return torch.classes.hsoffload.OffloadScope


def process_stats() -> OffloadStats:
    """Counters summed over every scope in this process."""
    return from_engine(OffloadStats, _engine().process_stats())


cumulative_stats = process_stats  # the name docs/usage.md used before process_stats


def pool_stats() -> PoolStats:
    """What the process-wide host pool holds now."""
    return from_engine(PoolStats, _engine().pool_stats())


def set_pool_limit(max_pool_bytes: int) -> None:
    """Bound the process-wide host pool (bytes); idle slabs over the limit are released (pinned ones to the system).
    By default the pool's bound follows the host budget (`max_host_bytes` plus the slab granularity's 1/16); an
    explicit bound stops that, and -1 makes it follow the budget again."""
    _engine().set_pool_limit(int(max_pool_bytes))


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
    free = int(_engine().reserve_host(int(value), bool(pinned)))
    if free < int(value):
        logger.warning(
            "hsoffload: reserve_host(%d) got %d bytes: the host pool's limit (%d bytes, max_pool_bytes) stops it",
            int(value), free, int(_engine().pool_limit()),
        )
    return free


def empty_pool() -> None:
    """Free every idle host buffer of the pool."""
    _engine().empty_pool()


def budget_stats() -> BudgetStats:
    """The process-wide host budget now (an "auto" limit is resolved by this call if it was not yet)."""
    return from_engine(BudgetStats, _engine().budget_stats())


def set_host_budget(max_host_bytes: Union[int, str]) -> None:
    """Set the process-wide host budget now: bytes, or "auto" (recomputed from MemAvailable now)."""
    value = parse_bytes(max_host_bytes, "max_host_bytes")
    _engine().set_host_budget(-1 if value == "auto" else int(value))


def apply_host_budget(wanted: Union[int, str, None]) -> None:
    """What a scope entry does with its max_host_bytes. None keeps the budget as it is; "auto" keeps an auto limit
    resolved at first use (it is not recomputed each step, when MemAvailable already excludes what we offloaded)."""
    now = budget_stats()
    if wanted is None or wanted == "auto":
        if wanted == "auto" and not now.is_auto:
            set_host_budget("auto")
            now = budget_stats()
        if not now.is_auto:
            return
        log_once(
            "auto-budget",
            logging.INFO,
            "hsoffload: host budget max_host_bytes=auto: %.2f GiB = 80%% of MemAvailable %.2f GiB / "
            "LOCAL_WORLD_SIZE %d",
            now.limit / 2**30,
            now.mem_available / 2**30,
            now.local_world_size,
        )
    elif now.is_auto or now.limit != wanted:
        set_host_budget(wanted)
