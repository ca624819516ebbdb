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
- a status all-reduce (`_agree`, in zero3_collectives.py) runs after rank 0 read the checkpoint, after the load, and around every
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

The rooms: this module holds the public API, the two collectives' patches (zero.Init's scatter,
`RootGatheredParameters`) and the patch table (each patch one `ClassPatch`); `zero3_collectives.py` the geometry,
the status checks and the counters; `zero3_checksums.py` the verification; `zero3_checkpoint.py` the
`from_pretrained` side. Their names used by tests are this module's too.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import Any, Callable, Iterable, Optional

import torch

from .._logging import log_once
from ..classpatch import ClassPatch
from .zero3_checkpoint import (_check_checkpoint, _hf_ds_module, _make_checked_load, _make_load_pretrained,  # noqa: F401
                               _make_meta_load, _make_outer)
from .zero3_checksums import _checksum, _slice_checksums, _verify_partitions, _VerifyBuffers  # noqa: F401
from .zero3_collectives import (_AGREED, Zero3LoadError, Zero3LoadStats, Zero3StatusTimeout,  # noqa: F401
                                _add, _agree, _agreed, _armed, _armed_call, _comm_device, _decide, _defer, _dist,
                                _finish_receive, _group_facts, _label, _Named, _receive_buffer, _send_buffers,
                                _settings, _valid, reset_stats, stats)

logger = logging.getLogger("hsoffload")

__all__ = ["RootGatheredParameters", "Zero3LoadError", "Zero3LoadStats", "is_patched", "patch", "reset_stats", "stats",
           "unpatch"]


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the loading collectives allocate for themselves (receive buffers, rank 0's own slice and padded
    slices, the verification's checksums) comes from here, before the first scatter it serves; tests cap it (they
    replace this module's `_scratch`: every caller passes it at call time)."""
    return torch.empty(numel, dtype=dtype, device=device)


# For tests only: after_receive(label, partition) runs on a receiving rank after each slice a RootGatheredParameters
# exit wrote (the worker corrupts one byte to prove that verify=True notices).
_TEST_HOOKS: dict[str, Optional[Callable[[str, torch.Tensor], None]]] = {"after_receive": None}


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
                buf = _receive_buffer(target, valid, part, _scratch)
            else:
                flat = param.data.view(-1)
                pieces, own = _send_buffers(flat, part, world, _scratch)
                if verify:
                    expected = [[c] for c in _slice_checksums(flat, part, world)]
            if verify:
                checks = _VerifyBuffers.allocate(1, world, not receives, _scratch)
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
                    step.buf = _receive_buffer(p.ds_tensor, step.valid, part, _scratch)
                elif failure is None:  # rank 0 after a body that succeeded
                    flat = _flat_values(p)
                    step.pieces, step.buf = _send_buffers(flat, part, world, _scratch)
                    if verify:
                        expected = expected or [[] for _ in range(world)]
                        for r, c in enumerate(_slice_checksums(flat, part, world)):
                            expected[r].append(c)
                steps.append(step)
            if verify and self._params:
                checks = _VerifyBuffers.allocate(len(steps), _dist().get_world_size(group=self._group()),
                                                 any(full is not None for full in full_copies), _scratch)
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


def _init_class() -> Any:
    from deepspeed.runtime.zero.partition_parameters import Init

    return Init


def _ds_zero_module() -> Any:
    import deepspeed.runtime.zero as zero

    return zero


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


# Every attribute ZeRO-3 loading wraps, each one ClassPatch (hsoffload.classpatch), installed in this order and removed
# in the reverse; an attribute this DeepSpeed / transformers does not have stays stock (logged once).
ZERO_INIT_PARAM = ClassPatch(_init_class, "_zero_init_param", _make_zero_init_param, missing_ok=True)
GATHERED = ClassPatch(_ds_zero_module, "GatheredParameters", _make_gathered, missing_ok=True)
INITIALIZE_WEIGHTS = ClassPatch(_hf_ds_module, "initialize_weights_zero3", _make_armed, missing_ok=True)
LOAD_ZERO3 = ClassPatch(_hf_ds_module, "_load_state_dict_into_zero3_model", _make_checked_load, missing_ok=True)
LOAD_ZERO3_MODELING = ClassPatch(_hf_modeling_module, "_load_state_dict_into_zero3_model", _make_checked_load,
                                 missing_ok=True)
LOAD_PRETRAINED = ClassPatch(_pretrained_model_class, "_load_pretrained_model", _make_load_pretrained, missing_ok=True)
META_LOAD = ClassPatch(_hf_modeling_module, "load_state_dict", _make_meta_load, missing_ok=True)
FROM_PRETRAINED = ClassPatch(_pretrained_model_class, "from_pretrained", _make_outer, missing_ok=True)
FROM_CONFIG = ClassPatch(_pretrained_model_class, "_from_config", _make_outer, missing_ok=True)
# The Auto classes read the config before they call the model class's: a config missing on one rank fails there
# (each Auto model class has its own copy of from_pretrained; the config they read first comes from AutoConfig: a
# failure there agrees, a success does not, since a config may be read on one rank alone)
AUTO_CONFIG = ClassPatch(_auto_config_class, "from_pretrained", functools.partial(_make_outer, on_success=False),
                         missing_ok=True)
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
