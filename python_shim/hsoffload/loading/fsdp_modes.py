"""The two torch modes of FSDP RAM-efficient loading (hsoffload.fsdp wires them around transformers' init):

- `DropFlaggedWrites` (a `TorchDispatchMode`): drops every op that writes only into storages the `InitSkipRecord`
  flagged (weights that arrive by broadcast), counting them;
- `LazyPlaceholders` (a `TorchFunctionMode`): turns the `zeros_like`/`empty_like` CPU placeholders transformers 5.x
  makes on non-rank-0 into lazily committed zeros (no resident memory until the broadcast writes them).

Thread-safety: a mode is entered and used on one thread, around one call.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .. import engine as _engine
from .._logging import log_once


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


class DropFlaggedWrites(TorchDispatchMode):
    """Drops every op that writes only into flagged storages; counts them in the record.

    An op that writes a mix of flagged and unflagged tensors (a `_foreach_*_` over a list) runs
    on the unflagged ones only. An op whose result is not an alias of what it writes (nothing
    in init code) cannot be dropped: it runs, and is logged.
    """

    def __init__(self, record: _engine.InitSkipRecord) -> None:
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
        log_once(
            f"mixed:{func}",
            logging.WARNING,
            "hsoffload.fsdp: %s writes into parameters that arrive by broadcast but cannot be "
            "dropped (mixed or non-aliasing outputs); it runs as stock",
            func,
        )
        return func(*args, **kwargs)


class LazyPlaceholders(TorchFunctionMode):
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
        self.storages: set[int] = set()  # data_ptr of each placeholder made (which tensors hold one)

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
                out = _engine.lazy_zeros_like(like)
                self.count += 1
                self.nbytes += out.numel() * out.element_size()
                self.storages.add(out.untyped_storage().data_ptr())
                return out
        return func(*args, **kwargs)
