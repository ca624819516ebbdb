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
  rank its own exception, the others a `Zero3LoadError` quoting its message, broadcast with
  `broadcast_object_list`). `__exit__` finishes every scatter before it raises, so no rank is left in one;
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
    skip = bool(torch.ops.hsoffload.skip_init_zero3([tensor], group_rank, True)[0])
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


def _pieces(flat: torch.Tensor, part: int, world: int) -> list[torch.Tensor]:
    """Rank 0's scatter list: each rank's slice of `flat` as bytes (a padded copy where the slice is short)."""
    out = []
    for r in range(world):
        n = _valid(flat.numel(), part, r)
        if n == part:
            out.append(flat.narrow(0, r * part, part).view(torch.uint8))
        else:
            buf = torch.zeros(part, dtype=flat.dtype, device=flat.device)
            if n > 0:
                buf.narrow(0, 0, n).copy_(flat.narrow(0, r * part, n))
            out.append(buf.view(torch.uint8))
    return out


def _comm_device() -> torch.device:
    """Where DeepSpeed's own collectives put their buffers (the accelerator's current device; the CPU on DeepSpeed's
    CPU accelerator). A partition kept elsewhere (ZeRO-Offload on the host under NCCL) travels through a copy."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def _receive_slice(target: torch.Tensor, valid: int, part: int, src: int, group: Any) -> int:
    """Receive this rank's slice (a scatter from `src` of `part` elements) and write its first `valid` elements into
    `target` (1-D, at least `valid` elements): directly when the slice has no padding and `target` is on the
    communication device, else through a buffer of `part` elements. Returns the bytes written."""
    device = _comm_device()
    if valid == part and target.numel() == part and target.is_contiguous() and target.device == device:
        _dist().scatter(target.view(torch.uint8), None, src=src, group=group)
    else:
        tmp = torch.empty(part, dtype=target.dtype, device=device)
        _dist().scatter(tmp.view(torch.uint8), None, src=src, group=group)
        if valid > 0:
            target.narrow(0, 0, valid).copy_(tmp.narrow(0, 0, valid))
    return valid * target.element_size()


def _send_slices(flat: torch.Tensor, part: int, world: int, src: int, group: Any) -> torch.Tensor:
    """Rank 0's side of the scatter; returns its own slice (a separate buffer, never an alias of the input)."""
    pieces = _pieces(flat, part, world)
    own = torch.empty(part, dtype=flat.dtype, device=flat.device)
    _dist().scatter(own.view(torch.uint8), pieces, src=src, group=group)
    return own


# --------------------------------------------------------------------------- failing together, verifying


class Zero3LoadError(RuntimeError):
    """Raised on a rank whose own part succeeded while another rank failed: the message quotes that rank's error."""


_settings = {"verify": False}  # patch(verify=...)
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


