"""Selective activation checkpointing (SAC) inside an offload scope: what the SAC cache keeps, and whether it moves.

torch's `create_selective_checkpoint_contexts` returns two dispatch modes sharing one cache: the forward stores the
outputs the user's SAC policy saves, the recompute reads them back. hsoffload wraps each decoder layer's checkpoint
function (`wrap_checkpoint_fn`; torch.distributed's CheckpointWrapper's too); inside a scope, each checkpoint call
(`_ScopedCheckpoint`):

- wraps the user's SAC policy (`_PolicyFn`): `CheckpointPolicy.MUST_CPU_OFFLOAD` / `PREFER_CPU_OFFLOAD` become a save
  for torch (torch's eager checkpoint would recompute them) and an offload for hsoffload; under policy "sac" every
  save offloads; entries the layer's recompute did not read last time (the early stop ends the recompute before the
  layer's last SAC op) are recomputed instead of copied (`_LayerMemory`);
- routes the cache through the scope's saved-tensor hooks where torch can (`respect_saved_tensors_hooks=True`,
  torch >= 2.14, found by feature detection): the scope's pack hook claims the tensors the policy just saved
  (`pending`) and offloads or passes them through; no FutureWarning;
- on older torch, swaps the cache storage for one whose entries hold engine handles (`_OffloadingStorage`), since
  SAC-kept tensors bypass saved-tensor hooks there.

Outside a scope the wrapper only says once that nothing offloads `*_CPU_OFFLOAD` outputs.

Thread-safety: a checkpoint call's forward (policy calls, packs) runs on the scope's thread; its recompute (restores)
on autograd's threads; a `_LayerMemory` has its own lock, the registry of wrapped layers too.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import threading
import weakref
from typing import Any, Callable, Optional

import torch
from torch.utils.checkpoint import CheckpointPolicy

from .. import engine as _engine
from .._logging import log_once, was_logged
from .current import current_scope
from .policy import offloads_sac_saves
from ..targets import LAYER_ATTR, unwrap_marking

_SAVE = frozenset({CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE})
# *_CPU_OFFLOAD -> the save that torch's eager checkpoint understands (MUST stays MUST for other subsystems).
_CPU_OFFLOAD_AS_SAVE = {
    getattr(CheckpointPolicy, name): save
    for name, save in (
        ("MUST_CPU_OFFLOAD", CheckpointPolicy.MUST_SAVE),
        ("PREFER_CPU_OFFLOAD", CheckpointPolicy.PREFER_SAVE),
    )
    if hasattr(CheckpointPolicy, name)
}


def _checkpoint_accepts(name: str) -> bool:
    try:
        return name in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
    except (TypeError, ValueError):
        return False


# torch >= 2.14: `checkpoint(..., respect_saved_tensors_hooks=True)` routes SAC-kept tensors through the hooks.
HOOKS_ROUTE = _checkpoint_accepts("respect_saved_tensors_hooks")

# torch releases that ask the SAC policy again in the recompute (2.11, is_recompute=True) need the same answer as in
# forward; hsoffload then never turns a save into a recompute (set the first time such a call is seen).
_policy_called_in_recompute = False


def recomputes_unread_entries() -> bool:
    """Whether SAC entries a layer's recompute left unread are recomputed instead of copied from the next step on:
    not on torch releases that ask the policy again in the recompute (2.11), once such a call was seen."""
    return not _policy_called_in_recompute


class _State(threading.local):
    pending: Optional["_Pending"] = None  # the save the SAC policy just decided, until its tensors are stored


state = _State()


# ------------------------------------------------------------------------------------------------ per layer memory


def _unwrapped(checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    return checkpoint


class _LayerMemory:
    """Per decoder layer (lives on its wrapped checkpoint function): the offloaded SAC entries (op, index) that the
    layer's last recompute did not read. They are recomputed instead of copied from then on: with the default early
    stop the recompute ends before it reaches them, and a recompute that does reach one recomputes it (as for every
    op SAC does not keep)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unread: set[tuple[Any, int]] = set()

    def skips(self, key: tuple[Any, int]) -> bool:
        with self._lock:
            return key in self._unread

    def learn(self, unread: set[tuple[Any, int]], read: set[tuple[Any, int]]) -> None:
        with self._lock:
            self._unread |= unread
            self._unread -= read

    @property
    def unread(self) -> frozenset:
        with self._lock:
            return frozenset(self._unread)


