"""ZeRO-3 RAM-efficient loading (`hsoffload.zero3_loading`), `patch(verify=True)`: position-weighted checksums of
every partition a scatter wrote, gathered to group rank 0 and compared with its slice of the values it scattered.
Thread-safety: pure functions over the caller's tensors and collectives.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .zero3_collectives import Scratch, _add, _comm_device, _dist, _valid


_CHECKSUM_CHUNK = 1 << 22  # bytes per step: the int64 temporaries stay at 8x this (32 MiB)

_ADLER = 65521


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Position-weighted byte sums of `t` (int64[2], on its device): (sum of bytes, sum of byte * (index % 65521 + 1)).
    Exact (integer), independent of the values' dtype (NaN compares equal to itself), sensitive to moved bytes."""
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    out = torch.zeros(2, dtype=torch.int64, device=b.device)
    for start in range(0, b.numel(), _CHECKSUM_CHUNK):
        c = b[start:start + _CHECKSUM_CHUNK].to(torch.int64)
        w = torch.arange(start, start + c.numel(), dtype=torch.int64, device=b.device).remainder_(_ADLER).add_(1)
        out[0] += c.sum()
        out[1] += (c * w).sum()
    return out


@dataclasses.dataclass
class _VerifyBuffers:
    """The verification's buffers for `count` parameters, allocated before the scatters it follows: this rank's
    checksums (`local`), rank 0's gathered ones (`got`), and a zero checksum standing in for one a failed step did not
    compute (the gather still runs; the failure is raised at the status check)."""

    local: torch.Tensor
    got: Optional[list[torch.Tensor]]
    zero: torch.Tensor

    @staticmethod
    def allocate(count: int, world: int, is_src: bool, scratch: Scratch) -> "_VerifyBuffers":
        device = _comm_device()
        local = scratch(count * 2, torch.int64, device).view(count, 2).zero_()
        got = [scratch(count * 2, torch.int64, device).view(count, 2) for _ in range(world)] if is_src else None
        return _VerifyBuffers(local, got, scratch(2, torch.int64, device).zero_())


def _verify_partitions(labels: list[str], mine: list[torch.Tensor], expected: Optional[list[list[torch.Tensor]]],
                       src: int, group: Any, buffers: _VerifyBuffers) -> Optional[Exception]:
    """Gather every rank's partition checksums (`mine`, one per parameter) to group rank 0 (global rank `src`),
    which compares them with `expected[rank][i]`, the checksums of its slices of the full values it scattered.
    Returns rank 0's mismatch error, or the error of a local step (None when all match): the caller's status check
    raises it everywhere. The gather runs whatever failed here."""
    dist = _dist()
    world = dist.get_world_size(group=group)
    failure: Optional[Exception] = None
    try:
        for i, c in enumerate(mine):
            buffers.local[i].copy_(c)
    except Exception as e:  # noqa: BLE001
        failure = e
    _add(verified_params=len(mine))
    dist.gather(buffers.local, buffers.got, dst=src, group=group)
    if expected is None or buffers.got is None or failure is not None:
        return failure
    try:
        bad = []
        for r in range(world):
            for i in range(len(mine)):
                got, want = buffers.got[r][i], expected[r][i].to(buffers.got[r].device)
                if not torch.equal(got, want):
                    bad.append(f"{labels[i]} on group rank {r}: partition checksum {got.tolist()}, rank 0's slice "
                               f"{want.tolist()}")
    except Exception as e:  # noqa: BLE001
        return e
    if not bad:
        return None
    return RuntimeError(
        "hsoffload.zero3_loading: verify=True found partitions that differ from the values rank 0 scattered: "
        + "; ".join(bad[:8]) + (f" (and {len(bad) - 8} more)" if len(bad) > 8 else "")
        + ". This is a bug in the loading collectives (please report it with this message); unpatch() loads with "
        "DeepSpeed's own collectives meanwhile.")


def _slice_checksums(flat: torch.Tensor, part: int, world: int) -> list[torch.Tensor]:
    """Rank 0: the checksum of each rank's slice of `flat` (its valid elements, without padding)."""
    return [_checksum(flat[r * part:r * part + _valid(flat.numel(), part, r)]) for r in range(world)]
