"""ZeRO-3 RAM-efficient loading (issue 28, item 5): ranks other than rank 0 of a parameter's ZeRO-3 partition group
never write, initialise or receive a full-size copy of it while a model is built and loaded; they receive their own
partition and nothing else.

Stock, with transformers 5.x under ZeRO-3 (`HfDeepSpeedConfig` alive), every rank of the group:

1. builds the model inside `deepspeed.zero.Init`: each parameter is allocated at full size and, after its module's
   `__init__`, `Init._zero_init_param` broadcasts rank 0's full values into it and keeps the rank's slice
   (`param.partition()`);
2. `from_config`: `initialize_weights_zero3` gathers each module's parameters (`GatheredParameters(modifier_rank=0)`:
   an all-gather into full-size buffers on every rank), rank 0 runs `_init_weights`, and the exit broadcasts rank 0's
   full values into every rank's full-size buffer before each keeps its slice;
   `from_pretrained`: `_load_state_dict_into_zero3_model` does the same around rank 0's `_load_from_state_dict`.

In each of these, a rank other than group rank 0 writes full-size buffers only to copy one slice out of them: the
pages are touched (its RSS rises by about the model's bytes, and glibc keeps much of it after the free), the copies
take time, and none of it is read. `patch()` replaces those three collectives, on **every** rank, by root-only ones
with the same result: rank 0 scatters each rank its slice (`torch.distributed.scatter`) instead of broadcasting
everything, and gathers the partitions to itself (`torch.distributed.gather`) instead of all-gathering them
everywhere. A receiving rank writes only its own slice of the full-size buffer DeepSpeed allocated (whose other pages
it never touches) or its partition directly; rank 0 does what it did before. Each rank's partition ends up with
the same bytes as stock (rank 0's values, sliced; the padding of the last partition as stock leaves it).

`from_pretrained` also has every rank merge the whole checkpoint into one state dict, though only global rank 0 loads
from it: on a receiving rank the patch reads it as meta tensors (names, shapes, dtypes; transformers' own
`load_state_dict(map_location="meta")`), the model's persistent buffers among them for real (every rank copies those).
That matters most where transformers reads checkpoints whole instead of memory-mapping them (`disable_mmap`, hf-mount).
transformers >= 5.23 does that read itself (and broadcasts the buffers from rank 0): the meta read then stands aside
(logged once). 5.23's `initialize_weights_zero3` also gathers each module's parameters with the module and again with
its parent, so each `from_config` parameter passes through two root-only gathers there. With weight conversions 5.23
yields the converted checkpoint in parts; the checkpoint check gathers them (rank 0 holds it converted at once, as
before 5.23).

Which rank receives is decided by `torch.ops.hsoffload.skip_init_zero3` (docs/ops.md) from the rank in the
parameter's partition group; the tensors it flags are recorded in an `InitSkipRecord` (the counters).

**Every rank must patch** (as every rank enters `zero.Init`): the collectives change on all of them. A rank that
did not patch would broadcast where the others scatter. Call `hsoffload.zero3_loading.patch()` in the script every
rank runs, before `from_config` / `from_pretrained`. The Axolotl plugin calls it with `hsoffload_zero3_loading: true`
and a ZeRO-3 `deepspeed:` config (every rank runs the plugin); the Trainer integration cannot (the model exists before the Trainer).

**Failing together.** Stock, a rank-0-only failure while loading (a checkpoint that does not fit the model, an I/O
error or an OOM on rank 0, an exception in rank 0's `_load_from_state_dict` or `_init_weights`) raises on rank 0
while the other ranks go on into their next collective and wait there for a rank that is gone. Under the patch:

- before loading, every rank checks the checkpoint's names, shapes and dtypes against the model's (a ZeRO-3
  parameter's `ds_shape`) from what it holds (rank 0 the tensors, the others their meta copies) and raises the same
  error naming the tensors and what to do; `ignore_mismatched_sizes=True` leaves size-mismatched tensors to the
  model's initialisation as transformers does without ZeRO-3;
- a status all-reduce (`_agree`) runs after rank 0 read the checkpoint, after the load, and around every
  gather/scatter of `RootGatheredParameters`: when a rank failed, every rank raises at the same point (the failed
  rank its own exception, the others a `Zero3LoadError` quoting its message and where it failed, broadcast with
  `broadcast_object_list`);
- every buffer a scatter needs (a receiving rank's scratch buffer for a padded last partition or a partition kept
  off the communication device, rank 0's own slice and padded slices, the verification's checksums; all from
  `_scratch`) is allocated before the scatter, and a status check then agrees on it (and, at a
  `RootGatheredParameters` exit, on rank 0's init or load): a rank that cannot allocate makes every rank raise
  before any scatter. zero.Init checks before each parameter's scatter (one all-reduce of 8 bytes each); after it,
  each rank-local step runs under the same failure handling and every scatter still runs, the next status check
  raising what failed;
- a rank that fails before its model exists (a checkpoint file missing on its node: the shard index, the config;
  zero.Init) joins a status check from its outermost `from_pretrained` / `_from_config` / `AutoConfig.from_pretrained`,
  which meets the others' before zero.Init's first scatter: every rank raises its error. Where the others are in a
  collective that is not a status check, it waits `patch(failure_wait_s=60)` at most and raises its own error with
  a note (they stay in theirs until its timeout, as stock);
- `patch(verify=True)` also compares, after every scatter, a checksum of each rank's partition with rank 0's slice of
  the full values it scattered (position-weighted byte sums), and raises on every rank naming the parameter and rank.

Stock collectives are kept (on every rank, decided from facts all ranks share) for: hpZ (`zero_hpz_partition_size`
> 1: secondary partitions read other slices), quantized weights or quantized initialisation, NVMe parameter offload,
persistent parameters (`ds_persist`: kept whole on every rank), non-contiguous parameters, a single-rank group, and
`GatheredParameters` anywhere but inside the two transformers functions above (elsewhere every rank may read the
gathered values). Thread-safety: the swapped `GatheredParameters` is used only by the thread inside a patched
transformers call (a thread-local flag); the counters take a lock.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
from typing import Any, Callable, Iterable, Optional

import torch

from .. import engine as _engine
from .._logging import log_once

logger = logging.getLogger("hsoffload")

__all__ = ["RootGatheredParameters", "Zero3LoadError", "Zero3LoadStats", "is_patched", "patch", "reset_stats", "stats",
           "unpatch"]


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


# --------------------------------------------------------------------------- decision and geometry


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


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the loading collectives allocate for themselves (receive buffers, rank 0's own slice and padded
    slices, the verification's checksums) comes from here, before the first scatter it serves; tests cap it."""
    return torch.empty(numel, dtype=dtype, device=device)


