"""What a training process holds on the device beyond its tensors, as named terms: what turns the tensors' peak into
what the process reserves (what `nvidia-smi` shows), which is what must fit the device.

Each term's default comes with its source; `--overhead-gib` replaces the fixed terms' sum (context, workspaces,
communicators, ZeRO-3 buckets) and `--fragmentation` the allocator's margin. Stdlib only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

from .memory import ModelShape, Setup, peak
from .settings import FRAGMENTATION, PlanError  # the caching allocator's reserved-but-unallocated share of the peak

MIB = 1 << 20
GIB = 1 << 30

# Defaults, each with its source (docs/usage.md, "What the process holds beyond its tensors").
CUDA_CONTEXT = GIB // 2  # the CUDA context with lazy module loading: 0.3-0.5 GB in nvidia-smi; the upper end
CUBLAS_WORKSPACE = 32 * MIB  # torch's cuBLAS workspace per handle on Hopper (4,096 KiB x 8); one per thread
CUBLAS_HANDLES = 2  # the forward thread's and autograd's backward device thread's
NCCL_COMMUNICATOR = 1_060_000_000  # one communicator's buffers before an all-to-all (NVIDIA/nccl #1685: 1.06 GB)
NCCL_ALL_TO_ALL = 4_340_000_000  # the same communicator after its first all-to-all on 8 x H100 (#1685: 4.34 GB)
# DeepSpeed's defaults when a ZeRO-3 config leaves them unset (deepspeed/runtime/zero/config.py), in elements.
ZERO3_REDUCE_BUCKET = 500_000_000
ZERO3_PREFETCH_BUCKET = 50_000_000


@dataclasses.dataclass(frozen=True)
class Overhead:
    """How the process's overhead is counted for one plan (from PlanInput, checked there)."""

    fixed_bytes: Optional[int] = None  # --overhead-gib: replaces the fixed terms' sum
    fragmentation: float = FRAGMENTATION
    zero3_bucket_elements: int = 0  # ZeRO-3's reduce and prefetch buckets (0: no ZeRO-3 config given)


def communicators(s: Setup) -> dict[str, int]:
    """The NCCL communicators the step uses and what each holds: the data-parallel group (FSDP's all-gather and
    reduce-scatter, or DDP's all-reduce), Ulysses' all-to-all group, ring attention's send/recv."""
    out: dict[str, int] = {}
    if s.world_size > 1:
        out["nccl_data_parallel"] = NCCL_COMMUNICATOR
    if s.sequence_parallel > 1:
        out["nccl_sequence_parallel"] = NCCL_ALL_TO_ALL if s.sequence_parallel_kind == "ulysses" else NCCL_COMMUNICATOR
    return out


def terms(shape: ModelShape, s: Setup, o: Overhead, tensors_peak: int) -> dict[str, int]:
    """The overhead terms (bytes per rank) on top of the tensors' peak `tensors_peak`."""
    if o.fixed_bytes is not None:
        fixed = {"overhead_given": o.fixed_bytes}
    else:
        fixed = {"cuda_context": CUDA_CONTEXT, "cublas_workspaces": CUBLAS_WORKSPACE * CUBLAS_HANDLES,
                 **communicators(s)}
        if o.zero3_bucket_elements:
            fixed["zero3_buckets"] = o.zero3_bucket_elements * s.dtype_bytes
    return {**fixed, "fragmentation": int(tensors_peak * o.fragmentation)}


def zero3_bucket_elements(path: str, hidden: int) -> int:
    """ZeRO-3's reduce and prefetch bucket sizes (elements) from a DeepSpeed config; "auto" as transformers fills it
    (reduce_bucket_size = hidden^2, stage3_prefetch_bucket_size = 0.9 hidden^2), unset as DeepSpeed's defaults.
    0 for a config that is not ZeRO-3."""
    try:
        config: dict[str, Any] = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"hsoffload plan: --deepspeed-config {path}: not a readable JSON file ({exc})") from None
    zero = config.get("zero_optimization") or {}
    if zero.get("stage") != 3:
        return 0

    def size(key: str, default: int, auto: int) -> int:
        value = zero.get(key, default)
        return auto if value == "auto" else int(float(value))

    return (size("reduce_bucket_size", ZERO3_REDUCE_BUCKET, hidden * hidden)
            + size("stage3_prefetch_bucket_size", ZERO3_PREFETCH_BUCKET, int(0.9 * hidden * hidden)))


@dataclasses.dataclass(frozen=True)
class DeviceFit:
    """Whether a setup fits one device: its memory against what the process reserves (the tensors' peak plus the
    overhead terms). Not a budget: `device_budget` is policy auto's knob (hsoffload.options)."""

    device_bytes: int
    overhead: Overhead = Overhead()

    def terms(self, shape: ModelShape, s: Setup, tensors_peak: Optional[int] = None) -> dict[str, int]:
        """The overhead terms of `s`; `tensors_peak`: its tensors' peak when the caller has it (else computed)."""
        tensors = peak(shape, s).total if tensors_peak is None else tensors_peak
        return terms(shape, s, self.overhead, tensors)

    def reserved(self, shape: ModelShape, s: Setup, tensors_peak: Optional[int] = None) -> int:
        """What the process reserves at the step's peak (what nvidia-smi shows)."""
        tensors = peak(shape, s).total if tensors_peak is None else tensors_peak
        return tensors + sum(terms(shape, s, self.overhead, tensors).values())

    def fits(self, shape: ModelShape, s: Setup) -> bool:
        return self.reserved(shape, s) <= self.device_bytes
