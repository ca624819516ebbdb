"""Offload scope: a context manager over saved_tensors_hooks that dispatches into the hsoffload ops."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import weakref
from types import TracebackType
from typing import Any, Optional, Union

import torch

from ._logging import log_once
from .policy import LayerStats, LayerTracker, Policy, Selector, pack_sac_value, policy_name
from .policy import reset_head_state_on_forward, track_module_names, validate_policy

logger = logging.getLogger("hsoffload")

_STAT_FIELDS = (
    "saved_tensors_seen",
    "marked_tensors",
    "offloaded_tensors",
    "restored_tensors",
    "skipped_marked_tensors",
    "offloaded_bytes",
    "restored_bytes",
    "prefetch_hits",
    "wait_ns",
    "pool_bytes",
    "spilled_tensors",
    "spilled_bytes",
    "spill_read_wait_ns",
    "kept_on_device_tensors",
)
# Python-side mirror of the engine's per-thread scope stack, so the transformers
# patch can ask "is a scope active on this thread?" without a dispatcher call.
_tls = threading.local()
# Scopes entered and not yet exited, process-wide: lets code that torch.compile traces skip hsoffload's graph breaks
# while no scope is active anywhere (dynamo guards on the value of `any_active`). Guarded by _active_lock.
_active_lock = threading.Lock()
_active_count = 0
any_active = False


def _count_active(delta: int) -> None:
    global _active_count, any_active
    with _active_lock:
        _active_count += delta
        any_active = _active_count > 0


def current_scope() -> Optional["OffloadScope"]:
    """The innermost offload scope entered on this thread, or None."""
    stack = getattr(_tls, "stack", None)
    return stack[-1] if stack else None


def entered_on_this_thread(scope: "OffloadScope") -> bool:
    """True if `scope` is active on the calling thread (anywhere in its stack, not only innermost)."""
    return scope in getattr(_tls, "stack", ())


_POOL_FIELDS = (
    "held_bytes",
    "in_use_bytes",
    "cached_bytes",
    "peak_held_bytes",
    "allocations",
    "reuses",
    "unpooled",
    "acquires",
    "slabs",
)


@dataclasses.dataclass(frozen=True)
class OffloadStats:
    """Counters of one scope (or of the process, see `cumulative_stats`)."""

    saved_tensors_seen: int = 0
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0
    prefetch_hits: int = 0
    wait_ns: int = 0
    pool_bytes: int = 0
    spilled_tensors: int = 0
    spilled_bytes: int = 0
    spill_read_wait_ns: int = 0
    kept_on_device_tensors: int = 0

    @classmethod
    def from_list(cls, values: list[int]) -> "OffloadStats":
        if len(values) != len(_STAT_FIELDS):
            raise RuntimeError(
                f"hsoffload: the op library reports {len(values)} counters, this Python package expects "
                f"{len(_STAT_FIELDS)}; the library and the package come from different versions: rebuild"
            )
        return cls(**dict(zip(_STAT_FIELDS, values)))


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """What the process-wide host pool holds."""

    held_bytes: int = 0
    in_use_bytes: int = 0
    cached_bytes: int = 0
    peak_held_bytes: int = 0
    allocations: int = 0  # slabs (and unpooled buffers) obtained from the allocator
    reuses: int = 0  # loans served by existing slabs
    unpooled: int = 0
    acquires: int = 0  # loans made
    slabs: int = 0  # slabs held now


@dataclasses.dataclass(frozen=True)
class BudgetStats:
    """The process-wide host budget (`max_host_bytes`): offloaded bytes resident in host memory."""

    limit: int = 0
    in_flight: int = 0
    peak: int = 0  # since the limit was last set
    refused: int = 0  # packs that did not fit (spilled or kept on the device)
    is_auto: bool = True
    mem_available: int = 0  # what "auto" was computed from
    local_world_size: int = 1


_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_bytes(value: Union[int, str], what: str) -> Union[int, str]:
    """`value` as an int of bytes, or "auto". Accepts ints and strings like "64GiB", "500MB", "1e9" is refused."""
    if isinstance(value, bool):
        raise ValueError(f"hsoffload: {what} must be bytes (an int or a string like '64GiB') or 'auto', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"hsoffload: {what} must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        m = _BYTES.match(value)
        if m:
            unit = m.group(2).lower()
            base = 1024 if (m.group(3) or "").lower() == "ib" or not m.group(3) else 1000
            return int(float(m.group(1)) * base ** " kmgt".index(unit or " "))
    raise ValueError(f"hsoffload: {what} must be bytes (an int or a string like '64GiB') or 'auto', got {value!r}")


def _env_max_host_bytes() -> Union[int, str, None]:
    value = os.environ.get("HSOFFLOAD_MAX_HOST_BYTES")
    return None if value is None else parse_bytes(value, "HSOFFLOAD_MAX_HOST_BYTES")


def _env_spill_dir() -> Optional[str]:
    return os.environ.get("HSOFFLOAD_SPILL_DIR") or None


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Every knob of an offload scope, validated once."""

    min_offload_size: int = 1024
    offload_cpu_tensors: bool = False
    pin_memory: bool = True
    use_streams: bool = True
    prefetch_depth: int = 1
    max_pool_bytes: Optional[int] = None  # process-wide host pool bound, applied when the scope is entered
    # Process-wide bound of offloaded bytes in host memory, applied when the scope is entered: bytes, or "auto"
    # (80 % of MemAvailable at first use / LOCAL_WORLD_SIZE). Default: $HSOFFLOAD_MAX_HOST_BYTES, else None: keep
    # the process's budget as it is (auto, resolved at first use, unless set_host_budget or a scope set it).
    max_host_bytes: Union[int, str, None] = dataclasses.field(default_factory=_env_max_host_bytes)
    # Directory for packs over the host budget (None: they stay on the device). Default: $HSOFFLOAD_SPILL_DIR.
    spill_dir: Optional[str] = dataclasses.field(default_factory=_env_spill_dir)
    spill_prefetch_depth: int = 2  # spilled tensors read back ahead of their use in backward
    # What is offloaded: "hidden_states", "sac", "all", or a callable (tensor, module_qualified_name) -> bool
    # (see hsoffload.policy and docs/usage.md, "Offload policies").
    policy: Policy = "hidden_states"
    keep_last_layers: int = 0  # the last k decoder layers keep their tensors on the device
    offload_fraction: float = 1.0  # share of the other decoder layers (the first ones) that offload
    offload_output_head: bool = False  # policy "all": also the saves outside decoder layers after one ran (the head)

    def __post_init__(self) -> None:
        validate_policy(self.policy)
        if not isinstance(self.offload_fraction, (int, float)) or isinstance(self.offload_fraction, bool) or not (
            0.0 <= float(self.offload_fraction) <= 1.0
        ):
            raise ValueError(f"hsoffload: offload_fraction must be a number in [0, 1], got {self.offload_fraction!r}")
        if not isinstance(self.offload_output_head, bool):
            raise TypeError(f"hsoffload: offload_output_head must be a bool, got {self.offload_output_head!r}")
        if self.max_host_bytes is not None:
            object.__setattr__(self, "max_host_bytes", parse_bytes(self.max_host_bytes, "max_host_bytes"))
        if self.spill_dir is not None:
            if not isinstance(self.spill_dir, (str, os.PathLike)) or not str(self.spill_dir):
                raise ValueError(f"hsoffload: spill_dir must be a directory path or None, got {self.spill_dir!r}")
            object.__setattr__(self, "spill_dir", os.fspath(self.spill_dir))
        for name in ("min_offload_size", "prefetch_depth", "spill_prefetch_depth", "keep_last_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"hsoffload: {name} must be a non-negative int, got {value!r}")
        for name in ("offload_cpu_tensors", "pin_memory", "use_streams"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"hsoffload: {name} must be a bool, got {getattr(self, name)!r}")
        if self.max_pool_bytes is not None and (
            not isinstance(self.max_pool_bytes, int) or isinstance(self.max_pool_bytes, bool) or self.max_pool_bytes < 0
        ):
            raise ValueError(f"hsoffload: max_pool_bytes must be None or a non-negative int, got {self.max_pool_bytes!r}")


_warned_unmarked = threading.Event()  # "log once" flag, process-wide by intent


class _DTensorHandle:
    """What the pack hook keeps for a marked DTensor: the engine's handle of its local shard, and its metadata."""

    __slots__ = ("local", "spec", "requires_grad")

    def __init__(self, local: torch.Tensor, spec: Any, requires_grad: bool) -> None:
        self.local, self.spec, self.requires_grad = local, spec, requires_grad

    def unpack(self) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return DTensor(torch.ops.hsoffload.offload_unpack(self.local), self.spec, requires_grad=self.requires_grad)


def _dtensor_class() -> Optional[type]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def _pack_subclass(engine: Any, x: torch.Tensor, scope_id: int) -> Any:
    """Tensor subclasses: a marked DTensor offloads its local shard and comes back as a DTensor with the same mesh,
    placements and metadata; every other subclass goes to the engine, which passes it through untouched (counted
    in skipped_marked_tensors when marked, logged once at scope exit)."""
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(x, dtensor) and engine.is_marked(x):
        local = x._local_tensor
        engine.mark(local)
        return _DTensorHandle(torch.ops.hsoffload.offload_pack(local, scope_id), x._spec, x.requires_grad)
    return torch.ops.hsoffload.offload_pack(x, scope_id)


class OffloadScope(torch.autograd.graph.saved_tensors_hooks):
    """Offloads marked saved tensors to host memory while active.

    Use as a context manager around forward (and, usually, backward). Tensors marked with
    `torch.ops.hsoffload.mark_hidden_state` (or `scope.mark`) on this thread while the scope is
    active are copied to host when autograd saves them and restored in backward; every other
    saved tensor passes through untouched. Scopes are per thread and nest. A scope may be entered
    again (one step after another); `stats` then accumulates over its uses.
    """

    def __init__(self, config: Optional[OffloadConfig] = None, **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise TypeError("hsoffload: pass either config= or keyword options, not both")
        self.config = config if config is not None else OffloadConfig(**kwargs)
        c = self.config
        self._scope = torch.classes.hsoffload.OffloadScope(
            c.min_offload_size,
            c.offload_cpu_tensors,
            c.pin_memory,
            c.use_streams,
            c.prefetch_depth,
            c.spill_dir or "",
            c.spill_prefetch_depth,
        )
        scope_id = int(self._scope.id())
        pack_op = torch.ops.hsoffload.offload_pack.default
        unpack_op = torch.ops.hsoffload.offload_unpack.default
        engine = self._scope
        plain = (torch.Tensor, torch.nn.Parameter)
        self.layer_tracker = LayerTracker(engine, c.keep_last_layers, float(c.offload_fraction))
        # Log the per-layer line (once per process) after the first entry that ran decoder layers; integrations that
        # print their own line set it to False.
        self.report_layers = True
        self._selector: Optional[Selector] = None
        self._bound_models: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        if c.policy != "hidden_states":
            self._selector = Selector(
                c.policy, self.layer_tracker, c.min_offload_size, c.offload_cpu_tensors, c.offload_output_head
            )
        select = self._selector

        def pack_hook(x: torch.Tensor) -> Any:
            if type(x) in plain:
                if select is not None and type(x) is torch.Tensor and select(x):
                    engine.mark(x)
                return pack_op(x, scope_id)
            return _pack_subclass(engine, x, scope_id)

        def unpack_hook(packed: Any) -> torch.Tensor:
            return unpack_op(packed) if type(packed) is torch.Tensor else packed.unpack()

        # Never compiled: autograd calls the hooks from eager code that may run inside a torch.compile'd model (a
        # graph-break region of whole-model compile). torch <= 2.11's dynamo then compiles the hook's own frame; AOT
        # tracing runs the engine op on a FunctionalTensor at compile time and bakes its handle into the graph as a
        # constant, so every later step unpacks that trace-time tensor ("Attempting to use FunctionalTensor on its
        # own" in backward; torch 2.14 does not compile these frames). Disabling dynamo here is right on every torch.
        pack_hook = torch._dynamo.disable(pack_hook)
        unpack_hook = torch._dynamo.disable(unpack_hook)
        # The exact callables installed as saved-tensor hooks (benchmarks time these).
        self.pack_hook = pack_hook
        self.unpack_hook = unpack_hook
        super().__init__(pack_hook, unpack_hook)

    def bind_model(self, model: torch.nn.Module) -> "OffloadScope":
        """Tell the scope which model it serves: the order of its decoder layers (for keep_last_layers and
        offload_fraction, and the names in `layer_stats`), its buffers (never offloaded by policy "all"), and for a
        callable policy the qualified names of its modules. Returns the scope."""
        try:
            from transformers.modeling_layers import GradientCheckpointingLayer
        except ImportError:
            GradientCheckpointingLayer = None
        if GradientCheckpointingLayer is not None:
            self.layer_tracker.bind(model, GradientCheckpointingLayer)
        if self._selector is not None:
            self._bound_models.add(model)
            if self.active:
                self._refresh_parameter_storages()  # otherwise the next entry reads them
            reset_head_state_on_forward(model, lambda: getattr(current_scope(), "layer_tracker", None))
        if callable(self.config.policy):
            track_module_names(model)
        return self

    def _refresh_parameter_storages(self) -> None:
        """The storage addresses of the bound models' parameters and buffers, now: re-read at every entry, since
        `model.to()`, sharding or a LoRA merge moves them (and the allocator may give the old addresses to
        activations)."""
        if self._selector is None:
            return
        storages: set[int] = set()
        for model in list(self._bound_models):
            for t in list(model.parameters()) + list(model.buffers()):
                if type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and t.numel() > 0:
                    storages.add(t.untyped_storage().data_ptr())
        self._selector.storages = storages

    @property
    def layer_stats(self) -> dict[str, LayerStats]:
        """Per decoder layer (qualified name): chosen by the layer budget or not, calls, tensors and bytes offloaded."""
        return {k: dataclasses.replace(v) for k, v in self.layer_tracker.layers.items()}

    def pack_sac_entry(self, value: Any) -> Any:
        """Policy "sac": a value torch's selective-checkpoint cache stores, with its tensors handed to the engine."""
        select = self._selector  # always set for policy "sac"

        def pack_tensor(t: torch.Tensor) -> Optional[torch.Tensor]:
            if not select.movable(t):
                return None  # small, CPU, or a weight a SAC policy keeps a view of (aten.t): it stays where it is
            self._scope.mark(t)
            return torch.ops.hsoffload.offload_pack(t, self.id)

        return pack_sac_value(value, pack_tensor)

    def __enter__(self) -> "OffloadScope":
        if self.layer_tracker.budgeted and not self.layer_tracker.bound:
            raise ValueError(
                "hsoffload: keep_last_layers/offload_fraction need the model's decoder layers; create the scope with "
                "hsoffload.offload_hidden_states(model, ...) or call scope.bind_model(model) before entering it"
            )
        if callable(self.config.policy) and not self._bound_models:
            log_once(
                "callable-no-model",
                logging.WARNING,
                "hsoffload: a callable policy without the model gets only decoder-layer names (or ''); pass the model "
                "(hsoffload.offload_hidden_states(model, policy=...) or scope.bind_model(model)) for every module's "
                "qualified name",
            )
        if self.config.max_pool_bytes is not None:
            # The host pool is process-wide: the bound applies from this entry on, to every scope.
            torch.classes.hsoffload.OffloadScope.set_pool_limit(self.config.max_pool_bytes)
        self._scope.enter()
        try:
            self.layer_tracker.reset_entry()  # only once the engine accepted the entry (it refuses a re-entry)
            self._refresh_parameter_storages()
            _apply_host_budget(self.config.max_host_bytes)
            super().__enter__()
        except BaseException:
            self._scope.exit()
            raise
        _tls.__dict__.setdefault("stack", []).append(self)
        _count_active(1)
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        inner = current_scope()
        if inner is not None and inner is not self and self in getattr(_tls, "stack", []):
            raise RuntimeError(
                f"hsoffload: exiting offload scope #{self.id} while scope #{inner.id}, entered after it on this "
                "thread, is still active; exit scopes in the reverse order of entering them (innermost first)"
            )
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self._scope.exit()
            stack = getattr(_tls, "stack", [])
            if self in stack:  # at most once: entering an active scope again is refused
                stack.remove(self)
                _count_active(-1)
        layers_ran = self.layer_tracker.layer_ran
        self.layer_tracker.reset_entry()
        if exc_type is None:
            self._report_if_ineffective()
            if self.report_layers and layers_ran:
                self.report_layers = False
                log_once(
                    "layer-summary",
                    logging.INFO,
                    "hsoffload: policy=%s per layer: %s",
                    policy_name(self.config.policy),
                    self.layer_summary(),
                )

    def layer_summary(self) -> str:
        """One line: what each decoder layer sent to the host, or that the layer budget kept it."""
        return self.layer_tracker.summary()

    def _report_if_ineffective(self) -> None:
        stats = OffloadStats.from_list(self._scope.stats())  # the engine's counters, whatever a subclass reports
        if stats.kept_on_device_tensors > 0:
            log_once(
                "kept-on-device",
                logging.WARNING,
                "hsoffload: %d marked tensors stayed on the device because the host budget (max_host_bytes=%d "
                "bytes) was full and no spill_dir is set. Set spill_dir (HSOFFLOAD_SPILL_DIR) to spill them to a "
                "local disk, or raise max_host_bytes. See scope.stats.kept_on_device_tensors.",
                stats.kept_on_device_tensors,
                budget_stats().limit,
            )
        if stats.skipped_marked_tensors > 0:
            log_once(
                "skipped-marked",
                logging.INFO,
                "hsoffload: %d marked tensors were kept in place: CPU tensors (offload_cpu_tensors=False), tensors "
                "below min_offload_size=%d bytes or empty, or tensors without plain storage of their own (nested, "
                "sparse, quantized, meta/fake, __torch_dispatch__ subclasses such as DTensor). See "
                "scope.stats.skipped_marked_tensors.",
                stats.skipped_marked_tensors,
                self.config.min_offload_size,
            )
        if stats.saved_tensors_seen > 0 and stats.marked_tensors == 0 and not _warned_unmarked.is_set():
            _warned_unmarked.set()
            logger.warning(
                "hsoffload: an offload scope saw %d saved tensors but none was marked, so nothing was offloaded. "
                "Mark hidden states with torch.ops.hsoffload.mark_hidden_state, or call hsoffload.patch() and "
                "enable gradient checkpointing on a transformers model (model.gradient_checkpointing_enable()).",
                stats.saved_tensors_seen,
            )

    def mark(self, x: torch.Tensor) -> torch.Tensor:
        """Mark `x` for offload (same as torch.ops.hsoffload.mark_hidden_state while this scope is current)."""
        if current_scope() is not self:
            raise RuntimeError(
                "hsoffload: OffloadScope.mark called while this scope is not the innermost active scope on this "
                "thread; call it inside `with scope:` on the thread that entered it"
            )
        return mark_hidden_state(x)

    @property
    def id(self) -> int:
        """Process-unique id of this scope (what the pack op takes as `scope`)."""
        return int(self._scope.id())

    @property
    def active(self) -> bool:
        return bool(self._scope.active())

    @property
    def stats(self) -> OffloadStats:
        return OffloadStats.from_list(self._scope.stats())

    def spill_stats(self) -> dict[str, int]:
        """I/O counters of the spill store this scope writes to (all 0 without spill_dir)."""
        names = ("bytes_written", "bytes_read", "write_ns", "read_ns", "files", "direct_io")
        return dict(zip(names, (int(v) for v in self._scope.spill_stats())))

    def tracked_state(self) -> int:
        """Marks and host copies this scope still tracks (0 once graphs are freed)."""
        return int(self._scope.tracked_state())


_logged_unscoped_mark = threading.Event()  # "log once" flags, process-wide by intent
_logged_parameter_mark = threading.Event()


def mark_hidden_state(x: torch.Tensor) -> torch.Tensor:
    """Mark `x` for offload if autograd saves it while an offload scope is active on this thread.

    Returns `x`. Without an active scope this does nothing (logged once at debug level).
    """
    if current_scope() is None and not _logged_unscoped_mark.is_set():
        _logged_unscoped_mark.set()
        logger.debug("hsoffload: mark_hidden_state called with no offload scope active on this thread; no effect")
    if isinstance(x, torch.nn.Parameter):
        if not _logged_parameter_mark.is_set():
            _logged_parameter_mark.set()
            logger.warning(
                "hsoffload: mark_hidden_state got a parameter (shape %s); parameters live for the whole run and are "
                "never offloaded. Mark activations such as a layer's hidden_states input instead.",
                tuple(x.shape),
            )
        return x
    return torch.ops.hsoffload.mark_hidden_state(x)


def cumulative_stats() -> OffloadStats:
    """Counters summed over every scope in this process."""
    return OffloadStats.from_list(torch.classes.hsoffload.OffloadScope.process_stats())


def pool_stats() -> PoolStats:
    """What the process-wide host pool holds now."""
    return PoolStats(**dict(zip(_POOL_FIELDS, torch.classes.hsoffload.OffloadScope.pool_stats())))


def empty_pool() -> None:
    """Free every idle host buffer of the pool."""
    torch.classes.hsoffload.OffloadScope.empty_pool()


def budget_stats() -> BudgetStats:
    """The process-wide host budget now (an "auto" limit is resolved by this call if it was not yet)."""
    v = [int(x) for x in torch.classes.hsoffload.OffloadScope.host_budget()]
    return BudgetStats(v[0], v[1], v[2], v[3], bool(v[4]), v[5], v[6])


def set_host_budget(max_host_bytes: Union[int, str]) -> None:
    """Set the process-wide host budget now: bytes, or "auto" (recomputed from MemAvailable now)."""
    value = parse_bytes(max_host_bytes, "max_host_bytes")
    torch.classes.hsoffload.OffloadScope.set_host_budget(-1 if value == "auto" else int(value))


def _apply_host_budget(wanted: Union[int, str, None]) -> None:
    """What a scope entry does with its max_host_bytes. None keeps the budget as it is; "auto" keeps an auto limit
    resolved at first use (it is not recomputed each step, when MemAvailable already excludes what we offloaded)."""
    now = budget_stats()
    if wanted is None or wanted == "auto":
        if wanted == "auto" and not now.is_auto:
            set_host_budget("auto")
            now = budget_stats()
        if not now.is_auto:
            return
        log_once(
            "auto-budget",
            logging.INFO,
            "hsoffload: host budget max_host_bytes=auto: %.2f GiB = 80%% of MemAvailable %.2f GiB / "
            "LOCAL_WORLD_SIZE %d",
            now.limit / 2**30,
            now.mem_available / 2**30,
            now.local_world_size,
        )
    elif now.is_auto or now.limit != wanted:
        set_host_budget(wanted)