class _SacCall:
    """One checkpoint call of a decoder layer inside a scope: what its SAC policy may offload, its own op counters
    (torch indexes cache entries per op the same way), and which offloaded entries its recompute read."""

    def __init__(self, scope: Any, offload_allowed: bool, memory: _LayerMemory) -> None:
        self.scope = scope
        self.offload_allowed = offload_allowed  # the layer budget chose this layer and the cache may be offloaded
        self.offload_saves = offloads_sac_saves(scope.config.policy)  # every save, not only *_CPU_OFFLOAD ones
        self.memory = memory
        self.counters: dict[Any, int] = collections.defaultdict(int)
        self.offloaded: set[tuple[Any, int]] = set()
        self.read: set[tuple[Any, int]] = set()

    def __del__(self) -> None:
        # The call's cache is gone (its graph was freed). Learn only from a call whose recompute ran at all.
        try:
            if self.read:
                self.memory.learn(self.offloaded - self.read, self.read)
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass


class _Pending:
    """A save the SAC policy just decided: its cache key, whether it offloads, and (hooks route) the op's output
    tensors, which torch hands to the scope's pack hook next, in this order."""

    __slots__ = ("call", "key", "offload", "outputs", "next")

    def __init__(self, call: _SacCall, key: tuple[Any, int], offload: bool, outputs: Optional[list]) -> None:
        self.call, self.key, self.offload, self.outputs, self.next = call, key, offload, outputs, 0

    def claims(self, x: torch.Tensor) -> bool:
        """True if `x` (a detached alias torch packs) is this save's next output tensor; consumes it."""
        if self.outputs is None or self.next >= len(self.outputs):
            return False
        out = self.outputs[self.next]
        same_data = type(out) is not torch.Tensor or not out.numel() or x.data_ptr() == out.data_ptr()
        if x.shape != out.shape or x.dtype != out.dtype or not same_data:
            state.pending = None  # not what torch stores next: stop claiming
            return False
        self.next += 1
        if self.next == len(self.outputs):
            state.pending = None
        return True


def take_pending() -> Optional[_Pending]:
    """The save the policy just decided (legacy route: its cache entry is being stored now), and forget it."""
    pending = state.pending
    state.pending = None
    return pending


class SacHandle:
    """What the scope's pack hook returns for an offloaded SAC-kept tensor (hooks route): the engine's handle, and
    the entry it belongs to (its restore counts as read)."""

    __slots__ = ("handle", "call", "key")

    def __init__(self, handle: torch.Tensor, call: _SacCall, key: tuple[Any, int]) -> None:
        self.handle, self.call, self.key = handle, call, key

    def unpack(self) -> torch.Tensor:
        self.call.read.add(self.key)
        return _engine.offload_unpack(self.handle)


# ------------------------------------------------------------------------------------------------ the policy wrapper


def _tensor_leaves(tree: Any) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class _PolicyFn:
    """The user's SAC policy, as torch sees it inside a scope: *_CPU_OFFLOAD are saves, and each save is announced
    (`state.pending`) with whether hsoffload offloads it."""

    def __init__(self, inner: Callable[..., Any], call: _SacCall, hooks_route: bool) -> None:
        functools.update_wrapper(self, inner)
        self.inner, self.call, self.hooks_route = inner, call, hooks_route

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        global _policy_called_in_recompute
        policy = self.inner(ctx, func, *args, **kwargs)
        if isinstance(policy, bool):
            policy = CheckpointPolicy.MUST_SAVE if policy else CheckpointPolicy.PREFER_RECOMPUTE
        asked = policy in _CPU_OFFLOAD_AS_SAVE
        answer = _CPU_OFFLOAD_AS_SAVE[policy] if asked else policy
        if getattr(ctx, "is_recompute", False):
            _policy_called_in_recompute = True
            return answer
        call = self.call
        index = call.counters[func]
        call.counters[func] = index + 1
        if answer not in _SAVE:
            state.pending = None
            return answer
        key = (func, index)
        offload = call.offload_allowed and (asked or call.offload_saves)
        if offload and not _policy_called_in_recompute and call.memory.skips(key):
            state.pending = None
            return CheckpointPolicy.PREFER_RECOMPUTE
        outputs = _tensor_leaves(getattr(ctx, "op_output", None)) if self.hooks_route else None
        state.pending = _Pending(call, key, offload, outputs)
        return answer


