"""`OffloadScope`: a context manager over `saved_tensors_hooks` whose pack/unpack hooks dispatch into the engine
(`torch.ops.hsoffload.offload_pack` / `offload_unpack`), and `mark_hidden_state`.

The scope composes what the other modules decide: the policy's `Selector` (which saves to mark), the `LayerTracker`
(layer budget, prefetch groups, per-layer counters), policy "sac"'s cache packing, and DTensor handling (a marked
DTensor offloads its local shard). Thread-safety: a scope is entered on one thread (`hsoffload.offload.current`); its hooks
run on that thread in forward and on autograd's threads in backward, where only the engine (thread-safe) is called.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import weakref
from types import TracebackType
from typing import Any, Optional

import torch

from . import cuda_capture, current, diagnostics
from .. import engine as _engine
from .._logging import log_once
from .config import OffloadConfig
from .cuda_graph_trees import owned_by_cudagraph_tree, trees_loaded
from .current import current_scope
from .autograd_tasks import GraphTaskWatch
from .host import apply_host_budget, budget_stats, reserve_host
from .layers import LayerStats, LayerTracker, reset_head_state_on_forward
from .passthrough import BackwardSave, PassthroughCounters, PassthroughStats, in_backward
from .policy import Selector, chooses_per_layer, picks_saved_tensors, policy_name, track_module_names
from . import sac
from .sac import SacHandle, pack_sac_value, take_pending
from ..stats import OffloadStats, SpillStats, from_engine
from ..targets import checkpointing_enable_name as _checkpointing_enable_name

logger = logging.getLogger("hsoffload")


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # the types whose storages is_parameter_or_view compares
_warned_unmarked = threading.Event()  # "log once" flag, process-wide by intent


class _DTensorHandle:
    """What the pack hook keeps for a marked DTensor: the engine's handle of its local shard, and its metadata."""

    __slots__ = ("local", "spec", "requires_grad")

    def __init__(self, local: torch.Tensor, spec: Any, requires_grad: bool) -> None:
        self.local, self.spec, self.requires_grad = local, spec, requires_grad

    def unpack(self) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return DTensor(_engine.offload_unpack(self.local), self.spec, requires_grad=self.requires_grad)