def _receive_buffer(target: torch.Tensor, valid: int, part: int) -> torch.Tensor:
    """Where this rank's scatter of `part` elements lands: `target` (1-D) itself when the slice has no padding and
    `target` is contiguous on the communication device, else a scratch buffer (a padded last partition, a partition
    kept on the host under ZeRO-Offload). Allocated before the scatter, so that a failure is agreed before it."""
    device = _comm_device()
    if valid == part and target.numel() == part and target.is_contiguous() and target.device == device:
        return target
    return _scratch(part, target.dtype, device)


def _finish_receive(target: torch.Tensor, buf: torch.Tensor, valid: int) -> int:
    """Copy the first `valid` received elements from `buf` into `target` (nothing when it received in place).
    Returns the bytes written."""
    if buf is not target and valid > 0:
        target.narrow(0, 0, valid).copy_(buf.narrow(0, 0, valid))
    return valid * target.element_size()


def _send_buffers(flat: torch.Tensor, part: int, world: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Rank 0's scatter list (each rank's slice of `flat` as bytes, a padded copy where the slice is short) and the
    buffer its own slice lands in (never an alias of the input), allocated before the scatter."""
    pieces = []
    for r in range(world):
        n = _valid(flat.numel(), part, r)
        if n == part:
            pieces.append(flat.narrow(0, r * part, part).view(torch.uint8))
        else:
            buf = _scratch(part, flat.dtype, flat.device)
            buf.narrow(0, n, part - n).zero_()
            if n > 0:
                buf.narrow(0, 0, n).copy_(flat.narrow(0, r * part, n))
            pieces.append(buf.view(torch.uint8))
    return pieces, _scratch(part, flat.dtype, flat.device)


# --------------------------------------------------------------------------- failing together, verifying


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
    flag = torch.tensor([rank if failure is not None else world], dtype=torch.int64, device=_comm_device())
    if timeout_s is None:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    else:
        import datetime  # noqa: PLC0415

        work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as wait_error:  # noqa: BLE001  (the timeout, or a peer that is gone)
            note = (f"hsoffload.zero3_loading: this rank (rank {dist.get_rank()}) failed while {stage}, and the other "
                    f"ranks did not reach a status check within {timeout_s:g} s ({_describe(wait_error)}); they may "
                    "wait in their next collective until its timeout: stop them (or let the launcher do it) and fix "
                    "this rank's error")
            logger.error("%s: %s", note, _describe(failure) if failure is not None else "(no failure)")
            if failure is None:
                raise Zero3StatusTimeout(note) from wait_error
            raise _mark(failure) from Zero3StatusTimeout(note)
    _add(status_checks=1)
    src = int(flag.item())
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
    def allocate(count: int, world: int, is_src: bool) -> "_VerifyBuffers":
        device = _comm_device()
        local = _scratch(count * 2, torch.int64, device).view(count, 2).zero_()
        got = [_scratch(count * 2, torch.int64, device).view(count, 2) for _ in range(world)] if is_src else None
        return _VerifyBuffers(local, got, _scratch(2, torch.int64, device).zero_())


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


# For tests only: after_receive(label, partition) runs on a receiving rank after each slice a RootGatheredParameters
# exit wrote (the worker corrupts one byte to prove that verify=True notices).
_TEST_HOOKS: dict[str, Optional[Callable[[str, torch.Tensor], None]]] = {"after_receive": None}

_names = threading.local()  # .by_id: {id(param): name} while a patched transformers function runs


def _label(p: Any) -> str:
    """The parameter's name where a patched transformers function told us, else its ds_id and shape."""
    name = (getattr(_names, "by_id", None) or {}).get(id(p))
    shape = tuple(getattr(p, "ds_shape", p.shape))
    return f"{name} {shape}" if name else f"parameter ds_id={getattr(p, 'ds_id', '?')} {shape}"


# --------------------------------------------------------------------------- zero.Init: scatter, not broadcast


def _init_stock_reason(init: Any, param: torch.Tensor) -> str:
    """Why `Init._zero_init_param` must keep DeepSpeed's broadcast for `param` ("" if it need not). Every input is
    the same on every rank (config, shape), so every rank takes the same path."""
    if getattr(init, "zero_param_process_group", None) is not None:
        return "hpZ (zero_hpz_partition_size > 1)"
    if getattr(init, "quantized_weights", False) or getattr(init, "quantized_nontrainable_weights", False):
        return "quantized weights"
    if getattr(init, "quantized_initialization", None):
        return "quantized initialization"
    if str(getattr(init, "remote_device", "")).endswith("nvme"):
        return "NVMe parameter offload"
    if getattr(param, "ds_persist", False):
        return "persistent parameter"
    if not param.data.is_contiguous():
        return "non-contiguous parameter"
    return ""