class _UnscopedPolicyFn:
    """The user's SAC policy outside every scope: unchanged; says once that *_CPU_OFFLOAD moves nothing."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        functools.update_wrapper(self, inner)
        self.inner = inner

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        policy = self.inner(ctx, func, *args, **kwargs)
        if not isinstance(policy, bool) and policy in _CPU_OFFLOAD_AS_SAVE:
            _say_unscoped_cpu_offload(policy)
        return policy


_UNSCOPED_KEY = "cpu-offload-unscoped"  # once logged, unscoped calls stop wrapping the policy


def _say_unscoped_cpu_offload(policy: Any) -> None:
    log_once(
        _UNSCOPED_KEY,
        logging.WARNING,
        "hsoffload: a selective-checkpoint policy returned %s outside an hsoffload offload scope: nothing offloads it "
        "(torch's eager checkpoint recomputes that op in backward). Run the training step inside "
        "`with hsoffload.offload_hidden_states(model):` to have hsoffload offload it.",
        policy,
    )


# ------------------------------------------------------------------------------------------- the checkpoint wrapper


def _returning(contexts: Any) -> Any:
    return contexts


class _ScopedCheckpoint:
    """A decoder layer's checkpoint function (torch's `checkpoint`), called through hsoffload: inside a scope, with
    the SAC policy wrapped and the SAC cache routed to the engine."""

    def __init__(self, checkpoint: Callable[..., Any], memory: _LayerMemory, name: str) -> None:
        functools.update_wrapper(self, checkpoint)
        self.checkpoint, self.memory, self.name = checkpoint, memory, name

    def __reduce__(self) -> Any:
        # A copy of the layer (copy.deepcopy(model): reference models, EMA; pickling) gets torch's checkpoint back,
        # without this layer's memory; the patch wraps the copy again at its first call.
        return (_unwrapped, (self.checkpoint,))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context_fn = kwargs.get("context_fn")
        if context_fn is None or kwargs.get("use_reentrant") is True or torch.compiler.is_compiling():
            return self.checkpoint(*args, **kwargs)
        scope = current_scope()
        if scope is None:
            if not was_logged(_UNSCOPED_KEY):
                kwargs["context_fn"] = functools.partial(_unscoped_contexts, context_fn)
            return self.checkpoint(*args, **kwargs)
        visit = scope.layer_tracker.current
        call = _SacCall(scope, visit is not None and visit.offload, self.memory)
        contexts = context_fn()
        respect = kwargs.get("respect_saved_tensors_hooks")
        hooks_route = _prepare(contexts, call, respect, visit.name if visit is not None else self.name)
        kwargs["context_fn"] = functools.partial(_returning, contexts)  # torch calls it once per checkpoint call
        if HOOKS_ROUTE and respect is None:
            kwargs["respect_saved_tensors_hooks"] = hooks_route
        try:
            return self.checkpoint(*args, **kwargs)
        finally:
            state.pending = None


def _sac_modes(contexts: Any) -> tuple[Any, Any]:
    """(forward mode, recompute mode) when `contexts` (what a checkpoint's context_fn returned) is the pair torch's
    `create_selective_checkpoint_contexts` makes, else (None, None). Recognised by torch's own types, never by their
    attributes: a user's context_fn may return objects that answer every attribute (mocks, proxies; issue 52)."""
    if not (isinstance(contexts, tuple) and len(contexts) == 2):
        return None, None
    fwd, rec = contexts
    caching = getattr(torch.utils.checkpoint, "_CachingTorchDispatchMode", None)
    cached = getattr(torch.utils.checkpoint, "_CachedTorchDispatchMode", None)
    if caching is None or cached is None or not (isinstance(fwd, caching) and isinstance(rec, cached)):
        return None, None
    return fwd, rec


def _unscoped_contexts(context_fn: Callable[[], Any]) -> Any:
    contexts = context_fn()
    fwd, rec = _sac_modes(contexts)
    policy_fn = getattr(fwd, "policy_fn", None) if fwd is not None else None
    if callable(policy_fn):
        fwd.policy_fn = _UnscopedPolicyFn(policy_fn)
        if hasattr(rec, "policy_fn"):  # torch's own recompute mode (checked above): torch 2.11 asks it again
            rec.policy_fn = fwd.policy_fn
    return contexts


def _prepare(contexts: Any, call: _SacCall, respect: Optional[bool], name: str) -> bool:
    """Wrap the SAC policy of `contexts` for `call` and choose the route: True for torch's hooks route (SAC-kept
    tensors reach the scope's pack hook), False when they bypass the hooks (then the cache storage is swapped for an
    offloading one where offloads are possible)."""
    sac_policy = offloads_sac_saves(call.scope.config.policy)
    fwd, rec = _sac_modes(contexts)
    policy_fn = getattr(fwd, "policy_fn", None) if fwd is not None else None
    if not callable(policy_fn):
        if sac_policy and call.offload_allowed:
            _say_unknown_context(name)
        return bool(respect) if respect is not None else HOOKS_ROUTE
    if getattr(rec, "allow_cache_entry_mutation", False):
        # Cached tensors may change in place later: a host copy would be stale, and the engine's version check would
        # refuse the change the user allowed. Nothing offloads; they bypass the hooks as they always did.
        if call.offload_allowed:
            log_once(
                "sac-mutation",
                logging.WARNING,
                "hsoffload: allow_cache_entry_mutation=True lets the SAC cache hold tensors that are modified in place "
                "later; hsoffload offloads none of them (a host copy would be stale), policy='sac' and "
                "CheckpointPolicy.*_CPU_OFFLOAD alike: they stay on the device. Use allow_cache_entry_mutation=False "
                "to offload what SAC keeps.",
            )
        call.offload_allowed = False
        hooks_route = False if respect is None else respect
    else:
        hooks_route = HOOKS_ROUTE and respect is not False
    wrapped = _PolicyFn(policy_fn, call, hooks_route)
    fwd.policy_fn = wrapped
    if hasattr(rec, "policy_fn"):  # torch releases that ask the policy again in the recompute (2.11)
        rec.policy_fn = wrapped
    if not hooks_route and call.offload_allowed and not _swap_storage(fwd, rec, call):
        call.offload_allowed = False
        if sac_policy:
            _say_unknown_context(name)
    return hooks_route


def _say_unknown_context(name: str) -> None:
    log_once(
        "sac-unknown-context",
        logging.WARNING,
        "hsoffload: policy='sac': the checkpoint context_fn of %s does not return torch's selective-checkpoint "
        "modes (create_selective_checkpoint_contexts); only its hidden_states are offloaded",
        name,
    )


# ---------------------------------------------------------------------------------- legacy route (torch < 2.14)


class _OffloadedEntry:
    """A SAC cache entry whose tensors are engine handles until the recompute asks for them."""

    __slots__ = ("tree", "handles", "call", "key")

    def __init__(self, tree: Any, handles: list[tuple[Any, torch.Tensor]], pending: _Pending) -> None:
        self.tree, self.handles, self.call, self.key = tree, handles, pending.call, pending.key

    def restore(self) -> Any:
        unpack = _engine.offload_unpack
        for wrapper, handle in self.handles:
            wrapper.val = unpack(handle)  # the engine's version check raises if the source was mutated in place
            wrapper.version = wrapper.val._version
        self.handles = []
        self.call.read.add(self.key)
        return self.tree


class _OffloadingEntries(dict):
    """The per-op entries of a SAC storage (torch keeps a dict by call index, older releases a list): entries are
    packed when stored and restored when the recompute reads them."""

    def __init__(self, pack: Callable[[Any], Any]) -> None:
        super().__init__()
        self._pack = pack
        self._first = 0  # the list form: keys _first .. _end-1 are the list's items, oldest first
        self._end = 0

    def __setitem__(self, idx: Any, value: Any) -> None:
        super().__setitem__(idx, self._pack(value))

    def __getitem__(self, idx: Any) -> Any:
        value = super().__getitem__(idx)
        if isinstance(value, _OffloadedEntry):
            value = value.restore()
            super().__setitem__(idx, value)
        return value

    def get(self, idx: Any, default: Any = None) -> Any:
        return self[idx] if idx in self else default

    def append(self, value: Any) -> None:  # the list form of the storage (torch releases before the dict form)
        self[self._end] = value
        self._end += 1

    def pop(self, idx: int = -1) -> Any:  # the list form: pop(0) takes the oldest
        if self._end == self._first:
            raise IndexError("pop from an empty SAC cache list")
        key = self._first if idx == 0 else self._end - 1
        value = self[key]
        super().__delitem__(key)
        if idx == 0:
            self._first += 1
        else:
            self._end -= 1
        return value


class _OffloadingStorage(collections.defaultdict):
    def __init__(self, pack: Callable[[Any], Any]) -> None:
        super().__init__(lambda: _OffloadingEntries(pack))


def _swap_storage(fwd: Any, rec: Any, call: _SacCall) -> bool:
    """Give torch's two SAC modes one offloading storage. False if they are not the pair sharing an empty dict."""
    storage = getattr(fwd, "storage", None)
    if not isinstance(storage, dict) or getattr(rec, "storage", None) is not storage or storage:
        return False
    fwd.storage = rec.storage = _OffloadingStorage(call.scope.pack_sac_entry)
    return True


def pack_sac_value(value: Any, pack_tensor: Callable[[torch.Tensor], Optional[torch.Tensor]], pending: _Pending) -> Any:
    """A SAC cache value (a pytree of torch's _VersionWrapper, or a sentinel) with its tensors packed."""
    leaves, _ = torch.utils._pytree.tree_flatten(value)
    handles = []
    for leaf in leaves:
        if _is_version_wrapper(leaf) and type(leaf.val) is torch.Tensor:
            handle = pack_tensor(leaf.val)
            if handle is not None:
                handles.append((leaf, handle))
    if not handles:
        return value
    for leaf, _ in handles:
        leaf.val = None  # the handle holds the host copy; the device tensor is freed with forward's last use
    pending.call.offloaded.add(pending.key)
    return _OffloadedEntry(value, handles, pending)


def _is_version_wrapper(v: Any) -> bool:
    """Whether `v` is torch's SAC cache wrapper (by its type: a cached value may answer any attribute)."""
    wrapper = getattr(torch.utils.checkpoint, "_VersionWrapper", None)
    return wrapper is not None and isinstance(v, wrapper)


# ------------------------------------------------------------------------------------------------ layers


# Modules whose checkpoint function wrap_checkpoint_fn replaced: module -> (attribute, original, replacement);
# guarded by _wrapped_lock, process-wide because the modules are; undone by undo().
_wrapped_lock = threading.Lock()
_wrapped_layers: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, Any, Any]]" = weakref.WeakKeyDictionary()

