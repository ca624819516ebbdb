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

Which rank receives is decided by `torch.ops.hsoffload.skip_init_zero3` (docs/ops.md) from the rank in the
parameter's partition group; the tensors it flags are recorded in an `InitSkipRecord` (the counters).

**Every rank must patch** (as every rank enters `zero.Init`): the collectives change on all of them. A rank that
did not patch would broadcast where the others scatter. Call `hsoffload.zero3_loading.patch()` in the script every
rank runs, before `from_config` / `from_pretrained`. The Axolotl plugin calls it with `hsoffload_zero3_loading: true`
and a ZeRO-3 `deepspeed:` config (every rank runs the plugin); the Trainer integration cannot (the model exists before the Trainer).

Stock collectives are kept (on every rank, decided from facts all ranks share) for: hpZ (`zero_hpz_partition_size`
> 1: secondary partitions read other slices), quantized weights or quantized initialisation, NVMe parameter offload,
persistent parameters (`ds_persist`: kept whole on every rank), non-contiguous parameters, a single-rank group, and
`GatheredParameters` anywhere but inside the two transformers functions above (elsewhere every rank may read the
gathered values). Thread-safety: the swapped `GatheredParameters` is used only by the thread inside a patched
transformers call (a thread-local flag); the counters take a lock.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import Any, Callable, Iterable, Optional

import torch

from ._logging import log_once

logger = logging.getLogger("hsoffload")

__all__ = ["RootGatheredParameters", "Zero3LoadStats", "is_patched", "patch", "reset_stats", "stats", "unpatch"]


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
        if _decide(param, rank):
            # DeepSpeed allocates the partition and frees the full-size buffer, which nothing wrote: reading its
            # untouched pages maps the kernel's zero page, so it never becomes resident (nor kept by the allocator).
            # Rank 0's values then go straight into the partition.
            full = flat.numel() * flat.element_size()
            del flat
            param.partition()
            got = _receive_slice(param.ds_tensor, _valid(param.ds_numel, part, rank), part, src, group)
            _add(scattered_params=1, received_params=1, received_bytes=got, skipped_full_bytes=full - got)
        else:
            _send_slices(flat, part, world, src, group)
            _add(scattered_params=1)
            del flat
            param.partition()

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

    def __enter__(self) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        device = _comm_device()
        for p in self._params:
            group = p.ds_process_group
            rank, world, src = _group_facts(group)
            part = p.ds_tensor.ds_numel
            mine = p.ds_tensor if p.ds_tensor.device == device else p.ds_tensor.to(device)
            if _decide(p.ds_tensor, rank):
                _dist().gather(mine.view(torch.uint8), None, dst=src, group=group)
                self._full.append(None)
                full = p.ds_numel * p.element_size()
                _add(gathered_params=1, skipped_full_bytes=full)
            else:
                full = torch.empty(part * world, dtype=p.ds_tensor.dtype, device=device)
                chunks = [c.view(torch.uint8) for c in full.chunk(world)]
                _dist().gather(mine.view(torch.uint8), chunks, dst=src, group=group)
                p.data = full.narrow(0, 0, p.ds_numel).view(p.ds_shape)
                p.ds_status = ZeroParamStatus.AVAILABLE
                self._full.append(full)
                _add(gathered_params=1)

    def __exit__(self, *exc: Any) -> None:
        # Always run the exit collectives (as DeepSpeed does): a rank that raised inside the body must not leave the
        # others waiting in a scatter.
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        for p, full in zip(self._params, self._full):
            group = p.ds_process_group
            rank, world, src = _group_facts(group)
            part = p.ds_tensor.ds_numel
            if full is None:
                got = _receive_slice(p.ds_tensor, _valid(p.ds_numel, part, rank), part, src, group)
                _add(received_params=1, received_bytes=got)
            else:
                own = _send_slices(_flat_values(p), part, world, src, group)
                n = _valid(p.ds_numel, part, rank)
                if n > 0:
                    p.ds_tensor.narrow(0, 0, n).copy_(own.narrow(0, 0, n))
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        self._full = []
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


def _make_load_pretrained(previous: Any, patch: Any) -> Any:
    func = previous.__func__ if isinstance(previous, staticmethod) else previous

    @functools.wraps(func)
    def _load_pretrained_model(model: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        if not patch.active or state_dict is not None or not _receives_weights_only(model, args, kwargs):
            return func(model, state_dict, *args, **kwargs)
        _meta_read.buffers = _persistent_buffer_keys(model)
        try:
            return func(model, state_dict, *args, **kwargs)
        finally:
            _meta_read.buffers = None

    return staticmethod(_load_pretrained_model) if isinstance(previous, staticmethod) else _load_pretrained_model


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
        if not patch.active or buffers is None or map_location == "meta":
            return original(checkpoint_file, map_location, *args, **kwargs)
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
        meta = [v for k, v in state.items() if k not in buffers]
        _add(meta_read_tensors=len(meta), meta_read_bytes=sum(v.numel() * v.element_size() for v in meta),
             real_read_tensors=len(wanted))
        return state

    return load_state_dict


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
        return _armed_call(original, *args, **kwargs)

    return wrapper


def _make_gathered(previous: Any, patch: Any) -> Any:
    _STOCK_GATHERED[0] = previous
    return RootGatheredParameters


ZERO_INIT_PARAM = _AttrPatch(_init_class, "_zero_init_param", _make_zero_init_param)
GATHERED = _AttrPatch(_ds_zero_module, "GatheredParameters", _make_gathered)
INITIALIZE_WEIGHTS = _AttrPatch(_hf_ds_module, "initialize_weights_zero3", _make_armed)
LOAD_ZERO3 = _AttrPatch(_hf_ds_module, "_load_state_dict_into_zero3_model", _make_armed)
LOAD_ZERO3_MODELING = _AttrPatch(_hf_modeling_module, "_load_state_dict_into_zero3_model", _make_armed)
LOAD_PRETRAINED = _AttrPatch(_pretrained_model_class, "_load_pretrained_model", _make_load_pretrained)
META_LOAD = _AttrPatch(_hf_modeling_module, "load_state_dict", _make_meta_load)
_PATCHES = (ZERO_INIT_PARAM, GATHERED, INITIALIZE_WEIGHTS, LOAD_ZERO3, LOAD_ZERO3_MODELING, LOAD_PRETRAINED, META_LOAD)
_lock = threading.Lock()


def patch() -> None:
    """Install the root-only collectives (idempotent). Call it on every rank, before building or loading the model
    under ZeRO-3. Raises ImportError without DeepSpeed or transformers."""
    with _lock:
        for p in _PATCHES:
            p.install()
    logger.info("hsoffload.zero3_loading: patched zero.Init._zero_init_param, initialize_weights_zero3 and "
                "_load_state_dict_into_zero3_model (ranks other than group rank 0 receive only their partition)")


def unpatch() -> bool:
    """Undo `patch()`; True if every attribute was restored exactly."""
    with _lock:
        return all([p.remove() for p in reversed(_PATCHES)])


def is_patched() -> bool:
    return ZERO_INIT_PARAM.installed is not None and ZERO_INIT_PARAM.active
