"""ZeRO-3 RAM-efficient loading (`hsoffload.zero3_loading`): the collectives' geometry and cross-rank agreement.

Who receives (`_decide`, the engine's `skip_init_zero3`), where a partition lands (`_receive_buffer`, `_send_buffers`:
every buffer from the allocator the caller passes, `zero3._scratch`), the status checks that make one rank's failure
raise on every rank (`_agree`, `_defer`; the all-reduce is the package's shared primitive, `hsoffload.collectives`),
the counters (`Zero3LoadStats`), the patch settings and the per-thread state of a patched transformers call (its
parameters' names, whether GatheredParameters answers root-only). Thread-safety: the counters take a lock; the rest
is per thread or set by `zero3.patch()` under its lock.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable, Optional

import torch

from .. import engine as _engine
from .._logging import log_once
from ..collectives import all_reduce_values

logger = logging.getLogger("hsoffload")

Scratch = Callable[[int, torch.dtype, torch.device], torch.Tensor]  # zero3._scratch: every buffer the loading allocates


@dataclasses.dataclass(frozen=True)
class Zero3LoadStats:
    """What the patched collectives did in this process since `reset_stats()` (or the first `patch()`)."""

    scattered_params: int = 0  # Init._zero_init_param calls that scattered instead of broadcasting
    gathered_params: int = 0  # parameters gathered to rank 0 instead of all-gathered (GatheredParameters)
    received_params: int = 0  # of both: parameters this rank received only its slice of (skip_init_zero3 said skip)
    received_bytes: int = 0  # bytes of those slices
    skipped_full_bytes: int = 0  # full-size bytes this rank did not write (full parameter bytes - its slices)
    stock_params: int = 0  # parameters left to DeepSpeed's own collectives (see the module docstring)
    meta_read_tensors: int = 0  # from_pretrained: checkpoint entries this rank read as meta (shape and dtype only)
    meta_read_bytes: int = 0  # their bytes, which this rank did not read
    real_read_tensors: int = 0  # entries it read for real: the model's persistent buffers (copied on every rank)
    status_checks: int = 0  # status all-reduces this rank took part in (a rank's failure raises on every rank)
    checked_tensors: int = 0  # from_pretrained: checkpoint entries whose shape and dtype were checked before loading
    verified_params: int = 0  # patch(verify=True): partitions compared with rank 0's slice (one per parameter scatter)


_stats_lock = threading.Lock()

_counts: dict[str, int] = {f.name: 0 for f in dataclasses.fields(Zero3LoadStats)}


def _add(**deltas: int) -> None:
    with _stats_lock:
        for key, value in deltas.items():
            _counts[key] += value


def stats() -> Zero3LoadStats:
    """The counters now (see Zero3LoadStats)."""
    with _stats_lock:
        return Zero3LoadStats(**_counts)


def reset_stats() -> None:
    with _stats_lock:
        for key in _counts:
            _counts[key] = 0


def _dist() -> Any:
    return torch.distributed


def _group_facts(group: Any) -> tuple[int, int, int]:
    """(rank in `group`, its size, the global rank of its rank 0)."""
    dist = _dist()
    return dist.get_rank(group=group), dist.get_world_size(group=group), dist.get_global_rank(group, 0)


def _decide(tensor: torch.Tensor, group_rank: int) -> bool:
    """Whether this rank only receives its slice of `tensor` (the engine's decision, docs/ops.md). The collectives
    need every rank but group rank 0 to receive: a decision that says otherwise is our bug, not the caller's."""
    skip = _engine.skip_init_zero3([tensor], group_rank, True)[0]
    if skip != (group_rank != 0):
        raise RuntimeError(f"hsoffload.zero3_loading: internal error: skip_init_zero3 decided skip={skip} for group "
                           f"rank {group_rank} of a {tuple(tensor.shape)} {tensor.layout} tensor")
    if skip:
        log_once("zero3-receive", logging.INFO,
                 "hsoffload.zero3_loading: group rank %d receives only its partitions from rank 0", group_rank)
    return skip


def _valid(numel: int, part: int, rank: int) -> int:
    """How many of rank `rank`'s `part` elements lie inside a parameter of `numel` elements (the rest is padding)."""
    return max(0, min(part, numel - rank * part))


def _comm_device() -> torch.device:
    """Where DeepSpeed's own collectives put their buffers (the accelerator's current device; the CPU on DeepSpeed's
    CPU accelerator). A partition kept elsewhere (ZeRO-Offload on the host under NCCL) travels through a copy."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def _receive_buffer(target: torch.Tensor, valid: int, part: int, scratch: Scratch) -> torch.Tensor:
    """Where this rank's scatter of `part` elements lands: `target` (1-D) itself when the slice has no padding and
    `target` is contiguous on the communication device, else a scratch buffer (a padded last partition, a partition
    kept on the host under ZeRO-Offload). Allocated before the scatter, so that a failure is agreed before it."""
    device = _comm_device()
    if valid == part and target.numel() == part and target.is_contiguous() and target.device == device:
        return target
    return scratch(part, target.dtype, device)


def _finish_receive(target: torch.Tensor, buf: torch.Tensor, valid: int) -> int:
    """Copy the first `valid` received elements from `buf` into `target` (nothing when it received in place).
    Returns the bytes written."""
    if buf is not target and valid > 0:
        target.narrow(0, 0, valid).copy_(buf.narrow(0, 0, valid))
    return valid * target.element_size()


def _send_buffers(flat: torch.Tensor, part: int, world: int,
                  scratch: Scratch) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Rank 0's scatter list (each rank's slice of `flat` as bytes, a padded copy where the slice is short) and the
    buffer its own slice lands in (never an alias of the input), allocated before the scatter."""
    pieces = []
    for r in range(world):
        n = _valid(flat.numel(), part, r)
        if n == part:
            pieces.append(flat.narrow(0, r * part, part).view(torch.uint8))
        else:
            buf = scratch(part, flat.dtype, flat.device)
            buf.narrow(0, n, part - n).zero_()
            if n > 0:
                buf.narrow(0, 0, n).copy_(flat.narrow(0, r * part, n))
            pieces.append(buf.view(torch.uint8))
    return pieces, scratch(part, flat.dtype, flat.device)


class Zero3LoadError(RuntimeError):
    """Raised on a rank whose own part succeeded while another rank failed: the message quotes that rank's error."""


_settings: dict[str, Any] = {"verify": False, "failure_wait_s": 60.0}  # patch(...)

_AGREED = "_hsoffload_zero3_agreed"  # set on an exception every rank raised at the same status check


def _agreed(exc: BaseException) -> bool:
    return bool(getattr(exc, _AGREED, False))


def _mark(exc: BaseException) -> BaseException:
    try:
        setattr(exc, _AGREED, True)
    except AttributeError:  # an exception type without a __dict__: the caller's next status check still matches
        pass
    return exc


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


_pending = threading.local()  # .failure: a rank-local failure after a scatter of zero.Init, raised at the next check


def _defer(failure: BaseException) -> None:
    """Keep a failure of a step after a collective (where no status check follows at once) for the next status check
    on this thread, which every rank runs at the same point: it raises there on every rank."""
    if getattr(_pending, "failure", None) is None:
        _pending.failure = failure


class Zero3StatusTimeout(Zero3LoadError):
    """A rank that failed before the others could reach a status check waited for them no longer than its bound."""


def _agree(failure: Optional[BaseException], stage: str, group: Any = None,
           timeout_s: Optional[float] = None) -> None:
    """A status check: every rank of `group` (default: the world) calls it at the same point of the same code. When no
    rank failed, returns. Otherwise every rank raises here: a rank that failed its own exception, the others a
    Zero3LoadError quoting the message of the lowest failed rank (broadcast from it), so that none goes on into a
    collective the failed ranks will never join. A failure deferred on this thread (`_defer`) counts as this call's.

    `timeout_s` bounds the wait of a rank that failed where the others may not be at a status check (before the model
    exists): past it, it raises its own failure with a note instead of waiting for the collectives' timeout."""
    dist = _dist()
    deferred = getattr(_pending, "failure", None)
    if deferred is not None:
        _pending.failure = None
        failure = failure or deferred
    world = dist.get_world_size(group=group)
    rank = dist.get_rank(group=group)
    try:
        src = int(all_reduce_values([rank if failure is not None else world], dist.ReduceOp.MIN, dtype=torch.int64,
                                    device=_comm_device(), group=group, timeout_s=timeout_s)[0])
    except Exception as wait_error:  # noqa: BLE001  (the timeout, or a peer that is gone)
        if timeout_s is None:
            raise
        note = (f"hsoffload.zero3_loading: this rank (rank {dist.get_rank()}) failed while {stage}, and the other "
                f"ranks did not reach a status check within {timeout_s:g} s ({_describe(wait_error)}); they may "
                "wait in their next collective until its timeout: stop them (or let the launcher do it) and fix "
                "this rank's error")
        logger.error("%s: %s", note, _describe(failure) if failure is not None else "(no failure)")
        if failure is None:
            raise Zero3StatusTimeout(note) from wait_error
        raise _mark(failure) from Zero3StatusTimeout(note)
    _add(status_checks=1)
    if src == world:
        return
    # the failed rank's message and its own stage (it may have failed elsewhere: before its model existed)
    message = [(_describe(failure), stage) if rank == src and failure is not None else None]
    src_global = dist.get_global_rank(group, src) if group is not None else src
    dist.broadcast_object_list(message, src=src_global, group=group)
    quoted, stage = message[0]
    if failure is not None:
        logger.error("hsoffload.zero3_loading: this rank failed while %s; every rank raises: %s", stage,
                     _describe(failure))
        raise _mark(failure)
    raise _mark(Zero3LoadError(
        f"hsoffload.zero3_loading: rank {src_global} failed while {stage}, so this rank (rank {dist.get_rank()}) "
        f"stops too instead of waiting in a collective for it. Fix what rank {src_global} reports: {quoted}"))


_names = threading.local()  # .by_id: {id(param): name} while a patched transformers function runs


def _label(p: Any) -> str:
    """The parameter's name where a patched transformers function told us, else its ds_id and shape."""
    name = (getattr(_names, "by_id", None) or {}).get(id(p))
    shape = tuple(getattr(p, "ds_shape", p.shape))
    return f"{name} {shape}" if name else f"parameter ds_id={getattr(p, 'ds_id', '?')} {shape}"


_armed = threading.local()  # .depth > 0 while this thread runs a patched transformers function


def _armed_call(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `func` with `deepspeed.zero.GatheredParameters` answered by RootGatheredParameters on this thread."""
    _armed.depth = getattr(_armed, "depth", 0) + 1
    try:
        return func(*args, **kwargs)
    finally:
        _armed.depth -= 1


class _Named:
    """Names of the model's parameters for the errors of this thread's status checks and verification."""

    def __init__(self, model: Any) -> None:
        named = getattr(model, "named_parameters", None)
        self._by_id = {id(p): n for n, p in named()} if callable(named) else {}

    def __enter__(self) -> None:
        self._saved = getattr(_names, "by_id", None)
        _names.by_id = self._by_id

    def __exit__(self, *exc: Any) -> None:
        _names.by_id = self._saved