# Where a module keeps the checkpoint function it calls: a transformers GradientCheckpointingLayer its
# `_gradient_checkpointing_func` (LAYER_ATTR, from targets), torch.distributed's CheckpointWrapper its `checkpoint_fn`.
WRAPPER_ATTR = "checkpoint_fn"


def wrap_checkpoint_fn(module: torch.nn.Module, attr: str = LAYER_ATTR, name: Optional[str] = None) -> bool:
    """Make `module.<attr>` (a `functools.partial` of torch's checkpoint) call through `_ScopedCheckpoint` (once; its
    keywords, `context_fn` included, stay as they are). Returns False when that checkpoint has no context_fn (full
    checkpointing: SAC keeps nothing), or, for a CheckpointWrapper, when its function is not torch's checkpoint (a
    user's `checkpoint_fn` may not take the arguments hsoffload adds)."""
    func = unwrap_marking(getattr(module, attr, None))  # through a call's marking wrapper (patch.py)
    if not isinstance(func, functools.partial) or func.keywords.get("context_fn") is None:
        return False
    if isinstance(func.func, _ScopedCheckpoint):
        return True
    if attr == WRAPPER_ATTR and func.func is not torch.utils.checkpoint.checkpoint:
        return False
    scoped = _ScopedCheckpoint(func.func, _LayerMemory(), name or type(module).__name__)
    wrapped = functools.partial(scoped, *func.args, **func.keywords)
    with _wrapped_lock:
        _wrapped_layers[module] = (attr, func, wrapped)
    setattr(module, attr, wrapped)
    return True


def layer_memory(module: torch.nn.Module, attr: str = LAYER_ATTR) -> Optional[_LayerMemory]:
    """The SAC entries `module`'s recompute left unread (tests, diagnostics); None if its checkpoint is not wrapped."""
    func = unwrap_marking(getattr(module, attr, None))  # through a call's marking wrapper (patch.py)
    scoped = getattr(func, "func", None)
    return scoped.memory if isinstance(scoped, _ScopedCheckpoint) else None


def undo() -> int:
    """Put back every checkpoint function `wrap_checkpoint_fn` replaced (`hsoffload.unpatch()`). Returns how many."""
    undone = 0
    with _wrapped_lock:
        for module, (attr, original, wrapped) in list(_wrapped_layers.items()):
            if getattr(module, attr, None) is wrapped:
                setattr(module, attr, original)
                undone += 1
        _wrapped_layers.clear()
    return undone
