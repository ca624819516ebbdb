"""FSDP RAM-efficient loading: processes that get their weights by broadcast skip weight init.

With FSDP and `cpu_ram_efficient_loading` (`ACCELERATE_USE_FSDP=1`,
`FSDP_CPU_RAM_EFFICIENT_LOADING=1`, torch.distributed initialized) only rank 0 (every node's
local rank 0, for transformers) loads real weights; the other ranks receive theirs by broadcast
after sharding. `patch()` makes those other ranks do no initialisation work and hold no
model-sized memory while loading:

* `PreTrainedModel._initialize_missing_keys` (any signature, `*args, **kwargs` pass-through)
  asks `torch.ops.hsoffload.skip_init_non_rank0` whether this process skips init. If it does,
  the op records every parameter's and persistent buffer's storage in an `InitSkipRecord`, the
  tensors get `_is_hf_initialized` (what transformers' guarded `init.*` functions honour; only
  where the installed transformers lacks upstream fix #44473), submodules whose whole subtree is
  flagged are marked initialised (so their Python `_init_weights` is not even called), and the
  original runs inside a `TorchDispatchMode` that drops every write into a flagged storage --
  the unguarded ones too (`module.weight.data.normal_()`) -- and counts them.
  Non-persistent buffers (rotary `inv_freq`) are not flagged: they are initialised as stock.
* `PreTrainedModel._move_missing_keys_from_meta_to_device` (transformers 5.x, whose FSDP branch
  materialises every parameter on non-rank-0 with `zeros_like`/`empty_like`) runs inside a
  `TorchFunctionMode` that turns those meta -> CPU placeholders into lazily committed zeros
  (`InitSkipRecord.lazy_zeros_like`): defined values (zeros), but no resident memory until the
  broadcast writes them.

On rank 0, without FSDP or with the env gate unset both wrappers call the original untouched
(stock behaviour) and log once, at info level, why they are inactive.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import threading
from typing import Any, Callable, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ._logging import log_once as _log_once

logger = logging.getLogger("hsoffload")

__all__ = [
    "InitSkipReport",
    "RankFacts",
    "has_upstream_fix",
    "is_patched",
    "last_report",
    "patch",
    "patch_initialize_missing_keys_for_fsdp",
    "rank_facts",
    "unpatch",
]

_INIT_NAME = "_initialize_missing_keys"
_MOVE_NAME = "_move_missing_keys_from_meta_to_device"
_MISSING = object()  # "the class had no attribute of its own"
_TRUE = {"1", "y", "yes", "t", "true", "on"}
_FALSE = {"0", "n", "no", "f", "false", "off", ""}

_lock = threading.Lock()  # serialises patch()/unpatch()




# --------------------------------------------------------------------------- rank facts


def _env_flag(name: str) -> bool:
    """transformers' `strtobool` reading of an env var; unparsable values count as false (logged)."""
    raw = os.environ.get(name, "False").strip().lower()
    if raw in _TRUE:
        return True
    if raw not in _FALSE:
        _log_once(f"env:{name}", logging.WARNING, "hsoffload.fsdp: %s=%r is not a boolean; treated as false", name, raw)
    return False


@dataclasses.dataclass(frozen=True)
class RankFacts:
    """What this process knows about itself, as passed to `skip_init_non_rank0`."""

    rank: int  # torch.distributed.get_rank(); -1 without a process group
    local_rank: int  # LOCAL_RANK (the launcher's), else torch's node-local rank; -1 when unknown
    world_size: int  # 1 without a process group
    fsdp_enabled: bool  # process group initialized and ACCELERATE_USE_FSDP truthy
    cpu_ram_efficient_loading: bool  # FSDP_CPU_RAM_EFFICIENT_LOADING truthy


def rank_facts() -> RankFacts:
    """Collect the facts from torch.distributed and the launcher's environment.

    The process group decides `rank`; LOCAL_RANK alone never makes a process skip: the op never
    skips on global rank 0, whatever LOCAL_RANK says (or when it is unset).
    """
    dist = torch.distributed
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else -1
    world = dist.get_world_size() if initialized else 1
    local_env = os.environ.get("LOCAL_RANK")
    try:
        local_rank = int(local_env) if local_env is not None else -1
    except ValueError:
        _log_once("env:LOCAL_RANK", logging.WARNING, "hsoffload.fsdp: LOCAL_RANK=%r is not an integer", local_env)
        local_rank = -1
    return RankFacts(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        fsdp_enabled=initialized and _env_flag("ACCELERATE_USE_FSDP"),
        cpu_ram_efficient_loading=_env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING"),
    )


