"""The agreement primitive both multi-rank parts of the package share: whether torch.distributed runs, and a small
all-reduce of numbers (optionally bounded in time). Policy auto's `offload.ranks.Ranks` reduces its decision's
inputs with it; ZeRO-3 loading's status checks (`loading.zero3_collectives._agree`) make one rank's failure raise
on every rank with it. Imports torch; nothing of the package.

Thread-safety: call it on the thread that runs the job's other collectives (their order must match on every rank).
"""

from __future__ import annotations

import datetime
from typing import Any, Optional, Sequence

import torch


def dist_ready() -> bool:
    """Whether a default process group exists (torch.distributed built and initialized)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def all_reduce_values(values: Sequence[float], op: Any, *, device: torch.device, dtype: torch.dtype = torch.float64,
                      group: Any = None, timeout_s: Optional[float] = None) -> list[Any]:
    """`values` reduced with `op` over the ranks of `group` (default: the world), as one tensor of `dtype` on
    `device` (the CPU where the backend takes CPU tensors). `timeout_s`: wait that long at most, then raise what the
    wait raised (the caller says what it means); None waits as the backend does."""
    t = torch.tensor(list(values), dtype=dtype, device=device)
    if timeout_s is None:
        torch.distributed.all_reduce(t, op=op, group=group)
    else:
        work = torch.distributed.all_reduce(t, op=op, group=group, async_op=True)
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    return t.tolist()
