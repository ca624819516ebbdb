"""ZeRO-3 RAM-efficient loading (`hsoffload.zero3_loading`), the checkpoint side: `from_pretrained` / `_from_config`
ending in a status check on every rank, the checkpoint's names, shapes and dtypes checked on every rank before rank 0
loads, and a receiving rank's read of the checkpoint as meta tensors. The wrappers' makers; `zero3` installs them.
Thread-safety: the per-thread state below (nesting, the load in progress, the keys to read for real).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
from typing import Any, Callable, Optional

import torch

from .._logging import log_once
from .zero3_collectives import _add, _agree, _agreed, _armed_call, _decide, _dist, _Named, _settings

logger = logging.getLogger("hsoffload")


def _hf_ds_module() -> Any:
    import transformers.integrations.deepspeed as m

    return m


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