# --------------------------------------------------------------------------- report


@dataclasses.dataclass(frozen=True)
class InitSkipReport:
    """What one patched `_initialize_missing_keys` call did (see `last_report()`)."""

    skipped: bool  # this process skipped init
    reason: str  # why (the op's decision)
    upstream_fix: bool  # the installed transformers already flags non-rank-0 tensors itself
    flagged_tensors: int = 0  # parameters + persistent buffers flagged (tied ones once per name)
    flagged_bytes: int = 0  # bytes of the distinct flagged storages
    dropped_writes: int = 0  # writes into flagged storages dropped by the dispatch mode
    dropped_bytes: int = 0
    skipped_modules: int = 0  # submodules marked initialised so their `_init_weights` was not called
    replaced_tensors: int = 0  # flagged tensors whose storage was replaced during init (`.data = ...`)
    lazy_placeholders: int = 0  # meta -> CPU placeholders made lazily committed zeros
    lazy_placeholder_bytes: int = 0


_last_report: Optional[InitSkipReport] = None
_placeholders = threading.local()  # per thread: [count, bytes] of the current load's lazy placeholders


def last_report() -> Optional[InitSkipReport]:
    """The report of the last patched `_initialize_missing_keys` call in this process (None before)."""
    return _last_report


# --------------------------------------------------------------------------- transformers facts


def _pretrained_model_class() -> type:
    from transformers import PreTrainedModel

    return PreTrainedModel


@functools.lru_cache(maxsize=None)
def has_upstream_fix() -> bool:
    """Whether the installed transformers flags non-rank-0 tensors itself (fix #44473, 5.4+).

    Read from the stock method's source (it then tests `is_fsdp_enabled()` itself); the version
    number decides only when the source is unavailable. 4.x needs no such fix (it never
    re-initialised non-rank-0 weights this way) and reports False.
    """
    cls = _pretrained_model_class()
    method = _state.previous.get(_INIT_NAME, _MISSING) if _state.installed else cls.__dict__.get(_INIT_NAME, _MISSING)
    if method is _MISSING:
        method = getattr(cls, _INIT_NAME, None)
    try:
        src = inspect.getsource(method)
        return "is_fsdp_enabled()" in src and "_is_hf_initialized = True" in src
    except (OSError, TypeError):
        import transformers
        from packaging.version import Version

        v = Version(transformers.__version__).release
        return v >= (5, 4)