def _dtensor_class() -> Optional[type]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def _pack_subclass(engine: _engine.EngineScope, x: torch.Tensor, scope_id: int) -> Any:
    """Tensor subclasses: a marked DTensor offloads its local shard and comes back as a DTensor with the same mesh,
    placements and metadata; every other subclass goes to the engine, which passes it through untouched (counted
    in skipped_marked_tensors when marked, logged once at scope exit). A DTensor counts as marked when the wrapper
    is (the op's CompositeImplicitAutograd kernel sees the wrapper) or its local shard is (a kernel reached through
    DTensor's dispatch would see the shard)."""
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(x, dtensor):
        local = x._local_tensor
        if engine.is_marked(x) or engine.is_marked(local):
            engine.mark(local)
            return _DTensorHandle(_engine.offload_pack(local, scope_id), x._spec, x.requires_grad)
    return _engine.offload_pack(x, scope_id)


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
        self._scope = _engine.EngineScope(**c.engine_kwargs())  # by name: the table's engine options
        scope_id = self._scope.id()
        pack_op = _engine.offload_pack
        unpack_op = _engine.offload_unpack
        engine = self._scope
        plain = (torch.Tensor, torch.nn.Parameter)
        self.layer_tracker = LayerTracker(engine, c.keep_last_layers, float(c.offload_fraction))
        # policy "auto": the bound model's controller (hsoffload.offload.auto), set by bind_model
        self.auto: Optional[Any] = None
        # Log the per-layer line (once per process) after the first entry that ran decoder layers; integrations that
        # print their own line set it to False.
        self.report_layers = True
        self._bound_models: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        # Every policy asks the selector whether a tensor is worth a copy (`movable`: SAC-kept tensors); only "all",
        # callables and compiled "sac" layers let it pick saved tensors in the pack hook.
        self._selector = Selector(
            c.policy, self.layer_tracker, c.min_offload_size, c.offload_cpu_tensors, c.offload_output_head
        )
        self._passthrough = PassthroughCounters()
        self._selector.counters = self._passthrough
        select = self._selector if picks_saved_tensors(c.policy) else None
        bump = self._passthrough.bump
        sac_state = sac.state
        owned_by_tree = owned_by_cudagraph_tree
        is_marked = engine.is_marked
        pack_sac_kept = self._pack_sac_kept
        tracker = self.layer_tracker

        def pack_hook(x: torch.Tensor) -> Any:
            probe = cuda_capture.capture_probe()  # None where the engine tells capture itself (torch >= 2.13)
            if probe is not None and probe():
                return pack_op(x, scope_id, True)  # a graph is being captured: x stays where it is
            pending = sac_state.pending  # a tensor the SAC cache keeps (torch >= 2.14 routes it here)
            if pending is not None and pending.claims(x):
                return pack_sac_kept(x, pending)
            if in_backward():  # never a new marked save, whatever it aliases (hsoffload.offload.passthrough)
                bump("backward_saves")
                return BackwardSave(x)
            if select is not None:
                visit = tracker.current
                if visit is not None and not visit.offload:
                    # A layer the layer budget keeps on the device: nothing it saves moves, a tensor an earlier layer
                    # marked included (each save copies its own bytes: it would be a new copy in this layer).
                    bump("kept_layer_saves")
                    return BackwardSave(x)
            if type(x) in plain:
                if select is not None and type(x) is torch.Tensor and select(x):
                    engine.mark(x)
                # A CUDA-graph tree's memory (reduce-overhead compile) stays where it is, as under capture (counted);
                # asked only of tensors the engine would offload, once inductor's trees exist.
                in_tree = trees_loaded() and is_marked(x) and owned_by_tree(x)
                return pack_op(x, scope_id, in_tree)
            return _pack_subclass(engine, x, scope_id)

        watch = GraphTaskWatch(engine.release_restores)
        self._graph_tasks = watch
        note_unpack = watch.note_unpack

        def unpack_hook(packed: Any) -> torch.Tensor:
            note_unpack()  # the engine gives back what it holds for this backward when its graph task ends
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
            if chooses_per_layer(self.config.policy):
                from . import auto  # noqa: PLC0415  (policy auto only)

                if self.auto is not None and self.auto is not auto.controller(model):
                    raise ValueError("hsoffload: policy auto serves one model per scope; this scope already serves "
                                     "another")
                self.auto = auto.controller_for(model, GradientCheckpointingLayer, self.config)
        self._bound_models.add(model)
        if self.active:
            self._refresh_parameter_storages()  # otherwise the next entry reads them
        if picks_saved_tensors(self.config.policy):
            reset_head_state_on_forward(model)
        if callable(self.config.policy):
            track_module_names(model)
        return self

    def _refresh_parameter_storages(self) -> None:
        """The storage addresses of the bound models' parameters and buffers, now: re-read at every entry, since
        `model.to()`, sharding or a LoRA merge moves them (and the allocator may give the old addresses to
        activations)."""
        storages: set[int] = set()
        parameters: list[torch.Tensor] = []
        for model in list(self._bound_models):
            # One walk of the module tree for both (this runs at every entry: a walk per kind cost ~0.5 ms a step).
            for module in model.modules():
                parameters += [p for p in module._parameters.values() if p is not None]
                for t in itertools.chain(module._parameters.values(), module._buffers.values()):
                    if type(t) in _PLAIN_TENSORS and t.layout == torch.strided and t.numel() > 0:
                        storages.add(t.untyped_storage().data_ptr())
        self._selector.storages = storages
        self._selector.zero3.bind(parameters)

    @property
    def layer_stats(self) -> dict[str, LayerStats]:
        """Per decoder layer (qualified name): chosen by the layer budget or not, calls, tensors and bytes offloaded."""
        return {k: dataclasses.replace(v) for k, v in self.layer_tracker.layers.items()}

    def _pack_sac_kept(self, x: torch.Tensor, pending: sac._Pending) -> Any:
        """The pack hook for a tensor the SAC cache keeps (torch >= 2.14, respect_saved_tensors_hooks=True): to the
        engine marked when its save offloads (policy "sac", CheckpointPolicy.*_CPU_OFFLOAD) and it is worth a copy,
        untouched otherwise (counted as seen; the engine's version check replaces torch's)."""
        if pending.offload and type(x) is torch.Tensor and self._selector.movable(x):
            self._scope.mark(x)
            pending.call.offloaded.add(pending.key)
            return SacHandle(_engine.offload_pack(x, self.id), pending.call, pending.key)
        return _engine.offload_pack(x, self.id)

    def pack_sac_entry(self, value: Any) -> Any:
        """A value torch's selective-checkpoint cache stores (torch < 2.14, where it bypasses the hooks), with its
        tensors handed to the engine when the policy's decision for it (`sac.take_pending`) offloads."""
        pending = take_pending()
        if pending is None or not pending.offload:
            return value

        def pack_tensor(t: torch.Tensor) -> Optional[torch.Tensor]:
            if not self._selector.movable(t):
                return None  # small, CPU, or a weight a SAC policy keeps a view of (aten.t): it stays where it is
            self._scope.mark(t)
            probe = cuda_capture.capture_probe()
            return _engine.offload_pack(t, self.id, probe is not None and probe())

        return pack_sac_value(value, pack_tensor, pending)

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
        if not self.config.pin_memory and _accelerator_available():
            log_once(
                "pin-memory-off",
                logging.WARNING,
                "hsoffload: pin_memory=False with an accelerator: copies to pageable host memory are synchronous, so "
                "every pack and unpack waits for the device (no overlap with compute). Set pin_memory=True (the "
                "default) unless the system cannot pin memory.",
            )
        if self.config.max_pool_bytes is not None:
            # The host pool is process-wide: the bound applies from this entry on, to every scope.
            _engine.set_pool_limit(self.config.max_pool_bytes)
        self._scope.enter()
        self._graph_tasks.reset()  # a backward of an earlier entry that raised left its task open
        try:
            self.layer_tracker.reset_entry()  # only once the engine accepted the entry (it refuses a re-entry)
            self._refresh_parameter_storages()
            apply_host_budget(self.config.max_host_bytes)  # first: the reservation pins under this entry's limit
            if self.config.reserve_host_bytes:
                reserve_host(self.config.reserve_host_bytes)  # a no-op once the pool has that much free
            super().__enter__()
        except BaseException:
            self._scope.exit()
            raise
        current.push(self)
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        inner = current_scope()
        if inner is not None and inner is not self and current.entered_on_this_thread(self):
            raise RuntimeError(
                f"hsoffload: exiting offload scope #{self.id} while scope #{inner.id}, entered after it on this "
                "thread, is still active; exit scopes in the reverse order of entering them (innermost first)"
            )
        if self.auto is not None:
            self.auto.restore()  # the layers' own gradient_checkpointing flags, until the next entry applies auto's
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self._graph_tasks.reset()
            self._scope.exit()
            current.pop(self)  # at most once: entering an active scope again is refused
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
        stats = from_engine(OffloadStats, self._scope.stats())  # the engine's counters, whatever a subclass reports
        if stats.captured_passthrough > 0:
            log_once(
                "captured-passthrough",
                logging.INFO,
                "hsoffload: %d marked tensors were saved while a graph was being captured or live in a CUDA-graph "
                "tree's memory (CUDA graphs, torch.compile mode='reduce-overhead'); they stayed on the device, in the "
                "graph's memory. Offload applies to eager and non-cudagraphed compiled code only (mode='default' or "
                "'max-autotune-no-cudagraphs'). See scope.stats.captured_passthrough.",
                stats.captured_passthrough,
            )
        if stats.kept_on_device_tensors > 0 and not self.config.spill_dir:
            log_once(
                "kept-on-device",
                logging.WARNING,
                "hsoffload: %d marked tensors stayed on the device because the host budget (max_host_bytes=%d "
                "bytes) was full and no spill_dir is set. Set spill_dir (HSOFFLOAD_SPILL_DIR) to spill them to a "
                "local disk, or raise max_host_bytes. See scope.stats.kept_on_device_tensors.",
                stats.kept_on_device_tensors,
                budget_stats().limit,
            )
        elif stats.kept_on_device_tensors > 0:
            log_once(
                "kept-on-device-disk-lags",
                logging.WARNING,
                "hsoffload: %d marked tensors stayed on the device because the host budget (max_host_bytes=%d "
                "bytes) was full and the spill writes to %s did not free room within spill_wait_ms=%d (packs "
                "outran the disk). Use a faster local disk, raise max_host_bytes or spill_wait_ms. See "
                "scope.stats.kept_on_device_tensors and pack_wait_ns.",
                stats.kept_on_device_tensors,
                budget_stats().limit,
                self.config.spill_dir,
                self.config.spill_wait_ms,
            )
        self._report_host_faults(stats)
        self._report_kept_in_place(stats)

    def _report_host_faults(self, stats: OffloadStats) -> None:
        """Once per cause: spill writes or pinned allocations that failed."""
        if stats.spill_write_errors > 0:
            log_once(
                "spill-write-errors",
                logging.WARNING,
                "hsoffload: %d spill writes to %s failed (disk full or an I/O error; the first error was raised at "
                "the next pack, if one came). Copies written from host memory stayed there; one written straight "
                "from device memory is lost and its unpack raises. Free space there or point spill_dir at a larger "
                "local disk. See scope.stats.spill_write_errors.",
                stats.spill_write_errors,
                self.config.spill_dir,
            )
        if stats.host_alloc_failures > 0:
            log_once(
                "host-alloc-failures",
                logging.WARNING,
                "hsoffload: %d host (pinned) allocations failed, so those marked tensors stayed on the device "
                "(counted in kept_on_device_tensors). The host budget is %d bytes (max_host_bytes); the system could "
                "not pin that much: lower max_host_bytes (or HSOFFLOAD_MAX_HOST_BYTES), call hsoffload.reserve_host() "
                "before training so the pool pins its memory up front, or free host memory. See "
                "scope.stats.host_alloc_failures. The first failure: %s",
                stats.host_alloc_failures,
                budget_stats().limit,
                str(self._scope.first_host_alloc_error()).strip() or "(no message)",
            )

    def _report_kept_in_place(self, stats: OffloadStats) -> None:
        """Once per cause: prefetches without room, marked tensors kept in place, a scope that marked nothing."""
        if stats.prefetch_oom > 0 or stats.prefetch_dropped > 0:
            log_once(
                "prefetch-oom",
                logging.INFO,
                "hsoffload: the device had no room for %d prefetches (and %d prefetched blocks were given back for a "
                "restore that needed them); those tensors were copied back on demand, the step went on. A smaller "
                "prefetch_depth (now %d) trades that retry for less device memory. See scope.stats.prefetch_oom.",
                stats.prefetch_oom,
                stats.prefetch_dropped,
                self.prefetch_depth,
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
        if (
            stats.saved_tensors_seen > 0
            and stats.marked_tensors == 0
            and not _warned_unmarked.is_set()
            and not diagnostics.bypass_reported()  # the reason logged says what to do instead
            and not (self.auto is not None and self.auto.offloads_none())  # policy auto chose to offload no layer
        ):
            _warned_unmarked.set()
            logger.warning(
                "hsoffload: an offload scope saw %d saved tensors but none was marked, so nothing was offloaded. "
                "Mark hidden states with torch.ops.hsoffload.mark_hidden_state, or call hsoffload.patch() and "
                "enable checkpointing on a transformers model (model.%s()).",
                stats.saved_tensors_seen,
                _checkpointing_enable_name(),
            )

    def mark(self, x: torch.Tensor) -> torch.Tensor:
        """Mark `x` for offload (same as torch.ops.hsoffload.mark_hidden_state while this scope is current)."""
        if current_scope() is not self:
            raise RuntimeError(
                "hsoffload: OffloadScope.mark called while this scope is not the innermost active scope on this "
                "thread; call it inside `with scope:` on the thread that entered it"
            )
        return mark_hidden_state(x)

    def set_prefetch_depth(self, depth: int) -> None:
        """Decoder layers restored ahead of backward from now on (config.prefetch_depth until set; policy auto sets
        its choice at every step's first layer)."""
        self._scope.set_prefetch_depth(int(depth))

    @property
    def prefetch_depth(self) -> int:
        return self._scope.prefetch_depth()

    @property
    def id(self) -> int:
        """Process-unique id of this scope (what the pack op takes as `scope`)."""
        return self._scope.id()

    @property
    def active(self) -> bool:
        return self._scope.active()

    @property
    def stats(self) -> OffloadStats:
        return from_engine(OffloadStats, self._scope.stats())

    @property
    def passthrough_stats(self) -> PassthroughStats:
        """Saved tensors kept in place without reaching the engine: saves during backward, ZeRO-3 parameters and
        their aliases (hsoffload.offload.passthrough)."""
        return self._passthrough.snapshot()

    def spill_stats(self) -> dict[str, int]:
        """I/O counters of the spill store this scope writes to (all 0 without spill_dir), by name (`SpillStats`)."""
        return dataclasses.asdict(from_engine(SpillStats, self._scope.spill_stats()))

    def tracked_state(self) -> int:
        """Marks and host copies this scope still tracks (0 once graphs are freed)."""
        return self._scope.tracked_state()


_logged_unscoped_mark = threading.Event()  # "log once" flags, process-wide by intent
_logged_parameter_mark = threading.Event()


def _accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator is not None and accelerator.is_available())


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
    return _engine.mark_hidden_state(x)