def _agree(failure: Optional[BaseException], stage: str, group: Any = None) -> None:
    """A status check: every rank of `group` (default: the world) calls it at the same point of the same code. When no
    rank failed, returns. Otherwise every rank raises here: a rank that failed its own exception, the others a
    Zero3LoadError quoting the message of the lowest failed rank (broadcast from it), so that none goes on into a
    collective the failed ranks will never join."""
    dist = _dist()
    world = dist.get_world_size(group=group)
    rank = dist.get_rank(group=group)
    flag = torch.tensor([rank if failure is not None else world], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    _add(status_checks=1)
    src = int(flag.item())
    if src == world:
        return
    message = [_describe(failure) if rank == src and failure is not None else None]
    src_global = dist.get_global_rank(group, src) if group is not None else src
    dist.broadcast_object_list(message, src=src_global, group=group)
    if failure is not None:
        logger.error("hsoffload.zero3_loading: this rank failed while %s; every rank raises: %s", stage,
                     _describe(failure))
        raise _mark(failure)
    raise _mark(Zero3LoadError(
        f"hsoffload.zero3_loading: rank {src_global} failed while {stage}, so this rank (rank {dist.get_rank()}) "
        f"stops too instead of waiting in a collective for it. Fix what rank {src_global} reports: {message[0]}"))


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


def _verify_partitions(labels: list[str], mine: list[torch.Tensor], expected: Optional[list[list[torch.Tensor]]],
                       src: int, group: Any) -> Optional[Exception]:
    """Gather every rank's partition checksums (`mine`, one per parameter) to group rank 0 (global rank `src`),
    which compares them with `expected[rank][i]`, the checksums of its slices of the full values it scattered.
    Returns rank 0's mismatch error (None elsewhere and when all match): the caller's status check raises it
    everywhere."""
    dist = _dist()
    world = dist.get_world_size(group=group)
    device = _comm_device()
    local = torch.stack(mine).to(device) if mine else torch.zeros(0, 2, dtype=torch.int64, device=device)
    _add(verified_params=len(mine))
    if expected is None:
        dist.gather(local, None, dst=src, group=group)
        return None
    got = [torch.empty_like(local) for _ in range(world)]
    dist.gather(local, got, dst=src, group=group)
    bad = []
    for r in range(world):
        want = torch.stack(expected[r]).to(device) if mine else local
        for i in torch.nonzero((got[r] != want).any(dim=1)).flatten().tolist():
            bad.append(f"{labels[i]} on group rank {r}: partition checksum {got[r][i].tolist()}, rank 0's slice "
                       f"{want[i].tolist()}")
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
            _dist().broadcast(param.data.view(torch.uint8), src, group=group)
            param.partition()
            return
        part = self._aligned_size(param) // self._partition_world_size(param)  # as _partition_param computes it
        flat = param.data.view(-1)
        valid = _valid(param.ds_numel, part, rank)
        expected: Optional[list[list[torch.Tensor]]] = None
        if _decide(param, rank):
            # DeepSpeed allocates the partition and frees the full-size buffer, which nothing wrote: reading its
            # untouched pages maps the kernel's zero page, so it never becomes resident (nor kept by the allocator).
            # Rank 0's values then go straight into the partition.
            full = flat.numel() * flat.element_size()
            del flat
            param.partition()
            got = _receive_slice(param.ds_tensor, valid, part, src, group)
            _add(scattered_params=1, received_params=1, received_bytes=got, skipped_full_bytes=full - got)
        else:
            if _settings["verify"]:
                expected = [[c] for c in _slice_checksums(flat, part, world)]
            _send_slices(flat, part, world, src, group)
            _add(scattered_params=1)
            del flat
            param.partition()
        if _settings["verify"]:
            mine = [_checksum(param.ds_tensor.narrow(0, 0, valid))]
            failure = _verify_partitions([_label(param)], mine, expected, src, group)
            _agree(failure, "verifying zero.Init's partitions", group)

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
        # Every scatter runs, whatever failed on this rank (as DeepSpeed's exit broadcasts always run): the receiving
        # ranks are waiting in them. Then a status check raises any rank's failure on every rank.
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        failure: Optional[BaseException] = exc if isinstance(exc, Exception) else None
        verify = _settings["verify"]
        labels: list[str] = []
        mine: list[torch.Tensor] = []
        expected: Optional[list[list[torch.Tensor]]] = None
        src = 0

        def attempt(step: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
            """A rank-local step between the collectives: its failure is raised on every rank at the status check
            below, never before a collective the other ranks are waiting in."""
            nonlocal failure
            try:
                return step()
            except Exception as e:  # noqa: BLE001
                failure = failure or e
                return fallback()

        def zero_sum() -> torch.Tensor:
            return torch.zeros(2, dtype=torch.int64, device=_comm_device())

        for p, full in zip(self._params, self._full):
            group = p.ds_process_group
            rank, world, src = _group_facts(group)
            part = p.ds_tensor.ds_numel
            n = _valid(p.ds_numel, part, rank)
            if full is None:
                got = _receive_slice(p.ds_tensor, n, part, src, group)
                _add(received_params=1, received_bytes=got)
                if _TEST_HOOKS["after_receive"] is not None:
                    _TEST_HOOKS["after_receive"](_label(p), p.ds_tensor)
            else:
                try:
                    flat = _flat_values(p)
                except Exception as e:  # noqa: BLE001  (raised below, on every rank, after the scatters)
                    failure = failure or e
                    flat = full.narrow(0, 0, p.ds_numel)  # something of the right size, so the receivers finish
                if verify:
                    expected = expected or [[] for _ in range(world)]
                    sums = attempt(lambda: _slice_checksums(flat, part, world), lambda: [zero_sum()] * world)
                    for r, c in enumerate(sums):
                        expected[r].append(c)
                own = _send_slices(flat, part, world, src, group)

                def keep_own(p: Any = p, own: torch.Tensor = own, n: int = n) -> None:
                    if n > 0:
                        p.ds_tensor.narrow(0, 0, n).copy_(own.narrow(0, 0, n))
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                    p.ds_status = ZeroParamStatus.NOT_AVAILABLE

                attempt(keep_own, lambda: None)
            if verify:
                labels.append(_label(p))
                mine.append(attempt(lambda p=p, n=n: _checksum(p.ds_tensor.narrow(0, 0, n)), zero_sum))
        self._full = []
        if verify and self._params:
            # Every rank gathers, whatever failed here: a rank skipping it would leave the others in the gather.
            mismatch = _verify_partitions(labels, mine, expected, src, self._group())
            failure = failure or mismatch
        if failure is not None and failure is exc and _agreed(exc):
            return None  # already raised on every rank (a nested status check)
        _agree(failure, "inside GatheredParameters (rank 0's init or load of gathered parameters)", self._group())
        return None


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
_PATCHES = (ZERO_INIT_PARAM, GATHERED, INITIALIZE_WEIGHTS, LOAD_ZERO3, LOAD_ZERO3_MODELING, LOAD_PRETRAINED, META_LOAD)
_lock = threading.Lock()


def patch(verify: bool = False) -> None:
    """Install the root-only collectives (idempotent; the last call's `verify` holds). Call it on every rank, with
    the same `verify`, before building or loading the model under ZeRO-3. `verify=True` compares a checksum of every
    partition after each scatter with rank 0's slice of the values it scattered (a gather of 16 bytes per parameter
    and the checksums' reads of every byte once more: for tests and first runs of a new set-up). Raises ImportError
    without DeepSpeed or transformers, TypeError for a `verify` that is not a bool."""
    if not isinstance(verify, bool):
        raise TypeError(f"hsoffload.zero3_loading.patch: verify must be True or False, got {verify!r}")
    with _lock:
        _settings["verify"] = verify
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