def _tensors_to_flag(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(parameters + persistent buffers, non-persistent buffers), each tensor once."""
    flagged: list[torch.Tensor] = []
    kept: list[torch.Tensor] = []
    seen: set[int] = set()  # ids of tensors alive in the model for this call only
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                flagged.append(p)
        non_persistent = module._non_persistent_buffers_set
        for name, b in module._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                (kept if name in non_persistent else flagged).append(b)
    return flagged, kept


def _mark_fully_flagged_modules(model: torch.nn.Module, is_flagged: Callable[[torch.Tensor], bool]) -> int:
    """Mark `_is_hf_initialized` on submodules whose subtree holds only flagged tensors.

    Such a module's `_init_weights` could only write into flagged storages (dropped anyway), so
    transformers' `_initialize_weights` may skip the Python call. A subtree with a non-persistent
    buffer is never marked: its `_init_weights` may be what computes that buffer.
    """
    memo: dict[int, bool] = {}

    def clean(module: torch.nn.Module) -> bool:
        key = id(module)
        if key not in memo:
            ok = all(p is None or is_flagged(p) for p in module._parameters.values())
            ok = ok and not any(
                b is not None and n in module._non_persistent_buffers_set for n, b in module._buffers.items()
            )
            ok = ok and all(b is None or is_flagged(b) for b in module._buffers.values())
            ok = ok and all(clean(c) for c in module.children())
            memo[key] = ok
        return memo[key]

    marked = 0
    for module in model.modules():
        if module is not model and clean(module) and not getattr(module, "_is_hf_initialized", False):
            module._is_hf_initialized = True
            marked += 1
    return marked


# --------------------------------------------------------------------------- modes


@functools.lru_cache(maxsize=None)
def _write_plan(func: torch._ops.OpOverload) -> Optional[tuple[list[tuple[int, str]], list[Optional[tuple[int, str]]]]]:
    """For an op that writes some argument: (written args, what each return aliases); else None."""
    schema = func._schema
    written: list[tuple[int, str]] = []
    by_set: dict[str, tuple[int, str]] = {}
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is not None and info.is_write:
            written.append((i, arg.name))
            for s in info.before_set:
                by_set[s] = (i, arg.name)
    if not written:
        return None
    returns: list[Optional[tuple[int, str]]] = []
    for ret in schema.returns:
        info = ret.alias_info
        target = None
        if info is not None:
            target = next((by_set[s] for s in info.before_set if s in by_set), None)
        returns.append(target)
    return written, returns


def _arg(args: Sequence[Any], kwargs: dict[str, Any], where: tuple[int, str]) -> Any:
    i, name = where
    return args[i] if i < len(args) else kwargs.get(name)


class _DropFlaggedWrites(TorchDispatchMode):
    """Drops every op that writes only into flagged storages; counts them in the record.

    An op that writes a mix of flagged and unflagged tensors (a `_foreach_*_` over a list) runs
    on the unflagged ones only. An op whose result is not an alias of what it writes (nothing
    in init code) cannot be dropped: it runs, and is logged.
    """

    def __init__(self, record: Any) -> None:
        super().__init__()
        self._record = record

    def _flagged(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and bool(self._record.is_flagged(t))

    def _drop(self, t: torch.Tensor) -> None:
        self._record.note_dropped_write(t.numel() * t.element_size())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        plan = _write_plan(func)
        if plan is None:
            return func(*args, **kwargs)
        written, returns = plan
        targets = [_arg(args, kwargs, w) for w in written]
        flat = [t for x in targets for t in (x if isinstance(x, (list, tuple)) else [x]) if isinstance(t, torch.Tensor)]
        hits = [self._flagged(t) for t in flat]
        if not any(hits):
            return func(*args, **kwargs)
        droppable = all(r is not None for r in returns)
        if all(hits) and droppable:
            for t in flat:
                self._drop(t)
            outs = [_arg(args, kwargs, r) for r in returns]  # type: ignore[arg-type]
            if not outs:
                return None
            return outs[0] if len(outs) == 1 else tuple(outs)
        lists = [w for w, x in zip(written, targets) if isinstance(x, (list, tuple))]
        if len(lists) == 1 and all(r is None or r == lists[0] for r in returns) and not func._schema.returns:
            # `_foreach_op_(self, other...)`: drop the flagged entries of every list argument
            # of the same length, keep the rest.
            where = lists[0]
            full = _arg(args, kwargs, where)
            keep = [i for i, t in enumerate(full) if not self._flagged(t)]
            for i, t in enumerate(full):
                if i not in keep:
                    self._drop(t)
            n = len(full)

            def subset(x: Any) -> Any:
                return [x[i] for i in keep] if isinstance(x, (list, tuple)) and len(x) == n else x

            if keep:
                func(*[subset(a) for a in args], **{k: subset(v) for k, v in kwargs.items()})
            return None
        _log_once(
            f"mixed:{func}",
            logging.WARNING,
            "hsoffload.fsdp: %s writes into parameters that arrive by broadcast but cannot be "
            "dropped (mixed or non-aliasing outputs); it runs as stock",
            func,
        )
        return func(*args, **kwargs)


class _LazyPlaceholders(TorchFunctionMode):
    """Turns `zeros_like`/`empty_like(t, device="cpu")` into lazily committed zeros.

    Active only around `_move_missing_keys_from_meta_to_device` on a skipping rank, where those
    calls make the placeholders of every parameter and buffer (of meta tensors, or of the
    checkpoint's mmap-backed tensors that transformers 5.x loads on non-rank-0 too). Zeros are
    what `zeros_like` promises and a valid value for `empty_like`.
    """

    _FUNCS = (torch.zeros_like, torch.empty_like)

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.nbytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in self._FUNCS and args and isinstance(args[0], torch.Tensor):
            src = args[0]
            device = kwargs.get("device", src.device)
            extra = set(kwargs) - {"device", "dtype"}
            if (
                (src.is_meta or src.is_contiguous())
                and torch.device(device).type == "cpu"
                and src.layout == torch.strided
                and not extra
                and len(args) == 1
            ):
                # Another dtype: describe the result on the meta device (never a full-size copy of src).
                like = (
                    src
                    if kwargs.get("dtype") in (None, src.dtype)
                    else torch.empty_like(src, device="meta", dtype=kwargs["dtype"])
                )
                out = torch.classes.hsoffload.InitSkipRecord.lazy_zeros_like(like)
                self.count += 1
                self.nbytes += out.numel() * out.element_size()
                return out
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- the wrappers


def _decide(model: torch.nn.Module, tensors: list[torch.Tensor]) -> tuple[Any, list[bool]]:
    facts = rank_facts()
    record = torch.classes.hsoffload.InitSkipRecord()
    flags = torch.ops.hsoffload.skip_init_non_rank0(
        tensors, facts.rank, facts.local_rank, facts.fsdp_enabled, facts.cpu_ram_efficient_loading, record
    )
    return record, list(flags)


def _is_quantized_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """`is_quantized` (5.x: first positional; 4.56-4.57: second) / `hf_quantizer` when given."""
    if "is_quantized" in kwargs:
        return bool(kwargs["is_quantized"])
    if "hf_quantizer" in kwargs:
        return kwargs["hf_quantizer"] is not None
    bools = [a for a in args if isinstance(a, bool)]
    return bool(bools[-1]) if bools else False


def _make_initialize_missing_keys(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _initialize_missing_keys(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        global _last_report
        if not _state.active:
            return original(self, *args, **kwargs)
        fixed = has_upstream_fix()
        tensors, _ = _tensors_to_flag(self)
        record, flags = _decide(self, tensors)
        if not record.skip() or _is_quantized_call(args, kwargs):
            reason = "quantized model (left to transformers)" if record.skip() else record.reason()
            _log_once(f"inactive:{reason}", logging.INFO, "hsoffload.fsdp: weight init runs as stock: %s", reason)
            _last_report = InitSkipReport(skipped=False, reason=reason, upstream_fix=fixed)
            return original(self, *args, **kwargs)

        if not fixed:
            # What #44473 added upstream: guarded init skips tensors carrying this flag.
            for t, f in zip(tensors, flags):
                if f:
                    t._is_hf_initialized = True
        skipped_modules = _mark_fully_flagged_modules(self, lambda t: bool(record.is_flagged(t)))
        storages = [(t, t.untyped_storage().data_ptr()) for t, f in zip(tensors, flags) if f]
        with _DropFlaggedWrites(record):
            result = original(self, *args, **kwargs)
        replaced = sum(1 for t, ptr in storages if t.untyped_storage().data_ptr() != ptr)
        if replaced:
            logger.warning(
                "hsoffload.fsdp: %d flagged tensors got new storage during init (`.data = ...`); "
                "they hold whatever init wrote until the broadcast",
                replaced,
            )
        s = list(record.stats())
        count, nbytes = getattr(_placeholders, "last", (0, 0))
        _last_report = InitSkipReport(
            skipped=True,
            reason=record.reason(),
            upstream_fix=fixed,
            flagged_tensors=int(sum(flags)),
            flagged_bytes=s[2],
            dropped_writes=s[3],
            dropped_bytes=s[4],
            skipped_modules=skipped_modules,
            replaced_tensors=replaced,
            lazy_placeholders=count,
            lazy_placeholder_bytes=nbytes,
        )
        _log_once(
            "active",
            logging.INFO,
            "hsoffload.fsdp: skipped weight init (%s): %d tensors, %d writes dropped, %d modules not visited",
            record.reason(),
            _last_report.flagged_tensors,
            _last_report.dropped_writes,
            skipped_modules,
        )
        return result

    _initialize_missing_keys._hsoffload_fsdp = True  # type: ignore[attr-defined]
    return _initialize_missing_keys


def _make_move_missing_keys(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _move_missing_keys_from_meta_to_device(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        _placeholders.last = (0, 0)
        if not _state.active or _is_quantized_call(args, kwargs) or _quantizer_arg(args, kwargs):
            return original(self, *args, **kwargs)
        facts = rank_facts()
        record = torch.classes.hsoffload.InitSkipRecord()
        torch.ops.hsoffload.skip_init_non_rank0(
            [], facts.rank, facts.local_rank, facts.fsdp_enabled, facts.cpu_ram_efficient_loading, record
        )
        if not record.skip():
            return original(self, *args, **kwargs)
        mode = _LazyPlaceholders()
        with mode:
            result = original(self, *args, **kwargs)
        _placeholders.last = (mode.count, mode.nbytes)
        return result

    _move_missing_keys_from_meta_to_device._hsoffload_fsdp = True  # type: ignore[attr-defined]
    return _move_missing_keys_from_meta_to_device


def _quantizer_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """5.x `_move_missing_keys_from_meta_to_device(missing_keys, device_map, device_mesh, hf_quantizer)`."""
    q = kwargs.get("hf_quantizer", args[3] if len(args) > 3 else None)
    return q is not None


# --------------------------------------------------------------------------- patch / unpatch


@dataclasses.dataclass
class _PatchState:
    """The process-wide patch (a monkeypatch is process-wide by nature)."""

    installed: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)  # name -> our wrapper
    previous: dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> replaced class attribute
    active: bool = False  # False: our wrappers only forward (left in place under someone else's patch)


_state = _PatchState()


def _has_fsdp_placeholder_branch(method: Any) -> bool:
    """Whether `_move_missing_keys_from_meta_to_device` materialises non-rank-0 tensors itself."""
    try:
        src = inspect.getsource(method)
    except (OSError, TypeError):
        return False
    return "is_fsdp_enabled()" in src and ("zeros_like" in src or "empty_like" in src)


def patch() -> None:
    """Install the wrappers on `transformers.PreTrainedModel`. Idempotent; thread-safe."""
    cls = _pretrained_model_class()
    with _lock:
        _state.active = True
        names = [_INIT_NAME]
        move = getattr(cls, _MOVE_NAME, None)
        if move is not None and _has_fsdp_placeholder_branch(_state.previous.get(_MOVE_NAME, move)):
            names.append(_MOVE_NAME)
        for name in names:
            current = cls.__dict__.get(name, _MISSING)
            if name in _state.installed and current is _state.installed[name]:
                continue  # already ours, on top
            if name in _state.installed:
                # Someone patched over ours; ours stays in their chain and is active again.
                continue
            if current is _MISSING:
                raise AttributeError(
                    f"hsoffload.fsdp.patch: transformers.PreTrainedModel has no {name}; "
                    "FSDP RAM-efficient loading needs transformers >= 4.56"
                )
            make = _make_initialize_missing_keys if name == _INIT_NAME else _make_move_missing_keys
            wrapper = make(current)
            _state.previous[name] = current
            _state.installed[name] = wrapper
            setattr(cls, name, wrapper)
        has_upstream_fix.cache_clear()
    logger.info(
        "hsoffload.fsdp: patched %s (upstream fix #44473 %s)",
        ", ".join(f"PreTrainedModel.{n}" for n in _state.installed),
        "present" if has_upstream_fix() else "absent: flags added by hsoffload",
    )


def unpatch() -> None:
    """Restore the exact class attributes `patch()` replaced, where ours are still on top.

    Where another patch has been installed over ours, ours cannot be taken out of that chain;
    it is turned into a pure pass-through instead (a later `patch()` turns it back on).
    """
    cls = _pretrained_model_class()
    with _lock:
        _state.active = False
        for name in list(_state.installed):
            if cls.__dict__.get(name, _MISSING) is _state.installed[name]:
                setattr(cls, name, _state.previous.pop(name))
                del _state.installed[name]
            else:
                logger.warning(
                    "hsoffload.fsdp.unpatch: PreTrainedModel.%s was patched over ours; ours now only forwards", name
                )
        has_upstream_fix.cache_clear()


def is_patched() -> bool:
    """True while our wrappers are installed and active."""
    cls = _pretrained_model_class()
    return _state.active and any(cls.__dict__.get(n) is w for n, w in _state.installed.items())


def patch_initialize_missing_keys_for_fsdp() -> None:
    """Axolotl's name for `patch()` (re-exported by `hsoffload.axolotl`)."""
    patch()
