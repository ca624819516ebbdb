"""Agreement across ranks for policy "auto": every rank of a job applies one decision, from the same step on.

Under ZeRO-3 and FSDP a layer's recompute gathers its parameters (collectives), so ranks that checkpoint different
layers, or decide on different steps, fall out of step and hang. The controller (hsoffload.offload.auto) therefore
takes every input of a decision through `Ranks`: once per micro-batch the things that start a decision (the longest
batch, a rank's wish to decide again, whether an optimizer step starts, whether every rank is calibrated, and a
checksum of the controllers' states), at each decision the costs (the largest each rank measured), the room (the
smallest) and the fixed time, at a probe whether every rank probes, at the first step whether every rank reuses its
saved measurements. The chooser is deterministic, so equal inputs give one
decision on every rank.

The collectives run on the default process group: on the CPU where its backend takes CPU tensors (gloo, mpi), on the
model's device otherwise (nccl, ...). A process without torch.distributed, or with one rank, agrees with itself
and runs no collective.

Thread-safety: used on the thread that runs forward (the controller's), where the training loop's collectives run.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..collectives import all_reduce_values
from ..collectives import dist_ready as _dist_ready


class Ranks:
    """The ranks of the default process group, for small all-reduces of numbers (float64: bytes are exact below
    2**53)."""

    def __init__(self, device: torch.device) -> None:
        """`device`: the model's (the collectives run there unless the backend takes CPU tensors)."""
        self.size = torch.distributed.get_world_size() if _dist_ready() else 1
        self.rank = torch.distributed.get_rank() if _dist_ready() else 0
        self._device = torch.device("cpu")
        if self.size > 1:
            backend = str(torch.distributed.get_backend()).lower()
            if "gloo" not in backend and "mpi" not in backend and device.type != "cpu":
                self._device = device

    def _reduce(self, values: Sequence[float], op: "torch.distributed.ReduceOp") -> list[float]:
        if self.size == 1:
            return [float(v) for v in values]
        return all_reduce_values([float(v) for v in values], op, device=self._device)

    def max(self, values: Sequence[float]) -> list[float]:
        """Each value's largest over the ranks."""
        return self._reduce(values, torch.distributed.ReduceOp.MAX) if self.size > 1 else [float(v) for v in values]

    def min(self, values: Sequence[float]) -> list[float]:
        """Each value's smallest over the ranks."""
        return self._reduce(values, torch.distributed.ReduceOp.MIN) if self.size > 1 else [float(v) for v in values]

    def max_and_same(self, values: Sequence[float], same: Sequence[float]) -> tuple[list[float], bool]:
        """Each value's largest over the ranks, and whether every rank gave the same `same` values (checksums), in
        one all-reduce (the largest of each checksum and of its negation: equal everywhere iff they cancel)."""
        return self._and_same(self.max, values, same)

    def min_and_same(self, values: Sequence[float], same: Sequence[float]) -> tuple[list[float], bool]:
        """`max_and_same` with each value's smallest."""
        return self._and_same(self.min, values, same)

    @staticmethod
    def _and_same(reduce: Callable[[Sequence[float]], list[float]], values: Sequence[float],
                  same: Sequence[float]) -> tuple[list[float], bool]:
        n = len(values)
        out = reduce(list(values) + [v for x in same for v in (float(x), -float(x))])
        return out[:n], all(out[n + 2 * k] == -out[n + 2 * k + 1] for k in range(len(same)))
