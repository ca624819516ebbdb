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
(stock behaviour) and log once, at info level, why they are inactive. transformers >= 5.23 makes
no placeholder for non-rank-0 weights (its `_move_missing_keys_from_meta_to_device` only fills
non-persistent buffers there; the weights stay mmap-backed or on meta) and flags them initialised
itself: measured, stock non-rank-0 holds 0.8 % of the model's bytes during the load. There the
init wrapper steps aside (stock, logged once at info): it finds no tensor it would skip holding a
placeholder of this load.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import threading
from typing import Any, Callable, Optional

import torch
from .._logging import log_once as _log_once
from ..classpatch import ClassPatch
from .fsdp_modes import DropFlaggedWrites, LazyPlaceholders
from .. import engine as _engine
from ..stats import InitSkipStats, from_engine
from ..targets import pretrained_model_class

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
_TRUE = {"1", "y", "yes", "t", "true", "on"}
_FALSE = {"0", "n", "no", "f", "false", "off", ""}




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


@functools.lru_cache(maxsize=None)
def has_upstream_fix() -> bool:
    """Whether the installed transformers flags non-rank-0 tensors itself (fix #44473, 5.4+).

    Read from the stock method's source (it then tests `is_fsdp_enabled()` itself); the version
    number decides only when the source is unavailable. 4.x needs no such fix (it never
    re-initialised non-rank-0 weights this way) and reports False.
    """
    method = INITIALIZE_MISSING_KEYS.original() or getattr(pretrained_model_class(), _INIT_NAME, None)
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


# --------------------------------------------------------------------------- the wrappers


def _decide(model: torch.nn.Module, tensors: list[torch.Tensor]) -> tuple[_engine.InitSkipRecord, list[bool]]:
    facts = rank_facts()
    record = _engine.InitSkipRecord()
    flags = _engine.skip_init_non_rank0(
        tensors, facts.rank, facts.local_rank, facts.fsdp_enabled, facts.cpu_ram_efficient_loading, record
    )
    return record, flags


def _holds_placeholders(tensors: list[torch.Tensor], flags: list[bool]) -> bool:
    """Whether a tensor this rank skips holds a placeholder that `_move_missing_keys_from_meta_to_device` made in this
    load (transformers 5.x before 5.23 materialise every non-rank-0 weight there; 5.23 none)."""
    made = getattr(_placeholders, "storages", frozenset())
    _placeholders.storages = frozenset()  # this load's, read once
    # By address: the placeholders are alive (the model holds them) while this runs, so no address is reused; an
    # empty storage has none (0) and is never a placeholder.
    return any(f and not t.is_meta and t.untyped_storage().nbytes() > 0 and t.untyped_storage().data_ptr() in made
               for t, f in zip(tensors, flags))


def _is_quantized_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """`is_quantized` (5.x: first positional; 4.56-4.57: second) / `hf_quantizer` when given."""
    if "is_quantized" in kwargs:
        return bool(kwargs["is_quantized"])
    if "hf_quantizer" in kwargs:
        return kwargs["hf_quantizer"] is not None
    bools = [a for a in args if isinstance(a, bool)]
    return bool(bools[-1]) if bools else False