def _make_zero_init_param(original: Callable[..., Any], patch: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def _zero_init_param(self: Any, param: torch.nn.Parameter) -> None:
        if not patch.active:
            return original(self, param)
        self._convert_to_deepspeed_param(param)  # what the stock method starts with (sets ds_shape, ds_numel, ...)
        group = self.get_partition_dp_group(param)
        rank, world, src = _group_facts(group)
        reason = _init_stock_reason(self, param) or ("single-rank group" if world < 2 else "")
        if reason:
            _add(stock_params=1)
            log_once(f"zero3-init-stock:{reason}", logging.INFO,
                     "hsoffload.zero3_loading: zero.Init keeps DeepSpeed's broadcast (%s)", reason)
            if world > 1:  # as before a scatter: meets a rank that failed earlier (or before the model existed)
                _agree(None, f"zero.Init's broadcast of {_label(param)}", group)
            _dist().broadcast(param.data.view(torch.uint8), src, group=group)
            param.partition()
            return
        part = self._aligned_size(param) // self._partition_world_size(param)  # as _partition_param computes it
        valid = _valid(param.ds_numel, part, rank)
        verify = _settings["verify"]
        receives = _decide(param, rank)
        # Every buffer of this parameter's scatter first, then a status check, then the scatter: a rank that cannot
        # allocate (or that failed before, outside: its outermost from_pretrained/from_config joins this check) makes
        # every rank raise here, none is left in the scatter. It also meets the status check of a rank that failed
        # before the model existed (_make_outer).
        failure: Optional[Exception] = None
        buf = target = flat = own = None
        pieces: Optional[list[torch.Tensor]] = None
        checks: Optional[_VerifyBuffers] = None
        expected: Optional[list[list[torch.Tensor]]] = None
        try:
            if receives:
                # DeepSpeed allocates the partition and frees the full-size buffer, which nothing wrote: reading its
                # untouched pages maps the kernel's zero page, so it never becomes resident (nor kept by the
                # allocator). Rank 0's values then go straight into the partition.
                param.partition()
                target = param.ds_tensor
                buf = _receive_buffer(target, valid, part)
            else:
                flat = param.data.view(-1)
                pieces, own = _send_buffers(flat, part, world)
                if verify:
                    expected = [[c] for c in _slice_checksums(flat, part, world)]
            if verify:
                checks = _VerifyBuffers.allocate(1, world, not receives)
        except Exception as e:  # noqa: BLE001  (raised on every rank by the status check)
            failure = e
        _agree(failure, f"allocating the buffers of zero.Init's scatter of {_label(param)}", group)
        full_bytes = param.ds_numel * param.element_size()
        if receives:
            assert buf is not None and target is not None
            _dist().scatter(buf.view(torch.uint8), None, src=src, group=group)
            try:
                got = _finish_receive(target, buf, valid)
                _add(scattered_params=1, received_params=1, received_bytes=got, skipped_full_bytes=full_bytes - got)
            except Exception as e:  # noqa: BLE001  (raised on every rank at the next status check)
                failure = e
        else:
            assert own is not None
            _dist().scatter(own.view(torch.uint8), pieces, src=src, group=group)
            del flat, pieces, own
            try:
                param.partition()
                _add(scattered_params=1)
            except Exception as e:  # noqa: BLE001
                failure = e
        if verify:
            assert checks is not None
            try:
                mine = [_checksum(param.ds_tensor.narrow(0, 0, valid))] if failure is None else [checks.zero]
            except Exception as e:  # noqa: BLE001
                failure, mine = failure or e, [checks.zero]
            mismatch = _verify_partitions([_label(param)], mine, expected, src, group, checks)
            _agree(failure or mismatch, "verifying zero.Init's partitions", group)
        elif failure is not None:
            _defer(failure)  # the next status check (the next parameter's, or the load's) raises it on every rank

    return _zero_init_param


# ------------------------------------------------------------------ GatheredParameters(modifier_rank=0) on rank 0 only


_armed = threading.local()  # .depth > 0 while this thread runs a patched transformers function


class RootGatheredParameters:
    """`deepspeed.zero.GatheredParameters(params, modifier_rank=0)` for code whose body runs on rank 0 only.

    Enter gathers the partitions to rank 0 (`gather`), which then holds full parameters as stock does; the other
    ranks' parameters stay empty. Exit scatters rank 0's (possibly modified) values: each rank copies its slice into
    its partition, rank 0 frees its full copies. Anything else (another modifier rank, `fwd_module`, a parameter
    that is not a plain CPU/accelerator ZeRO-3 partition) -- or a thread that is not inside a patched transformers
    function -- gets DeepSpeed's own class.
    """

    def __new__(cls, params: Any, modifier_rank: Optional[int] = None, fwd_module: Any = None,
                enabled: bool = True) -> Any:
        stock = _STOCK_GATHERED[0]
        if getattr(_armed, "depth", 0) == 0:  # not inside a patched transformers loading function
            return stock(params, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled)
        plist = _param_list(params)
        reason = _gather_stock_reason(plist, modifier_rank, fwd_module, enabled)
        if reason:
            _add(stock_params=len(plist))
            log_once(f"zero3-gather-stock:{reason}", logging.INFO,
                     "hsoffload.zero3_loading: GatheredParameters kept as DeepSpeed's (%s)", reason)
            return stock(plist, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled)
        self = super().__new__(cls)
        self._params = sorted({id(p): p for p in plist}.values(), key=lambda p: p.ds_id)  # DeepSpeed's order
        self._full: list[Optional[torch.Tensor]] = []
        return self

    def __init__(self, params: Any, modifier_rank: Optional[int] = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        pass  # everything was set by __new__

    def _group(self) -> Any:
        """The group the status checks run in: the partition group (the same for every parameter that transformers'
        loading functions gather together; every rank of it runs the same code)."""
        return self._params[0].ds_process_group

    def __enter__(self) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        device = _comm_device()
        # Allocate first (rank 0's full-size buffers may not fit), agree, then gather: a rank that failed must not
        # leave the others waiting in a gather it will never join.
        plan: list[tuple[Any, torch.Tensor, Optional[torch.Tensor], int]] = []
        failure: Optional[Exception] = None
        try:
            for p in self._params:
                rank, world, src = _group_facts(p.ds_process_group)
                mine = p.ds_tensor if p.ds_tensor.device == device else p.ds_tensor.to(device)
                full = None
                if not _decide(p.ds_tensor, rank):
                    full = torch.empty(p.ds_tensor.ds_numel * world, dtype=p.ds_tensor.dtype, device=device)
                plan.append((p, mine, full, src))
        except Exception as e:  # noqa: BLE001  (every rank raises it, or its message, at the status check)
            failure = e
        _agree(failure, "allocating full parameters to gather them to rank 0", self._group())
        for p, mine, full, src in plan:
            group = p.ds_process_group
            if full is None:
                _dist().gather(mine.view(torch.uint8), None, dst=src, group=group)
                self._full.append(None)
                _add(gathered_params=1, skipped_full_bytes=p.ds_numel * p.element_size())
            else:
                chunks = [c.view(torch.uint8) for c in full.chunk(_dist().get_world_size(group=group))]
                _dist().gather(mine.view(torch.uint8), chunks, dst=src, group=group)
                p.data = full.narrow(0, 0, p.ds_numel).view(p.ds_shape)
                p.ds_status = ZeroParamStatus.AVAILABLE
                self._full.append(full)
                _add(gathered_params=1)

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        # Rank 0's values and every buffer of every scatter first (a receive buffer where the slice is padded or the
        # partition lives off the communication device, rank 0's own and padded slices, the verification's), then one
        # status check: a failure of the body or of an allocation raises on every rank there, before any scatter.
        # After it, every scatter runs whatever fails on this rank (each local step is an `attempt`; nothing there
        # allocates but the verification's checksums), and a last status check raises any failure on every rank.
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        full_copies, self._full = self._full, []
        if isinstance(exc, Exception) and _agreed(exc):
            # raised at a status check on every rank: none of them scatters, every rank's exception goes on
            _release_full_copies(self._params, full_copies, ZeroParamStatus)
            return None
        failure: Optional[BaseException] = exc if isinstance(exc, Exception) else None
        verify = _settings["verify"]
        steps: list[_ExitStep] = []
        checks: Optional[_VerifyBuffers] = None
        expected: Optional[list[list[torch.Tensor]]] = None
        src = 0
        try:
            for p, full in zip(self._params, full_copies):
                rank, world, src = _group_facts(p.ds_process_group)
                part = p.ds_tensor.ds_numel
                step = _ExitStep(p, part, _valid(p.ds_numel, part, rank))
                if full is None:
                    step.buf = _receive_buffer(p.ds_tensor, step.valid, part)
                elif failure is None:  # rank 0 after a body that succeeded
                    flat = _flat_values(p)
                    step.pieces, step.buf = _send_buffers(flat, part, world)
                    if verify:
                        expected = expected or [[] for _ in range(world)]
                        for r, c in enumerate(_slice_checksums(flat, part, world)):
                            expected[r].append(c)
                steps.append(step)
            if verify and self._params:
                checks = _VerifyBuffers.allocate(len(steps), _dist().get_world_size(group=self._group()),
                                                 any(full is not None for full in full_copies))
        except Exception as e:  # noqa: BLE001  (raised on every rank by the status check)
            failure = failure or e
        if failure is not None:
            _release_full_copies(self._params, full_copies, ZeroParamStatus)
        _agree(failure, "inside GatheredParameters (rank 0's init or load of gathered parameters, or allocating the "
               "buffers of the scatters that follow it)", self._group())

        def attempt(step: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
            """A rank-local step between the collectives: its failure is raised on every rank at the status check
            below, never before a collective the other ranks are waiting in."""
            nonlocal failure
            try:
                return step()
            except Exception as e:  # noqa: BLE001
                failure = failure or e
                return fallback()

        labels: list[str] = []
        mine: list[torch.Tensor] = []
        for step in steps:
            p, group = step.param, step.param.ds_process_group
            assert step.buf is not None
            _dist().scatter(step.buf.view(torch.uint8), step.pieces, src=src, group=group)
            if step.pieces is None:
                attempt(functools.partial(_exit_received, step), lambda: None)
            else:
                attempt(functools.partial(_exit_kept_own, step, ZeroParamStatus), lambda: None)
            step.pieces = step.buf = None
            if verify:
                assert checks is not None
                labels.append(_label(p))
                mine.append(attempt(lambda p=p, n=step.valid: _checksum(p.ds_tensor.narrow(0, 0, n)),
                                    lambda: checks.zero))
        if verify and checks is not None:
            # Every rank gathers, whatever failed here: a rank skipping it would leave the others in the gather.
            mismatch = _verify_partitions(labels, mine, expected, src, self._group(), checks)
            failure = failure or mismatch
        _agree(failure, "inside GatheredParameters (copying the scattered slices into the partitions)", self._group())
        return None


@dataclasses.dataclass
class _ExitStep:
    """One parameter's scatter at a RootGatheredParameters exit: where it lands (`buf`: the partition itself or a
    scratch buffer; rank 0's own slice) and, on rank 0, what it sends (`pieces`)."""

    param: Any
    part: int
    valid: int
    buf: Optional[torch.Tensor] = None
    pieces: Optional[list[torch.Tensor]] = None


def _exit_received(step: _ExitStep) -> None:
    p = step.param
    assert step.buf is not None
    got = _finish_receive(p.ds_tensor, step.buf, step.valid)
    _add(received_params=1, received_bytes=got)
    if _TEST_HOOKS["after_receive"] is not None:
        _TEST_HOOKS["after_receive"](_label(p), p.ds_tensor)


def _exit_kept_own(step: _ExitStep, status: Any) -> None:
    """Rank 0: its own slice into its partition, its full copy released."""
    p = step.param
    assert step.buf is not None
    if step.valid > 0:
        p.ds_tensor.narrow(0, 0, step.valid).copy_(step.buf.narrow(0, 0, step.valid))
    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    p.ds_status = status.NOT_AVAILABLE


def _release_full_copies(params: list[Any], full_copies: list[Optional[torch.Tensor]], status: Any) -> None:
    """Rank 0 before raising at an exit that scatters nothing: its full copies released, its partitions as they
    were (nothing was scattered). Best effort: the failure that brought us here is what every rank raises."""
    for p, full in zip(params, full_copies):
        if full is None:
            continue
        try:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.ds_status = status.NOT_AVAILABLE
        except Exception:  # noqa: BLE001
            logger.debug("hsoffload.zero3_loading: could not release a gathered copy after a failure", exc_info=True)


def _flat_values(p: Any) -> torch.Tensor:
    """Rank 0's full values of `p` after the body, flat, in the partition's dtype (what DeepSpeed broadcasts)."""
    data = p.data
    if data.numel() != p.ds_numel:
        raise RuntimeError(f"hsoffload.zero3_loading: parameter ds_id={p.ds_id} was given {data.numel()} elements "
                           f"inside GatheredParameters on rank 0; it has {p.ds_numel} ({tuple(p.ds_shape)})")
    return data.reshape(-1).to(p.ds_tensor.dtype)


def _param_list(params: Any) -> Any:
    """The parameters as a list (a generator is consumed: pass the list on), or `params` itself when it is one."""
    if isinstance(params, list):
        return params
    if isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        return list(params)
    return [params]


def _gather_stock_reason(params: list[Any], modifier_rank: Optional[int], fwd_module: Any, enabled: bool) -> str:
    """Why these GatheredParameters must be DeepSpeed's own ("" if ours may run). Same answer on every rank."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if not enabled or modifier_rank != 0 or fwd_module is not None:
        return "modifier_rank != 0, fwd_module or disabled"
    zero = [p for p in params if hasattr(p, "ds_id")]
    if not zero or len(zero) != len(params):
        return "not only ZeRO-3 parameters"
    for p in zero:
        t = getattr(p, "ds_tensor", None)
        if t is None or p.ds_status is not ZeroParamStatus.NOT_AVAILABLE or getattr(p, "ds_persist", False):
            return "a parameter that is not partitioned"
        if getattr(t, "final_location", None) is not None or getattr(p, "ds_zero_param_process_group", None):
            return "NVMe or hpZ partition"
        if getattr(t, "ds_quant_scale", None) is not None:
            return "quantized partition"
        if _dist().get_world_size(group=p.ds_process_group) < 2:
            return "single-rank group"
    return ""


_STOCK_GATHERED: list[Any] = [None]  # DeepSpeed's GatheredParameters, while ours is swapped in


def _armed_call(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `func` with `deepspeed.zero.GatheredParameters` answered by RootGatheredParameters on this thread."""
    _armed.depth = getattr(_armed, "depth", 0) + 1
    try:
        return func(*args, **kwargs)
    finally:
        _armed.depth -= 1


# ------------------------------------------------------------------ from_pretrained / from_config: failing together


_outer = threading.local()  # .depth: nesting of the patched from_pretrained / _from_config on this thread


def _zero3_world() -> bool:
    """ZeRO-3 on (an HfDeepSpeedConfig alive) with more than one rank: where the outermost load agrees."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    dist = _dist()
    return is_deepspeed_zero3_enabled() and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _make_outer(previous: Any, patch: Any, on_success: bool = True) -> Any:
    """`PreTrainedModel.from_pretrained` / `_from_config` (classmethods) ending with a status check on every rank.

    A rank that fails before its model exists (a checkpoint file missing on its node, its config, zero.Init) raises
    out of here while the others build theirs: its status check meets theirs before zero.Init's first scatter (every
    parameter's scatter is preceded by one), so every rank raises its error. Where they are in a collective that is
    not a status check, it waits `failure_wait_s` at most and raises its own error with a note (the others then stay
    until their collective's timeout, as stock). A success ends with one status check too: a failure deferred after
    the last scatter of zero.Init raises on every rank there (`on_success`; not for AutoConfig, which a script may
    call on one rank alone)."""
    func = previous.__func__

    @functools.wraps(func)
    def outer(cls: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_outer, "depth", 0)
        if not patch.active or depth > 0 or not _zero3_world():
            return func(cls, *args, **kwargs)
        _outer.depth = depth + 1
        try:
            try:
                result = func(cls, *args, **kwargs)
            except Exception as e:
                if _agreed(e):
                    raise
                _agree(e, f"building the model ({cls.__name__}.{func.__name__}: before the other ranks' status "
                       "check, e.g. resolving its files, reading its config, zero.Init)",
                       timeout_s=_settings["failure_wait_s"])
                raise
            if on_success:
                _agree(None, f"finishing {cls.__name__}.{func.__name__}")
            return result
        finally:
            _outer.depth = depth

    return classmethod(outer)


# ------------------------------------------------------------------ from_pretrained: no weight reads off rank 0


_meta_read = threading.local()  # .buffers: checkpoint keys to read for real while a receiving rank loads


def _persistent_buffer_keys(model: torch.nn.Module) -> set[str]:
    """The model's persistent buffers under the names a checkpoint may use (with and without the base model
    prefix, as `_load_state_dict_into_zero3_model` maps them)."""
    persistent = set(model.state_dict(keep_vars=True))
    names = {name for name, _ in model.named_buffers()} & persistent
    prefix = getattr(model, "base_model_prefix", "") or ""
    return names | {n[len(prefix) + 1:] for n in names if prefix and n.startswith(prefix + ".")}


_load_ctx = threading.local()  # .pending: inside from_pretrained, before its first status check; .mismatched


def _zero3_distributed(load_config: Any) -> bool:
    """Transformers' ZeRO-3 loading path (ZeRO-3, not quantized) with more than one rank: where the status checks
    and the checkpoint check run."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    dist = _dist()
    return (is_deepspeed_zero3_enabled() and not getattr(load_config, "is_quantized", False)
            and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _make_load_pretrained(previous: Any, patch: Any) -> Any:
    func = previous.__func__ if isinstance(previous, staticmethod) else previous

    @functools.wraps(func)
    def _load_pretrained_model(model: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        load_config = args[1] if len(args) > 1 else kwargs.get("load_config")
        if not patch.active or not _zero3_distributed(load_config):
            return func(model, state_dict, *args, **kwargs)
        if state_dict is None and _receives_weights_only(model, args, kwargs):
            _meta_read.buffers = _persistent_buffer_keys(model)
        _load_ctx.pending, _load_ctx.mismatched = True, []
        try:
            result = func(model, state_dict, *args, **kwargs)
        except Exception as e:
            # Failed before the first status check (rank 0 reading the checkpoint, typically): the other ranks wait
            # in that check, inside _load_state_dict_into_zero3_model. Join it there, so they raise too.
            if _agreed(e) or not _load_ctx.pending:
                raise
            _load_ctx.pending = False
            _agree(e, "reading the checkpoint")
            raise
        finally:
            _meta_read.buffers = None
            _load_ctx.pending = False
            mismatched, _load_ctx.mismatched = _load_ctx.mismatched, []
        info = result[0] if isinstance(result, tuple) and result else None
        if mismatched and hasattr(info, "mismatched_keys") and hasattr(info, "missing_keys"):
            # ignore_mismatched_sizes=True: report them as transformers does without ZeRO-3 (they stay uninitialised
            # partitions until _initialize_missing_keys, which initialises every parameter not loaded)
            info.mismatched_keys.update(mismatched)
            info.missing_keys.difference_update(name for name, _, _ in mismatched)
        return result

    return staticmethod(_load_pretrained_model) if isinstance(previous, staticmethod) else _load_pretrained_model


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating point"
    return "bool" if dtype == torch.bool else "integer"


def _converted(model: Any, state_dict: Any, load_config: Any) -> tuple[Any, Any]:
    """The state dict with transformers' weight conversions applied (legacy renamings, expert fusion), as
    `_load_state_dict_into_zero3_model` applies them before loading, and the config without them (so they are not
    applied twice); (state_dict, load_config) unchanged where this transformers has no such function."""
    mapping = getattr(load_config, "weight_mapping", None)
    convert = getattr(_hf_ds_module(), "_apply_weight_conversions_to_state_dict", None)
    if not mapping or convert is None or not dataclasses.is_dataclass(load_config):
        return state_dict, load_config
    metadata = getattr(state_dict, "_metadata", None)
    copied = state_dict.copy()  # the conversion pops from the dict it is given
    if metadata is not None:
        copied._metadata = metadata
    converted = convert(model, copied, mapping)
    if not isinstance(converted, dict):
        # transformers >= 5.23 yields one conversion's output at a time (so that it loads each before the next
        # allocates). The check reads every entry before anything loads, so the parts are gathered here: rank 0 holds
        # the converted checkpoint at once, as with the earlier releases' dict (docs/compatibility.md).
        merged: Any = collections.OrderedDict()
        for part in converted:
            merged.update(part)
        if metadata is not None:
            merged._metadata = metadata
        converted = merged
    model._weight_conversions = mapping  # what transformers' function records for saving
    return converted, dataclasses.replace(load_config, weight_mapping=None)


def _check_checkpoint(model: Any, state_dict: Any, load_config: Any) -> tuple[Any, Any, list[Any]]:
    """Compare every checkpoint entry that the model has with the model's tensor (a ZeRO-3 parameter's `ds_shape`,
    as every rank holds it). Raises ValueError naming every mismatch; with `ignore_mismatched_sizes` drops the
    size-mismatched entries instead (returned as (name, checkpoint shape, model shape)) so the model initialises
    them. Every rank holds the same names, shapes and dtypes (rank 0 the tensors, the others meta copies): it raises
    the same error on every rank. Entries the model does not have are dropped by transformers, as before."""
    state_dict, load_config = _converted(model, state_dict, load_config)
    expected = model.state_dict(keep_vars=True)
    prefix = getattr(model, "base_model_prefix", None)
    ignore = bool(getattr(load_config, "ignore_mismatched_sizes", False))
    problems: list[str] = []
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    drop: list[str] = []
    checked = 0
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue
        name = f"{prefix}.{key}" if prefix and expected.get(f"{prefix}.{key}") is not None else key
        target = expected.get(name)
        if target is None:
            continue
        checked += 1
        shape, got = tuple(getattr(target, "ds_shape", target.shape)), tuple(value.shape)
        if got != shape:
            if ignore:
                drop.append(key)
                mismatched.append((name, got, shape))
                continue
            problems.append(f"size mismatch for {name}: copying a param with shape {got} ({value.dtype}) from "
                            f"checkpoint, the shape in current model is {shape} ({target.dtype})")
        elif _dtype_kind(value.dtype) != _dtype_kind(target.dtype):
            problems.append(f"dtype mismatch for {name}: the checkpoint holds {value.dtype} {got}, the model "
                            f"{target.dtype} {shape} (a cast from {_dtype_kind(value.dtype)} to "
                            f"{_dtype_kind(target.dtype)} would change what the values mean)")
    _add(checked_tensors=checked)
    if problems:
        sizes = any(p.startswith("size") for p in problems)
        raise ValueError(
            f"hsoffload.zero3_loading: the checkpoint does not fit {type(model).__name__} (checked on every rank "
            f"before loading; {len(problems)} of {checked} tensors): " + "; ".join(problems[:8])
            + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            + ". Load it with the config it was saved with (its config.json: check the model name and any config "
            "overrides you pass)"
            + (", or pass ignore_mismatched_sizes=True to from_pretrained to initialise the size-mismatched tensors "
               "instead of loading them" if sizes else "")
            + ("; a dtype mismatch needs a checkpoint converted to the model's dtypes"
               if len(problems) > sum(p.startswith("size") for p in problems) else "") + ".")
    if drop:
        kept = state_dict.copy()
        for key in drop:
            del kept[key]
        state_dict = kept
        logger.warning("hsoffload.zero3_loading: ignore_mismatched_sizes=True: %d tensors are initialised, not "
                       "loaded (shape in the checkpoint differs): %s", len(drop),
                       ", ".join(f"{n} {c} -> {m}" for n, c, m in mismatched[:8]))
    return state_dict, load_config, mismatched


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


def _make_checked_load(original: Callable[..., Any], patch: Any) -> Callable[..., Any]:
    """`_load_state_dict_into_zero3_model` with the checkpoint checked on every rank, status checks before and after
    the load (rank 0 alone loads; its failure, its `error_msgs` included, raises on every rank) and the
    parameters' names known to the verification."""

    @functools.wraps(original)
    def load(model_to_load: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        if not patch.active:
            return original(model_to_load, state_dict, *args, **kwargs)
        load_config = args[0] if args else kwargs.get("load_config")
        if getattr(_load_ctx, "inside", False) or not _zero3_distributed(load_config):
            # inside: transformers.modeling_utils imported after transformers.integrations.deepspeed was patched
            # holds our wrapper of the latter as its "original": check and agree once per load
            return _armed_call(original, model_to_load, state_dict, *args, **kwargs)
        _load_ctx.inside = True
        try:
            return _checked_load(original, model_to_load, state_dict, args, kwargs)
        finally:
            _load_ctx.inside = False

    return load


def _checked_load(original: Callable[..., Any], model_to_load: Any, state_dict: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
    _load_ctx.pending = False
    failure: Optional[Exception] = None
    mismatched: list[Any] = []
    try:
        load_config = args[0] if args else kwargs.get("load_config")
        state_dict, checked_config, mismatched = _check_checkpoint(model_to_load, state_dict, load_config)
        if checked_config is not load_config:  # the conversions are applied: not twice
            if args:
                args = (checked_config,) + args[1:]
            else:
                kwargs = {**kwargs, "load_config": checked_config}
    except Exception as e:  # noqa: BLE001  (raised on every rank by the status check)
        failure = e
    _agree(failure, "reading and checking the checkpoint")
    failure, result = None, None
    try:
        with _Named(model_to_load):
            result = _armed_call(original, model_to_load, state_dict, *args, **kwargs)
        error_msgs = result[0] if isinstance(result, tuple) and result else None
        if error_msgs:  # rank 0's _load_from_state_dict: transformers raises them on rank 0 only, later
            failure = RuntimeError(f"Error(s) in loading state_dict for {type(model_to_load).__name__}:\n\t"
                                   + "\n\t".join(error_msgs))
    except Exception as e:  # noqa: BLE001
        if _agreed(e):
            raise
        failure = e
    _agree(failure, "loading the checkpoint (rank 0's _load_from_state_dict)")
    _load_ctx.mismatched = mismatched
    return result


def _receives_weights_only(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """ZeRO-3 (not quantized) and a rank other than 0, which `_load_state_dict_into_zero3_model` never loads on
    (it tests the global rank): the op's decision with the global rank."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    load_config = args[1] if len(args) > 1 else kwargs.get("load_config")
    dist = _dist()
    if not is_deepspeed_zero3_enabled() or getattr(load_config, "is_quantized", False):
        return False
    if not (dist.is_available() and dist.is_initialized()):
        return False
    first = next(iter(model.parameters()), None)
    return first is not None and _decide(first, dist.get_rank())


def _make_meta_load(original: Callable[..., Any], patch: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_state_dict(checkpoint_file: Any, map_location: Any = "cpu", *args: Any, **kwargs: Any) -> Any:
        buffers = getattr(_meta_read, "buffers", None)
        if not patch.active or buffers is None:
            return original(checkpoint_file, map_location, *args, **kwargs)
        if map_location == "meta":  # transformers >= 5.23 does it itself (and broadcasts the buffers from rank 0)
            log_once("zero3-meta-read", logging.INFO, "hsoffload.zero3_loading: transformers reads the checkpoint as "
                     "meta tensors on this rank itself; hsoffload's meta read stands aside")
            state = original(checkpoint_file, map_location, *args, **kwargs)
            _count_read([v for v in state.values() if isinstance(v, torch.Tensor) and v.is_meta], real=0)
            return state
        state = original(checkpoint_file, "meta", *args, **kwargs)
        wanted = [k for k in state if k in buffers]
        if wanted:
            path = str(checkpoint_file)
            if path.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(path, framework="pt") as f:
                    for k in wanted:
                        state[k] = f.get_tensor(k).to(map_location)
            else:  # a pickled checkpoint cannot be read entry by entry
                full = original(checkpoint_file, map_location, *args, **kwargs)
                for k in wanted:
                    state[k] = full[k]
                del full
        _count_read([v for k, v in state.items() if k not in buffers], real=len(wanted))
        return state

    return load_state_dict


def _count_read(meta: list[torch.Tensor], real: int) -> None:
    """The counters of one checkpoint file a receiving rank read: entries as meta (and their bytes, not read), for real."""
    _add(meta_read_tensors=len(meta), meta_read_bytes=sum(v.numel() * v.element_size() for v in meta),
         real_read_tensors=real)


# --------------------------------------------------------------------------- patches


class _AttrPatch:
    """One attribute of a class or module wrapped by us: install wraps what is there, remove restores it exactly
    while ours is on top (else ours turns into a pass-through)."""

    def __init__(self, owner: Callable[[], Any], name: str, make: Callable[[Callable[..., Any], Any], Any]) -> None:
        self._owner, self.name, self._make = owner, name, make
        self.installed: Any = None
        self.previous: Any = None
        self.active = False

    def install(self) -> bool:
        """Wrap the attribute; False (nothing done, logged) where this DeepSpeed / transformers has none."""
        owner = self._owner()
        if self.installed is not None and owner.__dict__.get(self.name) is self.installed:
            self.active = True
            return True
        if self.name not in owner.__dict__:
            log_once(f"zero3-missing:{self.name}", logging.INFO,
                     "hsoffload.zero3_loading: %s has no %s (another version): that part stays stock",
                     getattr(owner, "__name__", owner), self.name)
            return False
        self.previous = owner.__dict__[self.name]
        self.installed = self._make(self.previous, self)
        self.active = True
        setattr(owner, self.name, self.installed)
        return True

    def remove(self) -> bool:
        if self.installed is None:
            return False
        owner = self._owner()
        self.active = False
        if owner.__dict__.get(self.name) is self.installed:
            setattr(owner, self.name, self.previous)
            self.installed = self.previous = None
            return True
        logger.warning("hsoffload.zero3_loading: %s was patched again after us; ours now only forwards", self.name)
        return False


def _init_class() -> Any:
    from deepspeed.runtime.zero.partition_parameters import Init

    return Init


def _ds_zero_module() -> Any:
    import deepspeed.runtime.zero as zero

    return zero


def _hf_ds_module() -> Any:
    import transformers.integrations.deepspeed as m

    return m


def _hf_modeling_module() -> Any:
    import transformers.modeling_utils as m

    return m


def _pretrained_model_class() -> Any:
    from transformers import PreTrainedModel

    return PreTrainedModel


def _auto_config_class() -> Any:
    from transformers import AutoConfig

    return AutoConfig


def _make_armed(original: Callable[..., Any], patch: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not patch.active:
            return original(*args, **kwargs)
        with _Named(args[0] if args else kwargs.get("model")):
            return _armed_call(original, *args, **kwargs)

    return wrapper


def _make_gathered(previous: Any, patch: Any) -> Any:
    _STOCK_GATHERED[0] = previous
    return RootGatheredParameters


ZERO_INIT_PARAM = _AttrPatch(_init_class, "_zero_init_param", _make_zero_init_param)
GATHERED = _AttrPatch(_ds_zero_module, "GatheredParameters", _make_gathered)
INITIALIZE_WEIGHTS = _AttrPatch(_hf_ds_module, "initialize_weights_zero3", _make_armed)
LOAD_ZERO3 = _AttrPatch(_hf_ds_module, "_load_state_dict_into_zero3_model", _make_checked_load)
LOAD_ZERO3_MODELING = _AttrPatch(_hf_modeling_module, "_load_state_dict_into_zero3_model", _make_checked_load)
LOAD_PRETRAINED = _AttrPatch(_pretrained_model_class, "_load_pretrained_model", _make_load_pretrained)
META_LOAD = _AttrPatch(_hf_modeling_module, "load_state_dict", _make_meta_load)
FROM_PRETRAINED = _AttrPatch(_pretrained_model_class, "from_pretrained", _make_outer)
FROM_CONFIG = _AttrPatch(_pretrained_model_class, "_from_config", _make_outer)
# The Auto classes read the config before they call the model class's: a config missing on one rank fails there
# (each Auto model class has its own copy of from_pretrained; the config they read first comes from AutoConfig: a
# failure there agrees, a success does not, since a config may be read on one rank alone)
AUTO_CONFIG = _AttrPatch(_auto_config_class, "from_pretrained", functools.partial(_make_outer, on_success=False))
_PATCHES = (ZERO_INIT_PARAM, GATHERED, INITIALIZE_WEIGHTS, LOAD_ZERO3, LOAD_ZERO3_MODELING, LOAD_PRETRAINED, META_LOAD,
            FROM_PRETRAINED, FROM_CONFIG, AUTO_CONFIG)
_lock = threading.Lock()


def patch(verify: bool = False, failure_wait_s: float = 60.0) -> None:
    """Install the root-only collectives (idempotent; the last call's `verify` holds). Call it on every rank, with
    the same `verify`, before building or loading the model under ZeRO-3. `verify=True` compares a checksum of every
    partition after each scatter with rank 0's slice of the values it scattered (a gather of 16 bytes per parameter
    and the checksums' reads of every byte once more: for tests and first runs of a new set-up). Raises ImportError
    without DeepSpeed or transformers, TypeError for a `verify` that is not a bool.

    `failure_wait_s`: how long a rank that failed before its model existed waits for the other ranks' status check
    before it raises its own error alone (they reach one before zero.Init's first scatter; a rank that is elsewhere,
    in a collective of someone else's, is not waited for longer). ValueError unless a number > 0."""
    if not isinstance(verify, bool):
        raise TypeError(f"hsoffload.zero3_loading.patch: verify must be True or False, got {verify!r}")
    if isinstance(failure_wait_s, bool) or not isinstance(failure_wait_s, (int, float)) or not failure_wait_s > 0:
        raise ValueError(f"hsoffload.zero3_loading.patch: failure_wait_s must be a number of seconds > 0, got "
                         f"{failure_wait_s!r} (default 60)")
    with _lock:
        _settings["verify"] = verify
        _settings["failure_wait_s"] = float(failure_wait_s)
        _hf_modeling_module()  # imported first, so that it holds transformers' own function, not our wrapper of it
        for p in _PATCHES:
            p.install()
    logger.info("hsoffload.zero3_loading: patched zero.Init._zero_init_param, initialize_weights_zero3 and "
                "_load_state_dict_into_zero3_model (ranks other than group rank 0 receive only their partition; "
                "verify=%s)", verify)


def unpatch() -> bool:
    """Undo `patch()`; True if every attribute was restored exactly."""
    with _lock:
        return all([p.remove() for p in reversed(_PATCHES)])


def is_patched() -> bool:
    return ZERO_INIT_PARAM.installed is not None and ZERO_INIT_PARAM.active