def _make_initialize_missing_keys(original: Callable[..., Any], patch: ClassPatch) -> Callable[..., Any]:
    @functools.wraps(original)
    def _initialize_missing_keys(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        global _last_report
        if not patch.active:
            return original(self, *args, **kwargs)
        fixed = has_upstream_fix()
        tensors, _ = _tensors_to_flag(self)
        record, flags = _decide(self, tensors)
        if not record.skip() or _is_quantized_call(args, kwargs):
            reason = "quantized model (left to transformers)" if record.skip() else record.reason()
            _log_once(f"inactive:{reason}", logging.INFO, "hsoffload.fsdp: weight init runs as stock: %s", reason)
            _last_report = InitSkipReport(skipped=False, reason=reason, upstream_fix=fixed)
            return original(self, *args, **kwargs)

        if fixed and not _holds_placeholders(tensors, flags):
            # transformers >= 5.23: no placeholder was made for this rank's weights (they stay on the meta device, or
            # are the checkpoint's mmap-backed tensors, until the broadcast) and its own flags skip their init, so
            # nothing is resident that hsoffload would avoid. Measured side by side in docs/benchmarks.md.
            reason = (
                "transformers materialises none of this rank's weights and skips their init itself (>= 5.23): "
                "nothing left to skip"
            )
            _log_once("meta", logging.INFO, "hsoffload.fsdp: stepping aside: %s", reason)
            _last_report = InitSkipReport(skipped=False, reason=reason, upstream_fix=fixed)
            return original(self, *args, **kwargs)
        if not fixed:
            # What #44473 added upstream: guarded init skips tensors carrying this flag.
            for t, f in zip(tensors, flags):
                if f:
                    t._is_hf_initialized = True
        skipped_modules = _mark_fully_flagged_modules(self, lambda t: bool(record.is_flagged(t)))
        storages = [(t, t.untyped_storage().data_ptr()) for t, f in zip(tensors, flags) if f]
        with DropFlaggedWrites(record):
            result = original(self, *args, **kwargs)
        replaced = sum(1 for t, ptr in storages if t.untyped_storage().data_ptr() != ptr)
        if replaced:
            logger.warning(
                "hsoffload.fsdp: %d flagged tensors got new storage during init (`.data = ...`); "
                "they hold whatever init wrote until the broadcast",
                replaced,
            )
        s = from_engine(InitSkipStats, record.stats())
        count, nbytes = getattr(_placeholders, "last", (0, 0))
        _last_report = InitSkipReport(
            skipped=True,
            reason=record.reason(),
            upstream_fix=fixed,
            flagged_tensors=int(sum(flags)),
            flagged_bytes=s.flagged_bytes,
            dropped_writes=s.dropped_writes,
            dropped_bytes=s.dropped_bytes,
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

    return _initialize_missing_keys


def _make_move_missing_keys(original: Callable[..., Any], patch: ClassPatch) -> Callable[..., Any]:
    @functools.wraps(original)
    def _move_missing_keys_from_meta_to_device(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        _placeholders.last = (0, 0)
        _placeholders.storages = frozenset()
        if not patch.active or _is_quantized_call(args, kwargs) or _quantizer_arg(args, kwargs):
            return original(self, *args, **kwargs)
        facts = rank_facts()
        record = _engine.InitSkipRecord()
        _engine.skip_init_non_rank0(
            [], facts.rank, facts.local_rank, facts.fsdp_enabled, facts.cpu_ram_efficient_loading, record
        )
        if not record.skip():
            return original(self, *args, **kwargs)
        mode = LazyPlaceholders()
        with mode:
            result = original(self, *args, **kwargs)
        _placeholders.last = (mode.count, mode.nbytes)
        _placeholders.storages = frozenset(mode.storages)
        return result

    return _move_missing_keys_from_meta_to_device


def _quantizer_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """5.x `_move_missing_keys_from_meta_to_device(missing_keys, device_map, device_mesh, hf_quantizer)`."""
    q = kwargs.get("hf_quantizer", args[3] if len(args) > 3 else None)
    return q is not None


# --------------------------------------------------------------------------- patch / unpatch


def _has_fsdp_placeholder_branch(method: Any) -> bool:
    """Whether `_move_missing_keys_from_meta_to_device` materialises non-rank-0 tensors itself."""
    try:
        src = inspect.getsource(method)
    except (OSError, TypeError):
        return False
    return "is_fsdp_enabled()" in src and ("zeros_like" in src or "empty_like" in src)


_lock = threading.Lock()  # serialises patch()/unpatch() (the two ClassPatches move together)
INITIALIZE_MISSING_KEYS = ClassPatch(
    pretrained_model_class,
    _INIT_NAME,
    lambda previous, patch: _make_initialize_missing_keys(previous, patch),
    missing_hint="; FSDP RAM-efficient loading needs transformers >= 4.56",
)
MOVE_MISSING_KEYS = ClassPatch(
    pretrained_model_class, _MOVE_NAME, lambda previous, patch: _make_move_missing_keys(previous, patch)
)


def patch() -> None:
    """Install the wrappers on `transformers.PreTrainedModel`. Idempotent; thread-safe."""
    cls = pretrained_model_class()
    with _lock:
        INITIALIZE_MISSING_KEYS.install()
        move = MOVE_MISSING_KEYS.original() or getattr(cls, _MOVE_NAME, None)
        if move is not None and _has_fsdp_placeholder_branch(move):
            MOVE_MISSING_KEYS.install()
        has_upstream_fix.cache_clear()
    logger.info(
        "hsoffload.fsdp: patched %s (upstream fix #44473 %s)",
        ", ".join(f"PreTrainedModel.{p.name}" for p in (INITIALIZE_MISSING_KEYS, MOVE_MISSING_KEYS) if p.installed),
        "present" if has_upstream_fix() else "absent: flags added by hsoffload",
    )


def unpatch() -> None:
    """Restore the exact class attributes `patch()` replaced, where ours are still on top.

    Where another patch has been installed over ours, ours cannot be taken out of that chain;
    it is turned into a pure pass-through instead (a later `patch()` turns it back on).
    """
    pretrained_model_class()
    with _lock:
        MOVE_MISSING_KEYS.remove()
        INITIALIZE_MISSING_KEYS.remove()
        has_upstream_fix.cache_clear()


def is_patched() -> bool:
    """True while our wrappers are installed and active."""
    return INITIALIZE_MISSING_KEYS.is_installed() or MOVE_MISSING_KEYS.is_installed()


def patch_initialize_missing_keys_for_fsdp() -> None:
    """Axolotl's name for `patch()` (re-exported by `hsoffload.axolotl`)."""
    patch()
