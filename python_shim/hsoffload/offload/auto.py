"""`policy="auto"` at run time: measure, decide per decoder layer, apply, verify.

A model's `AutoController` (one per model, kept beside it while it lives) sees every decoder-layer call of forward
before the layer runs (the patch calls `before_layer`); the first layer's call starts a step (a micro-batch).

- Calibration (`auto_calibration_steps`, default 2): every layer checkpointed and offloaded (the leanest choice).
  In the first, each kind of layer (its class and parameter shapes) is probed once at its own call: its forward
  without checkpointing under a counting saved-tensor hook (what it would hold on the device: `held_none`), its
  backward (`torch.autograd.grad` to its input and parameters: no `.grad` is touched), and a copy of its input to
  pinned host memory and back (the copy time); all under a forked RNG, so the step's dropout is untouched. Where the
  layer's checkpoint could run selectively (non-reentrant, no context_fn of the user's), the probe's forward also
  records its projections (aten.mm and aten.addmm: the linear layers) under a dispatch mode, each timed, and which
  of their outputs a recompute reads (those made before the layer's last saved tensor: torch's early stop ends the
  recompute there): the `sac` choice's bytes and the time it saves. A probe
  that would not fit the budget is not run (that layer is never left uncheckpointed); one that runs out of memory
  marks the same. Calibration is per shape bucket (hsoffload.offload.calibration: micro-batch, length rounded up to
  its bucket's top, quadratic attention or not): each bucket's steps without the probe give its lean baseline,
  scaled up to the bucket's top; a batch always runs its own bucket's decision.
- The decision (hsoffload.choose): the least predicted step time whose predicted peak (the lean peak plus what the
  decision holds, plus a safety margin) is under the budget; logged as a table once per decision.
- Applied per layer: `none` clears the layer's `gradient_checkpointing` flag (transformers honours it per layer),
  `keep` leaves it checkpointed but not offloaded (the layer tracker's selection), `offload` is policy
  hidden_states, `sac` is offload with the layer's checkpoint given a selective context (`SAC_CONTEXT`) that asks
  `CheckpointPolicy.MUST_CPU_OFFLOAD` for its projections (hsoffload.offload.sac moves them). Restored when the scope
  exits.
- Verified: the device's peak counter is reset at the steps auto measures (calibration, a decision's first step),
  read when backward reaches the first layer and at the optimizer's step; other steps are verified by the
  counter's rise within them (outer readers see them whole). A peak over the prediction raises the margin by the
  difference (the margin only grows: no oscillation) and, when the decision then no longer fits, decides again. A
  batch of a bucket not measured yet runs with the leanest choice and calibrates its bucket before it is decided
  for: a longer batch is planned, never discovered by an OOM. A forward beyond those a decision was made for runs
  lean (a decision never changes between a step's forwards); the next micro-batch decides for them.
- `auto_report_only`: decide and log, keep every layer offloaded.

Thread-safety: a controller is used on the thread that runs the model's forward (as the scope it serves).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import math
import os
import time
import weakref
import zlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .._logging import log_once
from ..choose import SAC_WINDOW, Choice, Decision, LayerCost, Phases, choose, predict, prefetch_depths
from ..targets import LAYER_ATTR, unwrap_marking
from .calibration import Shape, agreed_bucket, bucket_of, quadratic_attention
from .ranks import Ranks

logger = logging.getLogger("hsoffload")

BUDGET_FRACTION = 0.95  # without device_budget: at most this share of the device's memory
HEADROOM_FRACTION = 0.02  # without device_budget: this share of the device left free beside what the process holds
# outside the allocator (measured at the decision: the CUDA context, communicators' buffers, other processes)
PROBE_GUESS = 24  # a probe runs only if this many times the layer's input still fits under the budget
HISTORY = 1000  # steps kept in `history`
DECISION_LOG = 100  # decisions kept in `decision_log`
VERIFY_STEPS = 3  # a decision with sac: its first this many steps' median time is checked against the prediction
TIME_SLACK = 0.10  # ... and sac's cost learned where that median passes the prediction by more than this share
COPY_REPEATS = 3  # a probe's copy time: the fastest of this many round trips of the layer's input
STATE_VERSION = 3  # of the file auto_state_path names (2: probes measure the projections; 3: buckets by shape)
RESTORE_TOLERANCE = 0.02  # a saved bucket is reused where its first step measures its figures within this share

# The `sac` choice: a layer's projections (the linear layers' matmuls) offloaded by SAC, the rest recomputed. Absent
# (None) on torch releases without CheckpointPolicy.MUST_CPU_OFFLOAD: then the choice is never offered.
_CPU_OFFLOAD = getattr(CheckpointPolicy, "MUST_CPU_OFFLOAD", None)
PROJECTIONS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})


def _projections_to_host(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The `sac` choice's selective-checkpoint policy: the projections' outputs to the host, the rest recomputed."""
    return _CPU_OFFLOAD if op in PROJECTIONS else CheckpointPolicy.PREFER_RECOMPUTE


# The context_fn a `sac` layer's checkpoint is called with (one object: the controller recognises its own).
SAC_CONTEXT = functools.partial(create_selective_checkpoint_contexts, _projections_to_host)


def _selective_ready(layer: torch.nn.Module) -> Optional[functools.partial]:
    """The layer's checkpoint function if the `sac` choice can give it a selective context: torch's non-reentrant
    checkpoint as transformers binds it, without a context_fn of the user's (whose SAC would be replaced)."""
    func = unwrap_marking(getattr(layer, LAYER_ATTR, None))
    if _CPU_OFFLOAD is None or not isinstance(func, functools.partial):
        return None
    kw = func.keywords
    if kw.get("use_reentrant") is not False or kw.get("context_fn") not in (None, SAC_CONTEXT):
        return None
    return func


def _is_selective(func: Any) -> bool:
    """Whether a layer's checkpoint function is the one the `sac` choice installed (wrapped by the patch or not)."""
    func = unwrap_marking(func)
    return isinstance(func, functools.partial) and func.keywords.get("context_fn") is SAC_CONTEXT


class _Projections(TorchDispatchMode):
    """The projections of one forward, in order: each output's bytes and time (synchronized around each: a probe's
    forward, once per kind of layer); `read` how many came before the last saved tensor (set by the probe's pack
    hook), the ones a recompute reaches."""

    def __init__(self, synchronize: Callable[[], None]) -> None:
        super().__init__()
        self.synchronize = synchronize
        self.made: list[tuple[int, float]] = []
        self.read = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func not in PROJECTIONS:
            return func(*args, **(kwargs or {}))
        self.synchronize()
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.synchronize()
        self.made.append((out.numel() * out.element_size(), time.perf_counter() - t0))
        return out

    def saved(self) -> None:
        self.read = len(self.made)

    def measured(self) -> tuple[int, float]:
        """The bytes of every projection's output (all are copied in a sac layer's first step, and in every step on
        torch releases that ask the policy again in the recompute, 2.11: counted whole, for the host, the window and
        the copies) and the time of those a recompute reads (what it skips)."""
        return sum(b for b, _ in self.made), sum(t for _, t in self.made[:self.read])



COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


class _Collectives(TorchDispatchMode):
    """Watches one decoder-layer call of a calibration step on several ranks for collectives (torch.distributed's
    ops dispatch as c10d.*; functional collectives as _c10d_functional.*): a layer whose forward issues them
    (Ulysses' or ring attention's all-to-alls) is never probed without checkpointing, on any rank: a probe that failed
    on one rank between two of its collectives would leave the others waiting in the next one."""

    def __init__(self, seen: dict[tuple, bool], kind: tuple) -> None:
        super().__init__()
        self._seen, self._kind = seen, kind
        self._any = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if not self._any and getattr(func, "namespace", None) in COLLECTIVE_NAMESPACES:
            self._any = True
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc: Any) -> Any:
        self._seen[self._kind] = self._seen.get(self._kind, False) or self._any
        return super().__exit__(*exc)


@dataclasses.dataclass
class StepRecord:
    """One step (micro-batch) under a decision: predicted and measured."""

    tokens: int
    decided: bool  # False: a calibration step
    predicted_peak_bytes: Optional[int]
    measured_peak_bytes: Optional[int]  # None: a decided step whose peak counter did not rise above an earlier one
    predicted_step_s: Optional[float]
    measured_step_s: float
    decision_index: int = 0  # the decision it ran with (controller.decisions then; 0: none)
    measured_reserved_bytes: Optional[int] = None  # the allocator's reserved peak, where the device tells it


class DeviceMemory:
    """The allocator's figures for one device, by torch.cuda's names on the device's module (torch.cuda, or an
    out-of-tree backend's module that has them); None where it has none. A CPU device reads hsoffload's CPU meter
    (a counting allocator in front of the CPU allocator, installed here): what it lent since, the host pool's copies
    not counted."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._mod = getattr(torch, device.type, None) if device.type != "cpu" else None
        self._meter: Optional[Any] = None
        self._timing = self._events_time()  # decided steps are then timed by events, without a synchronize
        if device.type == "cpu":
            engine = torch.classes.hsoffload.OffloadScope
            if engine.cpu_meter_install():
                self._meter = engine
                log_once("auto-cpu-meter", logging.INFO, "hsoffload: policy auto on the CPU: memory is counted by "
                         "hsoffload's counting CPU allocator from now on (what was allocated before is not counted; "
                         "offloaded copies are host memory, not the device's)")

    def _call(self, name: str, *args: Any) -> Any:
        fn = getattr(self._mod, name, None)
        return fn(*args) if fn is not None else None

    def allocated(self) -> Optional[int]:
        if self._meter is not None:
            return int(self._meter.cpu_meter_stats()["allocated_bytes"])
        return self._call("memory_allocated", self.device)

    def peak(self) -> Optional[int]:
        if self._meter is not None:
            return int(self._meter.cpu_meter_stats()["peak_allocated_bytes"])
        return self._call("max_memory_allocated", self.device)

    def reserved_peak(self) -> Optional[int]:
        """The caching allocator's reserved high-water mark (what the device really gives the process's tensors:
        allocated plus the cache's unused blocks); None where the device keeps no such figure (the CPU meter)."""
        if self._meter is not None:
            return None
        return self._call("max_memory_reserved", self.device)

    def outside_allocator(self) -> Optional[int]:
        """Device bytes in use that the allocator does not hold (the CUDA context, communicators' buffers, other
        processes): used minus reserved; None where unknown."""
        if self._meter is not None:
            return None
        try:
            info = self._call("mem_get_info", self.device)
        except RuntimeError:
            return None
        reserved = self._call("memory_reserved", self.device)
        if info is None or reserved is None:
            return None
        return max(0, int(info[1]) - int(info[0]) - int(reserved))

    def empty_cache(self) -> None:
        """Give the allocator's unused cached blocks back (where it caches), so that the reserved peak that follows
        is the coming steps' own."""
        if self._meter is None:
            self._call("empty_cache")

    def reset_peak(self) -> None:
        if self._meter is not None:
            self._meter.cpu_meter_reset_peak()
        else:
            self._call("reset_peak_memory_stats", self.device)

    def total(self) -> Optional[int]:
        try:
            info = self._call("mem_get_info", self.device)
        except RuntimeError:
            return None
        return None if info is None else int(info[1])

    def synchronize(self) -> None:
        """Wait for everything queued on the device (every stream)."""
        if self._mod is not None:
            self._call("synchronize", self.device)

    def timing_event(self) -> Optional[Any]:
        """An event recorded now on the current stream, that times (None on the CPU, or where the device's events do
        not: then times are host clocks after a synchronize)."""
        if self._mod is None or not self._timing:
            return None
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def _events_time(self) -> bool:
        """Whether the device's events measure elapsed time (asked once: record two, wait, read)."""
        if self._mod is None:
            return False
        try:
            a = torch.Event(device=self.device, enable_timing=True)
            b = torch.Event(device=self.device, enable_timing=True)
            a.record()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) >= 0.0
        except (RuntimeError, TypeError, NotImplementedError):
            return False

    def synchronize_compute(self) -> None:
        """Wait for the current stream only (compute), not the side streams' copies: a layer's compute time."""
        if self._mod is not None:
            event = torch.Event(device=self.device)
            event.record()
            event.synchronize()


def _signature(layer: torch.nn.Module) -> tuple:
    """A layer's kind: its class and its parameters' names, full shapes and dtypes (DeepSpeed ZeRO-3's `ds_shape`:
    its partitioned parameters change shape as they are gathered and released)."""
    return (type(layer).__qualname__,) + tuple((n, tuple(getattr(p, "ds_shape", p.shape)), p.dtype)
                                               for n, p in layer.named_parameters())


def _sharded(layer: torch.nn.Module) -> bool:
    """Whether the layer's parameters are shards that its forward gathers (FSDP2's DTensors or FSDP module, FSDP1's
    flat-parameter views, DeepSpeed ZeRO-3's partitioned parameters)."""
    if any(type(m).__name__.startswith(("FSDP", "FullyShardedDataParallel")) for m in layer.modules()):
        return True
    for p in layer.parameters():
        if hasattr(p, "ds_id") or hasattr(p, "_local_tensor") or hasattr(p, "_is_flat_param") or p.numel() == 0:
            return True
    return False


def _first_tensor(out: Any) -> Optional[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    return getattr(out, "last_hidden_state", None)


def _attention_implementation(layer: torch.nn.Module) -> Optional[str]:
    """The attention implementation a decoder layer's config names (transformers' `_attn_implementation`), None where
    none of its modules has a config."""
    for module in layer.modules():
        impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if isinstance(impl, str):
            return impl
    return None


def _attention_dropout(layer: torch.nn.Module) -> float:
    """The attention dropout a decoder layer's config names (0.0 where none)."""
    for module in layer.modules():
        p = getattr(getattr(module, "config", None), "attention_dropout", None)
        if isinstance(p, (int, float)):
            return float(p)
    return 0.0


def _shape(layer: torch.nn.Module, x: torch.Tensor, args: tuple, kwargs: dict) -> Shape:
    """The shape of the batch whose first decoder layer input is `x` (batch, length, hidden): what policy auto
    calibrates and scales by, the attention being quadratic where the layer's implementation or a 4-D mask among
    its inputs says so."""
    length = int(x.shape[-2]) if x.dim() >= 2 else 1
    batch = x.numel() // max(1, int(x.shape[-1]) * length)
    tensors = []
    for v in (*args[1:], *kwargs.values()):
        if isinstance(v, (tuple, list)):
            tensors.extend(t for t in v[:8] if isinstance(t, torch.Tensor))
        elif isinstance(v, torch.Tensor):
            tensors.append(v)
    impl = _attention_implementation(layer)
    if impl == "sdpa" and layer.training and _attention_dropout(layer) > 0:
        impl = "sdpa-math"  # SDPA with dropout in training takes the math path on the CPU (and may on CUDA)
    return Shape(batch, length, quadratic_attention(impl, tensors, x.device.type))


@dataclasses.dataclass
class _Probe:
    held_none: int  # bytes (math.inf-like huge: never leave uncheckpointed)
    backward_s: float
    copy_s: float
    sac_bytes: int = 0  # the projections' outputs its recompute reads (0: the sac choice not offered)
    projection_s: float = 0.0
    none_forward: int = 0  # its forward's peak above the bytes at its start, without checkpointing
    none_backward: int = 0  # its backward's, above the bytes at the forward's start


class _PhaseMeter:
    """A calibration step's peak by phase (hsoffload.costs.Phases): the device's peak counter read and reset where
    a phase ends, and the bytes allocated where one starts: at each layer's forward call (the patch's
    `before_layer`, `after_layer`), from autograd hooks on the last layer's output (its backward starts: forward and
    the head are over) and on each layer's input (its backward is over); the first layer's is read without a reset
    (the step's own read, `_first_layer_backward_done`). Only in steps with one forward (`on` goes False at a
    second)."""

    def __init__(self, memory: "DeviceMemory", layers: int) -> None:
        self.memory = memory
        self.layers = layers
        self.on = True
        self.head: Optional[int] = None  # the last layer's forward's end to its backward's start
        self.forward: dict[int, int] = {}  # per layer: its forward's peak
        self.forward_start: dict[int, int] = {}
        self.backward: dict[int, int] = {}  # per layer: its recompute and backward's peak
        self.backward_start: dict[int, int] = {}
        self.other = 0  # peaks of what ran between the phases (the embedding), or in them unread (a probe)
        self.reserved: Optional[int] = None  # the largest reserved peak of the phases read

    def read(self, reset: bool = True) -> int:
        peak = int(self.memory.peak() or 0)
        reserved = self.memory.reserved_peak()
        if reserved is not None:
            self.reserved = max(self.reserved or 0, int(reserved))
        if reset:
            self.memory.reset_peak()
        return peak

    def layer_started(self, i: int) -> None:
        if not self.on:
            return
        if i > 0 and i - 1 in self.forward_start:
            self.forward[i - 1] = self.read()
        else:
            self.other = max(self.other, self.read())
        self.forward_start[i] = int(self.memory.allocated() or 0)

    def last_layer_ended(self) -> None:
        if self.on and self.layers - 1 in self.forward_start:
            self.forward[self.layers - 1] = self.read()

    def head_ended(self, grad: torch.Tensor) -> None:
        if self.on and self.head is None:
            self.head = self.read()
            self.backward_start[self.layers - 1] = int(self.memory.allocated() or 0)

    def backward_ended(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.on and self.head is not None and i not in self.backward:
                self.backward[i] = self.read(reset=i > 0)
                if i > 0:
                    self.backward_start[i - 1] = int(self.memory.allocated() or 0)
        return hook

    def complete(self) -> bool:
        n = self.layers
        return (self.on and self.head is not None and len(self.forward) == n and len(self.backward) == n
                and len(self.backward_start) == n)

    def largest(self) -> int:
        """The largest phase read (the step's peak, where its counter was reset at each phase)."""
        return max([self.head or 0, self.other, *self.forward.values(), *self.backward.values()])


@dataclasses.dataclass
class Bucket:
    """The measurements and the decision of one shape bucket (hsoffload.offload.calibration): every figure scaled
    up to the bucket's top shape from the shape it was measured at."""

    shape: Shape  # the bucket's top: what its decision is made for
    calibrated: int = 0  # calibration steps done
    probes: dict[tuple, "_Probe"] = dataclasses.field(default_factory=dict)  # per layer kind
    probe_shape: Optional[Shape] = None  # the batch the probes ran at
    forward_s: dict[int, float] = dataclasses.field(default_factory=dict)  # per layer index (last calibration step)
    forward_shape: Optional[Shape] = None
    held_keep: dict[int, int] = dataclasses.field(default_factory=dict)  # per layer index, at forward_shape
    # The lean step's forward-and-backward peak above what the step started with, scaled to `shape`: the most of
    # its calibration steps without a probe (the probe's step where it is the only one)
    lean_increase: Optional[int] = None
    lean_probed: bool = True  # lean_increase comes from a step with a probe
    lean_forwards: int = 1  # forwards before one backward in the step lean_increase was measured in
    lean_step_s: Optional[float] = None
    # The lean step's peak by phase (hsoffload.costs.Phases) above what the step started with, scaled to `shape`: the
    # most of its calibration steps with one forward and without a probe (the probe's step's where it is the only
    # one); None where no calibration step measured every phase (a flat bound from lean_increase is used then)
    phases: Optional[Phases] = None
    phases_probed: bool = True
    probe_step_increase: Optional[int] = None  # the probe's step's increase (scaled): a restored file's check
    decision: Optional[Decision] = None
    costs: list[LayerCost] = dataclasses.field(default_factory=list)
    decided_start_bytes: int = 0  # what steps started with when the decision was made
    reason: str = ""  # why the decision was made
    fresh: Optional[tuple[int, bool, int]] = None  # the step the allocator's cache was last given back at
    verify: list[float] = dataclasses.field(default_factory=list)  # the decision's first steps' times (sac)
    # Measurements read from auto_state_path, applied once the bucket's first lean step matches them
    restored: Optional[dict[str, Any]] = None
    stale: Optional[str] = None  # why the decision is to be made again (None: it stands)
    decision_index: int = 0  # the controller's decision count when this bucket's decision was made
    decided_forwards: int = 1  # forwards before one backward the decision was made for
    measured_decision: int = -1  # the decision_index whose first step was measured

    @property
    def tokens(self) -> int:
        return self.shape.tokens

    def ready(self, calibration_steps: int) -> bool:
        """Measured enough to decide: its calibration steps run, its layers probed (on several ranks the first
        bucket's first step only watches the layers for collectives: one more step)."""
        return self.lean_increase is not None and self.calibrated >= calibration_steps and bool(self.probes)


NEVER = 1 << 62  # held bytes of a choice that must never be taken
_ABSENT = object()  # a layer without its own checkpoint function (transformers' is on its class)


class AutoController:
    """policy "auto" for one model: calibration, the decision, its application and verification."""

    def __init__(self, model: torch.nn.Module, layer_cls: type, budget: Optional[int], calibration_steps: int,
                 report_only: bool, state_path: Optional[str] = None) -> None:
        # The layers by weak reference: the controller is the value of a weak-keyed map whose key is the model, and
        # a strong reference from it would keep the model alive forever.
        self._layer_refs = [
            (n.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", ""), weakref.ref(m))
            for n, m in model.named_modules() if isinstance(m, layer_cls)]
        unready = [n for n, ref in self._layer_refs if getattr(ref(), LAYER_ATTR, None) is None]
        if unready:
            raise ValueError(f"hsoffload: policy auto decides per layer whether to keep checkpointing, so it needs it "
                             f"enabled first ({unready[0]} has no checkpoint function): "
                             "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
                             "False})")
        self.index = {id(ref()): i for i, (_, ref) in enumerate(self._layer_refs)}
        self.budget_arg = budget
        self.budget: Optional[int] = budget
        self.calibration_steps = calibration_steps
        self.report_only = report_only
        self.state_path = state_path  # auto_state_path: measurements saved at each decision, read at the first step
        # False: the file is written, never read (the Trainer integration's default path in a run that does not
        # resume: an earlier run's file in the same folder is not this run's)
        self.restore_state = True
        self._model_ref = weakref.ref(model)
        self.restored: Optional[str] = None  # the file the measurements came from, when a run started with them
        self._state_read = False
        self.pins: dict[str, Choice] = {}
        self.memory: Optional[DeviceMemory] = None
        # The measurements and decision of each shape bucket (hsoffload.offload.calibration); `bucket` is the one
        # the step in progress runs in.
        self.buckets: dict[Shape, Bucket] = {}
        self.bucket = Bucket(Shape(0, 0, True))
        self.start_bytes = 0  # device bytes steps start with (weights, optimizer states, ...): the most of the last
        # optimizer step's micro-batches and this one's
        self._cycle_starts = (0, 0)  # the most micro-batches started with: the last optimizer step's, this one's
        self.optimizer_steps = 0  # steps of optimizers holding this model's parameters (torch.optim's hook)
        self._optimizer_steps_seen = 0
        self.forwards = 1  # forwards seen before one backward (several: each holds what the decision keeps)
        # The most the step after the backward's first layer (the embedding's gradient, the optimizer's step, up to
        # the next step's first layer) passed what its step started with, where it passed the forward and backward's
        # peak: a floor of every step's peak that no decision changes
        self.tail_increase = 0
        # Per layer kind, on several ranks: whether its forward issued collectives (watched at a calibration step
        # before any probe: such a layer is not probed)
        self.collectives: dict[tuple, bool] = {}
        self.peak_read = 0  # the largest whole-step peak read (the Trainer integration reports it)
        self._urgent: Optional[str] = None  # a reason to decide at the next micro-batch, mid optimizer step too
        # The host's wait in each micro-batch's agreement across ranks (seconds, the last HISTORY): the collective and
        # the copy of its result to the host (the host must know the bucket and the wishes before the layer runs)
        self.agree_s: "collections.deque[float]" = collections.deque(maxlen=HISTORY)
        self._adopt: Optional[tuple[Shape, bool]] = None  # a restored bucket checked by the step that ended: matched?
        self._restored: dict[str, dict[str, Any]] = {}  # auto_state_path's buckets by key, until first used
        self.margin = 0  # bytes added to every predicted peak; grows by each overshoot seen
        # The allocator's reserved peak above its allocated peak in the last calibration step (the cache's blocks
        # not in use, fragmentation): room taken from the budget, which bounds what the device gives the process
        self.allocator_gap = 0
        self.decisions = 0
        self.replans = 0
        # Every decision's choices (a letter a layer) and why it was made, the last DECISION_LOG
        self.decision_log: "collections.deque[str]" = collections.deque(maxlen=DECISION_LOG)
        self.history: "collections.deque[StepRecord]" = collections.deque(maxlen=HISTORY)
        self.decided_steps = 0
        self.ranks: Optional[Ranks] = None  # the job's ranks, agreeing on every decision (bound with the device)
        self._pending: Optional[str] = None  # a reason to decide again at the next step's start (all ranks at once)
        self._step: Optional[dict[str, Any]] = None  # the step in progress
        self._layer_t0: Optional[tuple[int, float]] = None
        self._flags: dict[int, bool] = {}  # each layer's gradient_checkpointing before this controller set it
        # `sac` layers: their own checkpoint function (the instance's attribute, or _ABSENT), and the selective one
        # installed for sac (kept wrapped across scopes: hsoffload.offload.sac learns per wrapped function which
        # entries a recompute leaves unread)
        self._checkpoints: dict[int, list[Any]] = {}
        self.sac_window = SAC_WINDOW  # layers of sac entries on the device at once (the prefetch depth + 1)
        # What sac steps took beyond the model, per layer kind, in seconds per token (learned from decided steps:
        # only grows, so a decision dropped for it does not come back)
        self.sac_extra_per_token: dict[tuple, float] = {}

    # The running bucket's figures, by the names they had before buckets (read by the Trainer integration, tests)
    @property
    def decision(self) -> Optional[Decision]:
        return self.bucket.decision

    @property
    def costs(self) -> list[LayerCost]:
        return self.bucket.costs

    @property
    def reason(self) -> str:
        return self.bucket.reason

    @property
    def tokens(self) -> int:
        """The tokens of the running bucket's top shape (what its decision is for)."""
        return self.bucket.tokens

    @property
    def lean_peak(self) -> Optional[int]:
        """The leanest choice's predicted peak now, in the running bucket: what steps start with, plus the lean
        step's increase for the forwards a step runs."""
        increase = self._lean_increase(self.bucket)
        return None if increase is None else self.start_bytes + increase

    def _lean_increase(self, bucket: Bucket) -> Optional[int]:
        """`bucket`'s lean increase for the forwards steps run before one backward (each holds its own head and
        loss: counted whole, an upper bound)."""
        if bucket.lean_increase is None:
            return None
        forwards = max(self.forwards, bucket.lean_forwards)
        return math.ceil(bucket.lean_increase * forwards / bucket.lean_forwards)

    @property
    def predicted_peak(self) -> Optional[int]:
        """The decision's predicted peak for a step that starts with what steps started with when it was made (the
        margin included); None before a decision."""
        return None if self.bucket.decision is None else self.bucket.decision.peak_bytes + self.margin

    @property
    def layers(self) -> list[tuple[str, torch.nn.Module]]:
        """The decoder layers in forward order, with their names."""
        out = [(name, ref()) for name, ref in self._layer_refs]
        return [(name, m) for name, m in out if m is not None]

    # -- per layer call -----------------------------------------------------------------------------------------

    def before_layer(self, scope: Any, layer: torch.nn.Module, args: tuple, kwargs: dict,
                     run: Callable[..., Any]) -> Optional[contextlib.AbstractContextManager]:
        """Called before a decoder layer's forward call in `scope` (not its recompute). Returns a context for the
        caller to run the layer's call in (a calibration step's watch for collectives, on several ranks), or None."""
        i = self.index.get(id(layer))
        x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        if i is None or not isinstance(x, torch.Tensor) or scope.layer_tracker.current is not None:
            return None
        if self.memory is None:
            self._bind_device(x.device)
        if i == 0:
            if self._step is not None and self._step["hooks"] > 0 and "t1" not in self._step:
                self._another_forward(scope, _shape(layer, x, args, kwargs))  # one step, two graphs
            else:
                self._new_step(scope, x, _shape(layer, x, args, kwargs))
            if x.requires_grad:  # the step's measurements end when backward has passed every forward's first layer
                self._step["hooks"] += 1
                x.register_hook(self._first_layer_backward_done)
            else:
                log_once("auto-no-grad-input", logging.INFO,
                         "hsoffload: policy auto: the first decoder layer's input does not require grad (frozen "
                         "embeddings, LoRA without enable_input_require_grads): a step's peak and time are read "
                         "when the next one starts, and include the optimizer's step")
        calibrating = self._step is not None and not self._step["decided"]
        watch = None
        if calibrating:
            self._time_previous_layer(i)
            if self._step["probe"]:
                self._maybe_probe(layer, i, x, args, kwargs, run)
                self.bucket.probe_shape = self._step["shape"]
            elif self.ranks is not None and self.ranks.size > 1 and _signature(layer) not in self.collectives:
                watch = _Collectives(self.collectives, _signature(layer))
            meter: Optional[_PhaseMeter] = self._step["meter"]
            if meter is not None:
                if i > 0 and x.requires_grad:
                    x.register_hook(meter.backward_ended(i))
                meter.layer_started(i)
            self.bucket.held_keep[i] = x.numel() * x.element_size()
            self.bucket.forward_shape = self._step["shape"]
            self.memory.synchronize_compute()
            self._layer_t0 = (i, time.perf_counter())
        return watch

    def after_layer(self, layer: torch.nn.Module, out: Any) -> None:
        """Called after a decoder layer's forward call (not its recompute): a calibration step hooks the last
        layer's output, whose gradient starts backward's first layer (the phases' meter)."""
        step = self._step
        if step is None or step["meter"] is None or step.get("output_hooked"):
            return
        if self.index.get(id(layer)) != len(self._layer_refs) - 1:
            return
        t = _first_tensor(out)
        if t is not None and t.requires_grad:
            step["output_hooked"] = True
            step["meter"].last_layer_ended()
            t.register_hook(step["meter"].head_ended)

    def _bind_device(self, device: torch.device) -> None:
        self.memory = DeviceMemory(device)
        self.ranks = Ranks(device)
        if self.ranks.size > 1:
            log_once("auto-ranks", logging.INFO, "hsoffload: policy auto: %d ranks agree on every decision (the "
                     "largest costs, the smallest room) and apply it from the same step", self.ranks.size)
        if self.memory.allocated() is None or self.memory.peak() is None:
            raise RuntimeError(f"hsoffload: policy auto measures the device's allocator, and {device} gives no "
                               "memory_allocated / max_memory_allocated: use another policy there")
        if self.budget is None:
            total = self.memory.total()
            if total is None:
                raise RuntimeError(f"hsoffload: policy auto needs device_budget on {device} (its memory size is "
                                   "unknown): pass device_budget=<bytes>, e.g. '70GiB'")
            self.budget = int(total * BUDGET_FRACTION)
            logger.info("hsoffload: policy auto: device_budget %.2f GiB = %.0f%% of %s's %.2f GiB",
                        self.budget / 2**30, BUDGET_FRACTION * 100, device, total / 2**30)

    def _time_previous_layer(self, i: int) -> None:
        if self._layer_t0 is not None and self._layer_t0[0] == i - 1:
            self.memory.synchronize_compute()
            self.bucket.forward_s[i - 1] = time.perf_counter() - self._layer_t0[1]
        self._layer_t0 = None

    # -- steps ----------------------------------------------------------------------------------------------------

    def offloads_none(self) -> bool:
        """The layers run now offload nothing (a decision of only none and keep)."""
        return not {Choice.OFFLOAD, Choice.SAC} & set(self.choices())

    def _another_forward(self, scope: Any, shape: Shape) -> None:
        """A forward whose first layer runs before the previous forward's backward reached it (two losses, one
        backward): each holds what its choices keep. A decision is never changed between the forwards of one step:
        a forward beyond those the decision was made for, or of a shape its bucket does not cover, runs the leanest
        choice the ranks can run apart (one process: every layer offloaded; several: the decision's `none` layers
        stay, every other layer offloads, so that every rank recomputes the same layers), and the next micro-batch
        decides for the forwards seen (on every rank: the wish and the count are agreed there)."""
        assert self._step is not None
        self._step["forwards"] += 1
        if self._step["meter"] is not None:
            self._step["meter"].on = False  # phases are measured with one forward
        if self._step["forwards"] > self.forwards:
            self.forwards = self._step["forwards"]
            log_once("auto-forwards", logging.INFO, "hsoffload: policy auto: %d forwards before one backward: each "
                     "holds what the decision keeps, and the decisions count them", self.forwards)
        step_bucket: Bucket = self._step["bucket"]
        larger = not step_bucket.shape.covers(bucket_of(shape))
        if larger:
            log_once("auto-forward-shape", logging.INFO, "hsoffload: policy auto: a later forward of one step has a "
                     "larger shape (%s) than its first (%s): it runs every checkpointed layer offloaded",
                     shape.key(), step_bucket.shape.key())
        if (self._step["forwards"] <= self._step["planned_forwards"] and not larger) or self._step["unplanned"]:
            return
        self._step["unplanned"] = True
        if self._step["decided"]:
            if not larger:
                self._urgent = f"{self.forwards} forwards before one backward"
                logger.info("hsoffload: policy auto: forward %d of a step whose decision was made for %d: it runs "
                            "every checkpointed layer offloaded, and the next micro-batch decides for %d",
                            self._step["forwards"], self._step["planned_forwards"], self.forwards)
            self._apply(scope)

    def _first_layer_backward_done(self, grad: torch.Tensor) -> None:
        """The gradient of a forward's first layer input: once every forward's has come, every layer's backward ran.
        The step's forward-and-backward peak and time are read here, before the embedding's gradient and the
        optimizer's step (their peak is read at the optimizer's step: `at_optimizer_step`)."""
        step = self._step
        if step is None or "t1" in step:
            return
        step["hooks"] -= 1
        if step["hooks"] > 0:
            return
        self._mark(step, "t1")
        step["peak"] = self.memory.peak()
        step["reserved"] = self.memory.reserved_peak()
        meter: Optional[_PhaseMeter] = step["meter"]
        if meter is not None and meter.on and meter.head is not None:
            meter.backward_ended(0)(grad)  # read, not reset: the rest of the step is the tail's
            step["peak"] = max(int(step["peak"] or 0), meter.largest())
            if meter.reserved is not None:
                step["reserved"] = max(int(step["reserved"] or 0), meter.reserved)

    def at_optimizer_step(self) -> None:
        """An optimizer holding this model's parameters stepped: the step's whole peak (the embedding's gradient and
        the optimizer's step included) is read now."""
        step = self._step
        if step is not None and "t1" in step and self.memory is not None:
            step["whole"] = self.memory.peak()

    def _new_step(self, scope: Any, x: torch.Tensor, shape: Shape) -> None:
        """A micro-batch starts: the last one is recorded; it runs in its shape's bucket (on several ranks, the
        largest of the ranks' buckets), calibrating where the bucket is not measured yet and with the bucket's
        decision otherwise. A bucket's first decision is made once it is calibrated; a decision made again (a
        measurement changed) waits for an optimizer step's first micro-batch (micro-batches of one step share a
        decision) unless the running one no longer fits."""
        assert self.ranks is not None and self.memory is not None
        reason = self._end_step() if self._step is not None else None
        reason, self._pending = reason or self._pending, None
        urgent, self._urgent = self._urgent, None
        start = int(self.memory.allocated() or 0)
        boundary = _optimizer_steps.at_boundary(self)
        # Decisions count what steps start with at the most over the last optimizer step's micro-batches (the later
        # ones start with the gradients the first accumulated).
        if boundary:
            self._cycle_starts = (self._cycle_starts[1], start)
        else:
            self._cycle_starts = (self._cycle_starts[0], max(self._cycle_starts[1], start))
        self.start_bytes = max(self._cycle_starts)
        if not self._state_read:
            self._state_read = True
            self._read_state()
        local = bucket_of(shape)
        mine = self.buckets.get(local)
        if (reason is None and mine is not None and mine.decision is not None and not self.report_only
                and self.start_bytes > mine.decided_start_bytes + 0.01 * self.budget):
            reason = (f"steps now start with {(self.start_bytes - mine.decided_start_bytes) / 2**20:.1f} MiB more "
                      "on the device (the optimizer's states, gradients, or another model)")
        # 0: nothing to decide; 1: a decision is due (at the next optimizer step); 2: at once (a decision no longer
        # fits at what this step starts with, whatever bucket it is for; more forwards than decided for)
        want = 0 if reason is None and urgent is None else 1
        unfit = [b for b in self.buckets.values() if b.decision is not None and b.decision.fits
                 and self._predicted_at(b, start) > self.budget]
        if unfit:
            reason = reason or (f"a decision no longer fits: this step starts with {start / 2**20:.1f} MiB on the "
                                "device")
        if urgent is not None or unfit:
            want = 2
        adopt = self._adopt
        self._adopt = None
        target, adopt_ok = local, adopt is not None and adopt[1]
        if self.ranks.size > 1:  # one collective per micro-batch on every rank: buckets, wishes, the step boundary
            t0 = time.perf_counter()
            target, want_any, boundary, adopt_ok, forwards = self._agree_step(local, want, boundary, adopt)
            self.agree_s.append(time.perf_counter() - t0)
            self.forwards = forwards
            if want_any > want:
                reason = reason or "another rank's measurements changed (its peak, its start bytes or its calibration)"
                want = int(want_any)
        reason = reason or urgent
        if reason is not None:  # a changed measurement, budget or pin: every bucket's decision is made again
            for b in self.buckets.values():
                if b.decision is not None:
                    b.stale = b.stale or reason
        if adopt is not None:
            self._settle_restored(self.buckets[adopt[0]], adopt_ok)
        ended = self.bucket  # the last step's: calibrated by it, it is decided for now (not at its next batch)
        if ended.decision is None and ended.ready(self.calibration_steps):
            self._decide(ended.stale or "calibrated")
        self._enter(target, shape)
        b = self.bucket
        if b.ready(self.calibration_steps):
            if b.decision is None:
                self._decide(b.stale or "calibrated")
            elif b.decided_forwards < self.forwards:
                self._decide(b.stale or f"{self.forwards} forwards before one backward")
            elif b.stale is not None and (boundary or want == 2):
                self._decide(b.stale)
        decided = b.decision is not None
        # Measured steps (the device's peak counter reset at their start): calibration, a decision's first step in
        # its bucket. Other steps leave the counter alone, so that an outer reader (the Trainer's memory metrics, a
        # user's max_memory_allocated) sees their peaks too; they are verified by the counter's running maximum.
        measured = not decided or b.measured_decision != b.decision_index
        # The reserved peak must be the lean step's or the decision's own, not a cache an earlier step left (the
        # probe's, or a decision that held more): the last calibration step and a decision's first step start with
        # the allocator's cache given back.
        fresh = (b.decision_index, decided, b.calibrated)
        if (decided or b.calibrated == self.calibration_steps - 1) and fresh != b.fresh:
            b.fresh = fresh
            self.memory.empty_cache()
        watched = self.ranks.size == 1 or all(_signature(m) in self.collectives for _, m in self.layers)
        self._step = {"shape": shape, "bucket": b, "decided": decided,
                      "probe": not decided and not b.probes and watched,
                      "decision": b.decision, "hooks": 0, "forwards": 1,
                      "meter": None if decided else _PhaseMeter(self.memory, len(self._layer_refs)),
                      "planned_forwards": b.decided_forwards if decided else self.forwards,
                      "unplanned": False, "start": start, "measured": measured,
                      "predicted": self.predicted_peak, "index": b.decision_index, "budget": self.budget}
        self._apply(scope)
        if measured:
            b.measured_decision = b.decision_index
            self.memory.reset_peak()
        self._step["counter0"] = 0 if measured else int(self.memory.peak() or 0)
        self._step["reserved0"] = 0 if measured else int(self.memory.reserved_peak() or 0)
        self._mark(self._step, "t0")

    def _predicted_at(self, bucket: Bucket, start: int) -> int:
        """`bucket`'s decision's predicted peak for a step that starts with `start` bytes (the margin and the
        allocator's gap included)."""
        assert bucket.decision is not None
        return bucket.decision.peak_bytes + self.margin + self.allocator_gap + start - bucket.decided_start_bytes

    def _enter(self, target: Shape, shape: Shape) -> None:
        """Run the coming step in bucket `target` (made, or taken from the restored file, at first use)."""
        b = self.buckets.get(target)
        if b is None:
            b = Bucket(target)
            restored = self._restored.pop(target.key(), None)
            if restored is not None:
                b.restored = restored
            self.buckets[target] = b
            if len(self.buckets) > 1 or target != shape:
                logger.info("hsoffload: policy auto: a batch of shape %dx%d%s: calibrating for its bucket, up to "
                            "%dx%d (%d calibrating steps)", shape.batch, shape.length,
                            " (quadratic attention)" if shape.quadratic else "", target.batch, target.length,
                            self.calibration_steps)
        self.bucket = b

    def _agree_step(self, local: Shape, want: int, boundary: bool,
                    adopt: Optional[tuple[Shape, bool]]) -> tuple[Shape, int, bool, bool, int]:
        """The ranks' one collective per micro-batch (at its first layer): the bucket (the largest batch, length
        and attention of the ranks'), the strongest wish to decide (0 none, 1 due, 2 the running decision no longer
        fits), whether every rank is at an optimizer step's first micro-batch, and whether every rank's check of a
        restored bucket passed. Raises on every rank if their models or controller states differ (their next
        collectives would not match: a hang)."""
        assert self.ranks is not None
        state = zlib.crc32(repr(([n for n, _ in self.layers], sorted(
            (k.key(), b.calibrated, b.decision is not None, b.stale is not None, len(b.probes))
            for k, b in self.buckets.items()),
            self.decisions, adopt[0].key() if adopt else None)).encode())
        failed = 1.0 if adopt is not None and not adopt[1] else 0.0
        agreed, same = self.ranks.max_and_same(
            [local.batch, local.length, 1.0 if local.quadratic else 0.0, want, 0.0 if boundary else 1.0, failed,
             self.forwards], [state])
        if not same:
            raise RuntimeError("hsoffload: policy auto: the ranks' models or auto states differ (decoder layers, the "
                               "buckets calibrated, calibration steps, decisions or probes): every rank must run the "
                               "same model through the same steps, forward and backward, for one decision to hold")
        target = agreed_bucket(agreed[:3])
        return target, int(agreed[3]), agreed[4] == 0, agreed[5] == 0, int(agreed[6])

    def _mark(self, step: dict[str, Any], key: str) -> None:
        """A time stamp of `step`: in a decided step an event on the compute stream where the device's events time
        (nothing waits: a decided step's time is only verified), else the host clock after a synchronize
        (calibration: its times are what decisions are made of)."""
        assert self.memory is not None
        event = self.memory.timing_event() if step["decided"] else None
        step[key] = event if event is not None else self._sync_time()

    @staticmethod
    def _elapsed(t0: Any, t1: Any) -> float:
        if isinstance(t0, float) and isinstance(t1, float):
            return t1 - t0
        if isinstance(t0, float) or isinstance(t1, float):  # one stamp of each kind: cannot be compared
            return float("nan")
        t1.synchronize()  # waits for the step's own work only (the next step's is queued behind it)
        return t0.elapsed_time(t1) / 1e3

    def _sync_time(self) -> float:
        self.memory.synchronize()
        return time.perf_counter()

    def _end_step(self) -> Optional[str]:
        """Records the step that ended; returns why to decide again (None: the decision stands)."""
        step = self._step
        assert step is not None and self.memory is not None
        b: Bucket = step["bucket"]
        if not step["decided"] and self._layer_t0 is not None:
            self._layer_t0 = None  # the last layer's forward: measured as the others' mean below
        self._step = None
        if "t1" not in step:
            if step["hooks"] > 0:  # no backward reached the first layer (a forward only, or another graph): not a step
                return None
            self._mark(step, "t1")  # no hook possible: up to this step's start
            step["peak"] = self.memory.peak()
            step["reserved"] = self.memory.reserved_peak()
        peak, reserved = step["peak"], step.get("reserved")
        whole = step.get("whole", peak)  # with the optimizer's step, where a torch optimizer stepped
        if peak is None:
            return None
        whole = max(whole, peak)
        self.peak_read = max(self.peak_read, whole)
        if step["measured"] and "whole" in step:  # the rest of the step (the optimizer's), where it passed the rest
            self.tail_increase = whole - step["start"] if whole > peak else 0
        measured_s = self._elapsed(step["t0"], step["t1"])
        decision: Optional[Decision] = step["decision"]
        predicted = step["predicted"] + step["start"] - b.decided_start_bytes if decision else None
        if not step["decided"]:
            self.history.append(StepRecord(step["shape"].tokens, False, None, whole, None, measured_s, 0, reserved))
            return self._calibrated(b, step, peak, measured_s, reserved)
        # A measured step's counter was reset at its start: `whole` is its own peak. Another step's counter runs on
        # from earlier steps (and what the program allocated between them): a reading above the one at the step's
        # start was reached inside the step, and is its peak; one that did not rise says only that the step stayed
        # under an earlier peak (recorded as None).
        own = whole if step["measured"] or whole > step["counter0"] else None
        self.history.append(StepRecord(step["shape"].tokens, True, predicted, own, decision.step_s if decision else
                                       None, measured_s, step["index"], reserved))
        if decision is None or step["unplanned"]:  # more forwards than decided for: decided again, not verified
            return None
        self.decided_steps += 1
        budget = step["budget"]  # the budget the step ran under (the user's may have changed since: a new budget
        # is the next decision's, never held against a step of the last one)
        expected = max(predicted, step["start"] + self.tail_increase)
        if self.decided_steps == 1 or (own is not None and own > expected):
            logger.info("hsoffload: policy auto: step measured %s peak (predicted %.1f, budget %.1f), %.1f ms "
                        "(predicted %.1f)", "an earlier" if own is None else f"{own / 2**20:.1f} MiB",
                        expected / 2**20, budget / 2**20, measured_s * 1e3, decision.step_s * 1e3)
        over = 0
        if own is not None and own > expected:
            over = own - expected
            self.margin += over
            if predicted + over + self.allocator_gap > budget:
                self.replans += 1
                return f"the measured peak {own / 2**20:.1f} MiB passed the prediction by {over / 2**20:.1f} MiB"
        if not step["measured"] and reserved is not None and reserved <= step["reserved0"]:
            reserved = None  # reached before this step (or between steps): not this step's
        if reserved is not None and reserved - budget > over and decision.fits:
            # What the allocator reserved passed the budget by more than the lent bytes' overshoot (now in the
            # margin): fragmentation beyond the gap measured; the gap grows by the rest and the decision is made again
            over = reserved - budget - over
            self.allocator_gap += over
            self.replans += 1
            return (f"the allocator reserved {reserved / 2**20:.1f} MiB, {over / 2**20:.1f} MiB over the budget "
                    "(its cache and fragmentation)")
        return self._verify_sac(decision, step["index"], measured_s)

    def _calibrated(self, b: Bucket, step: dict[str, Any], peak: int, measured_s: float,
                    reserved: Optional[int]) -> Optional[str]:
        """A calibration step of bucket `b` ended: its lean increase and time, scaled up to the bucket's top from
        the shape it ran at (bytes that grow with the length counted as growing with its square where attention is
        quadratic, times linearly). The lean increase is the most of the bucket's calibration steps without a probe
        (the probe's step holds the probe's own tensors for a while), or the probe's step's where it is the only one."""
        act, linear = b.shape.factors(step["shape"])
        b.calibrated += 1
        forwards = step["forwards"]
        increase = math.ceil((peak - step["start"]) * act)
        probed = bool(step["probe"])
        if probed:
            b.probe_step_increase = increase
        if b.lean_increase is None or (b.lean_probed and not probed):
            b.lean_increase, b.lean_forwards, b.lean_probed = increase, forwards, probed
        elif probed == b.lean_probed:
            top = max(forwards, b.lean_forwards)
            b.lean_increase = max(math.ceil(increase * top / forwards),
                                  math.ceil(b.lean_increase * top / b.lean_forwards))
            b.lean_forwards = top
        self._calibrated_phases(b, step, act, linear, self.sac_window - 1)
        if b.lean_step_s is None or not probed:  # a step without the probe's work, where there is one
            b.lean_step_s = measured_s * linear
        if reserved is not None:  # only grows (a decided step's overshoot may have grown it)
            self.allocator_gap = max(self.allocator_gap, reserved - peak)
        if b.restored is not None:
            self._adopt = (b.shape, self._matches_restored(b))
        return None  # the bucket decides when a batch of it next comes (other buckets' decisions stand)

    @staticmethod
    def _calibrated_phases(b: Bucket, step: dict[str, Any], act: float, linear: float, depth: int) -> None:
        """A calibration step's peak by phase, above its start and scaled like its increase (only what grew is
        scaled up), into `b.phases`: the most per phase of the steps without a probe (the probe's where it is the
        only one)."""
        meter: Optional[_PhaseMeter] = step["meter"]
        if meter is None or not meter.complete():
            return
        start, n = step["start"], meter.layers

        def up(nbytes: int) -> int:
            return math.ceil(nbytes * act) if nbytes > 0 else nbytes

        assert meter.head is not None
        now = Phases(up(meter.head - start), tuple(up(meter.backward[i] - start) for i in range(n)), 0,
                     tuple(up(meter.forward[i] - start) for i in range(n)),
                     tuple(up(meter.forward[i] - meter.forward_start[i]) for i in range(n)),
                     tuple(up(meter.backward[i] - meter.backward_start[i]) for i in range(n)),
                     # each backward phase's restored inputs: the `depth` below it (prefetched at its unpack) and its
                     # own (prefetched at the layer above's; the last layer's is its own phase's work, in the excess)
                     tuple(math.floor(sum(b.held_keep.get(j, 0) for j in range(max(0, i - depth), i))
                                      * linear) for i in range(n)))
        probed = bool(step["probe"])
        if b.phases is None or (b.phases_probed and not probed):
            b.phases, b.phases_probed = now, probed
        elif probed == b.phases_probed:
            b.phases = Phases(*(max(x, y) if isinstance(x, int) else tuple(map(max, x, y))
                                for x, y in zip(dataclasses.astuple(b.phases), dataclasses.astuple(now))))

    def _verify_sac(self, decision: Decision, index: int, measured_s: float) -> Optional[str]:
        """A decision with sac: the median of its first VERIFY_STEPS steps against the prediction. sac's cost is the
        one the model does not see whole (the selective checkpoint's dispatch runs on every op of the layer, in
        forward and recompute; its projections are many small copies): past TIME_SLACK, the excess is learned as sac's
        per layer and the decision made again (sac kept only where it still pays)."""
        if (self.report_only or Choice.SAC not in decision.choices or index != self.decisions
                or not math.isfinite(measured_s)):
            return None
        self.bucket.verify.append(measured_s)
        if len(self.bucket.verify) != VERIFY_STEPS:
            return None
        measured = sorted(self.bucket.verify)[VERIFY_STEPS // 2]
        if measured <= decision.step_s * (1 + TIME_SLACK):
            return None
        sac = [k for k, c in enumerate(decision.choices) if c is Choice.SAC]
        per_layer = (measured - decision.step_s) / len(sac)
        layers = self.layers
        for kind in {_signature(layers[k][1]) for k in sac}:
            self.sac_extra_per_token[kind] = self.sac_extra_per_token.get(kind, 0.0) + per_layer / max(1, self.tokens)
        self.replans += 1
        return (f"its steps with sac measured {measured * 1e3:.1f} ms against {decision.step_s * 1e3:.1f} ms "
                f"predicted: sac's cost learned, {per_layer * 1e3:.1f} ms more per layer")

    # -- the decision ---------------------------------------------------------------------------------------------

    def _decide(self, why: str) -> None:
        """The running bucket's decision, from its measurements scaled up to its top shape (made on every rank at
        once: the costs and rooms agreed)."""
        b = self.bucket
        assert b.lean_increase is not None and b.lean_step_s is not None
        # A layer's forward time: the mean over the layers of its kind (alike layers cost alike, whatever the timer's
        # noise; the decision then lays them out canonically, as the planner does).
        layers = self.layers
        kinds = [_signature(layer) for _, layer in layers]
        by_kind: dict[tuple, list[float]] = {}
        for k, kind in enumerate(kinds):
            if k in b.forward_s:
                by_kind.setdefault(kind, []).append(b.forward_s[k])
        known = [t for ts in by_kind.values() for t in ts]
        mean_fwd = sum(known) / len(known) if known else 0.0
        # At the bucket's top shape: a probe's bytes by the activations' factor (length squared where attention is
        # quadratic), a layer's input and times by the tokens'; each forward in flight holds its own.
        pa, pl = b.shape.factors(b.probe_shape or b.shape)
        _, fl = b.shape.factors(b.forward_shape or b.shape)
        forwards = self.forwards
        costs = []
        for k, ((name, _), kind) in enumerate(zip(layers, kinds)):
            probe = b.probes.get(kind)
            times = by_kind.get(kind)
            fwd = sum(times) / len(times) if times else mean_fwd
            held_none = probe.held_none if probe else NEVER
            costs.append(LayerCost(
                name=name, held_none=held_none if held_none >= NEVER else math.ceil(held_none * pa * forwards),
                held_keep=math.ceil(b.held_keep[k] * fl * forwards) if k in b.held_keep else NEVER,
                forward_s=fwd * fl, backward_s=(probe.backward_s * pl) if probe else 2 * fwd * fl,
                copy_s=(probe.copy_s * pl) if probe else 0.0,
                # per step like held_keep (each forward in flight copies its own); 0 where the layer's checkpoint can
                # no longer take the selective context (restored measurements, a function changed since the probe)
                sac_bytes=math.ceil(probe.sac_bytes * pl * forwards) if probe and self._selective_offered(
                    layers[k][1]) else 0,
                projection_s=(probe.projection_s * pl) if probe else 0.0,
                sac_extra_s=self.sac_extra_per_token.get(kind, 0.0) * b.tokens,
                none_forward=math.ceil(probe.none_forward * pa * forwards) if probe else 0,
                none_backward=math.ceil(probe.none_backward * pa * forwards) if probe else 0))
        lean = [Choice.OFFLOAD] * len(layers)
        lean_depth = self.sac_window - 1  # the configured prefetch depth, the calibration's
        _, lean_s = predict(costs, lean, 0, 0.0, self.sac_window, lean_depth)
        fixed_s = b.lean_step_s - lean_s  # the step without any layer's extra: what the lean step measured, less
        phases = self._lean_phases(b)
        if self.budget_arg is None:
            self._default_budget()
        slack = self.budget - self.margin - self.allocator_gap  # what the decision's predicted peak may reach
        host_room = self._host_room(costs)
        costs, fixed_s, slack, phases, host_room = self._agree(costs, fixed_s, slack, phases, host_room)
        b.costs = costs
        b.decided_start_bytes = self.start_bytes
        # the agreed window: the ranks' deepest configured prefetch (one set of depths everywhere)
        b.decision = choose(costs, slack, phases, fixed_s, self.pins, self.sac_window, host_room,
                            prefetch_depths=prefetch_depths(self.sac_window - 1))
        if self.start_bytes + self.tail_increase > self.budget:
            log_once("auto-tail-over", logging.WARNING, "hsoffload: policy auto: the step after backward (the "
                     "embedding's gradient, the optimizer's step) reached %.1f MiB, over the %.1f MiB budget: no "
                     "choice of the decoder layers brings it under", (self.start_bytes + self.tail_increase) / 2**20,
                     self.budget / 2**20)
        self.decisions += 1
        b.decision_index = self.decisions
        b.decided_forwards = self.forwards
        b.stale = None
        b.reason = why
        self.decision_log.append(f"{''.join(str(c)[0] for c in b.decision.choices)} ({why}; {b.shape.key()})")
        b.verify = []
        self._save()
        logger.info("hsoffload: policy auto, decision %d (%s; bucket %s, %d tokens; margin %.1f MiB)%s:\n%s",
                    self.decisions, why, b.shape.key(), b.tokens, self.margin / 2**20,
                    " REPORT ONLY, every layer offloaded" if self.report_only else "", b.decision.table(costs))

    def _lean_phases(self, b: Bucket) -> Phases:
        """Bucket `b`'s leanest step by phase, for a step that starts with what steps start with now: measured where
        a calibration step with one forward measured every phase and steps run one forward; else one bound for every
        phase (the lean peak, for the forwards steps run)."""
        if b.phases is not None and max(self.forwards, b.lean_forwards) == 1:
            return b.phases.shifted(self.start_bytes)
        lean_peak = self.lean_peak
        assert lean_peak is not None
        return Phases.flat(lean_peak, len(self._layer_refs))

    def _selective_offered(self, layer: torch.nn.Module) -> bool:
        """Whether sac can be applied to `layer` now: its checkpoint is ready, or the selective one is installed."""
        return _selective_ready(layer) is not None or id(layer) in self._checkpoints

    def _host_room(self, costs: list[LayerCost]) -> Optional[int]:
        """The host bytes sac's projections may take per forward: the host budget (max_host_bytes, resolved) less
        what is held now and the inputs every layer may offload; None where the budget is unlimited."""
        from .host import budget_stats  # noqa: PLC0415  (the host budget's owner)

        stats = budget_stats()
        if stats.limit <= 0:
            return None
        inputs = sum(c.held_keep for c in costs if c.held_keep < NEVER)  # every forward's (held_keep counts them)
        return max(0, stats.limit - stats.in_flight - inputs)

    def _default_budget(self) -> None:
        """Without device_budget: the device's memory less what the process holds outside the allocator now (after
        full steps: the CUDA context, communicators' buffers; other processes too) less HEADROOM_FRACTION of it, at
        most BUDGET_FRACTION of it."""
        assert self.memory is not None
        total, outside = self.memory.total(), self.memory.outside_allocator()
        if total is None or outside is None:
            return
        budget = min(int(total * BUDGET_FRACTION), int(total - outside - total * HEADROOM_FRACTION))
        if budget != self.budget:
            logger.info("hsoffload: policy auto: device_budget %.2f GiB: %s's %.2f GiB less %.2f GiB held outside the "
                        "allocator and %.0f%% headroom (at most %.0f%%)", budget / 2**30, self.memory.device,
                        total / 2**30, outside / 2**30, HEADROOM_FRACTION * 100, BUDGET_FRACTION * 100)
            self.budget = budget

    # -- kept across restarts (auto_state_path) -----------------------------------------------------------------

    def state_file(self) -> Optional[str]:
        """This rank's state file: auto_state_path with {rank} replaced (on several ranks without {rank}: the rank
        before the extension, so that ranks never write one file)."""
        if self.state_path is None:
            return None
        rank, size = (self.ranks.rank, self.ranks.size) if self.ranks is not None else (0, 1)
        path = self.state_path
        if "{rank}" in path:
            return path.replace("{rank}", str(rank))
        if size > 1:
            root, ext = os.path.splitext(path)
            return f"{root}.rank{rank}{ext or '.json'}"
        return path

    def _identity(self) -> dict[str, Any]:
        """What a saved file must match to be reused: the model's layers and kinds, and what sets a layer's
        activation bytes beside the shape (attention implementation, parameter and autocast dtypes, the classes
        inside the layers and the model's loss: a fused kernel or loss swaps them), the world, rank, device and the
        torch and transformers releases. The micro-batch and sequence length are the buckets' keys."""
        assert self.ranks is not None and self.memory is not None
        device = self.memory.device
        name = getattr(getattr(torch, device.type, None), "get_device_name", None)
        try:
            device_name = str(name(device)) if name is not None and device.type != "cpu" else device.type
        except RuntimeError:
            device_name = device.type
        layers = self.layers
        inside = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for _, layer in layers
                         for m in layer.modules()})
        dtypes = sorted({str(p.dtype) for _, layer in layers for p in layer.parameters()})
        try:
            autocast = (str(torch.get_autocast_dtype(device.type))
                        if torch.is_autocast_enabled(device.type) else "off")
        except (RuntimeError, TypeError, AttributeError):
            autocast = "unknown"
        model = self._model_ref()
        loss = getattr(model, "loss_function", None) if model is not None else None
        try:
            import transformers  # noqa: PLC0415  (only its version)

            tf_version = transformers.__version__
        except ImportError:
            tf_version = "none"
        return {"version": STATE_VERSION, "layers": [n for n, _ in layers],
                "kinds": [repr(_signature(m)) for _, m in layers], "world": self.ranks.size,
                "rank": self.ranks.rank, "device": device_name,
                "attention": sorted({str(_attention_implementation(m)) for _, m in layers}),
                "dtypes": dtypes, "autocast": autocast, "inside": inside,
                "model": f"{type(model).__module__}.{type(model).__qualname__}" if model is not None else None,
                "loss": getattr(loss, "__qualname__", type(loss).__qualname__) if loss is not None else None,
                "torch": torch.__version__, "transformers": tf_version}

    def _save(self) -> None:
        path = self.state_file()
        if path is None:
            return
        # The file's buckets this run has not measured yet are kept (a resumed run that has seen one length so far
        # must not drop the others'); each bucket this run measured replaces its saved figures.
        buckets: dict[str, Any] = dict(self._restored)
        for shape, b in self.buckets.items():
            if not b.ready(self.calibration_steps):
                if b.restored is not None:
                    buckets[shape.key()] = b.restored
                continue
            kinds = {repr(k): k for k in b.probes}
            buckets[shape.key()] = {
                "calibrated": b.calibrated, "probe_shape": b.probe_shape.key() if b.probe_shape else None,
                "forward_shape": b.forward_shape.key() if b.forward_shape else None,
                "lean_increase": b.lean_increase, "lean_forwards": b.lean_forwards, "lean_probed": b.lean_probed,
                "probe_step_increase": b.probe_step_increase, "lean_step_s": b.lean_step_s,
                "phases": dataclasses.asdict(b.phases) if b.phases is not None else None,
                "phases_probed": b.phases_probed,
                "forward_s": {str(k): v for k, v in b.forward_s.items()},
                "held_keep": {str(k): v for k, v in b.held_keep.items()},
                "probes": {r: dataclasses.asdict(b.probes[k]) for r, k in kinds.items()},
                "choices": [c.value for c in b.decision.choices] if b.decision else None}
        state = {**self._identity(), "forwards": self.forwards, "margin": self.margin,
                 "allocator_gap": self.allocator_gap, "tail_increase": self.tail_increase,
                 "sac_extra_per_token": {repr(k): v for k, v in self.sac_extra_per_token.items()},
                 "decisions": self.decisions, "buckets": buckets}
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # a reader never sees half a file
        except OSError as exc:
            log_once(f"auto-save-{path}", logging.WARNING, "hsoffload: policy auto could not save its measurements "
                     "to %s (%s): a restarted run calibrates again", path, exc)

    def _read_state(self) -> None:
        """At the first step: the saved measurements, if the file's identity matches this run's (on every rank, or
        on none). They are a cache, not the truth: a bucket's first step still runs the leanest choice with its
        probes, and the saved figures are used only where that step measures what they say (`_matches_restored`)."""
        assert self.ranks is not None
        path = self.state_file()
        if path is None or not self.restore_state:
            return
        state: Optional[dict[str, Any]] = None
        why = ""
        try:
            with open(path) as f:
                state = json.load(f)
        except FileNotFoundError:
            why = "no file yet"
        except (OSError, ValueError) as exc:
            why = f"unreadable: {exc}"
        if state is not None:
            expected = self._identity()
            differ = [k for k in expected if state.get(k) != expected[k]]
            if differ:
                why = "it was saved for another " + ", ".join(
                    f"{k} ({state.get(k)!r}, here {expected[k]!r})" if k not in ("layers", "kinds", "inside") else k
                    for k in differ)
                state = None
        if state is not None and not all(k in state for k in ("buckets", "forwards", "margin")):
            why, state = "unreadable: it lacks the buckets, forwards or margin", None
        ok = state is not None
        if self.ranks.size > 1:  # every rank reuses a file saved at the same decision, or none does
            saved = zlib.crc32(repr([state.get("decisions"), sorted(state.get("buckets", {}))]).encode()) if ok else 0
            (low,), same = self.ranks.min_and_same([1.0 if ok else 0.0], [saved])
            ok = low > 0 and same
            if not ok and state is not None:
                why = "another rank has no matching file, or one saved at another decision"
        if not ok:
            logger.info("hsoffload: policy auto: calibrating (%s not reused: %s)", path, why)
            return
        assert state is not None
        kinds = {repr(_signature(m)): _signature(m) for _, m in self.layers}
        self.forwards = max(self.forwards, int(state["forwards"]))
        self.margin = max(self.margin, int(state["margin"]))
        self.allocator_gap = max(self.allocator_gap, int(state.get("allocator_gap", 0)))
        self.sac_extra_per_token = {kinds[r]: float(v) for r, v in state.get("sac_extra_per_token", {}).items()
                                    if r in kinds}
        self._restored = dict(state["buckets"])
        self.restored = path
        logger.info("hsoffload: policy auto: measurements of %d bucket(s) read from %s: each is checked by one step "
                    "with every layer offloaded before its decision is made from them", len(self._restored), path)

    def _matches_restored(self, b: Bucket) -> bool:
        """Whether bucket `b`'s first step (every layer offloaded, probed) measured what its saved figures say: the
        probe step's increase and every probe's bytes within RESTORE_TOLERANCE (a layer that now saves more, a
        kernel the identity cannot see, another machine's allocator: measured again instead)."""
        saved = b.restored
        assert saved is not None

        def near(now: float, then: float) -> bool:
            return abs(now - then) <= RESTORE_TOLERANCE * max(abs(then), 1.0)

        kinds = {repr(k): p for k, p in b.probes.items()}
        why = ""
        if saved.get("probe_step_increase") is None or not near(b.probe_step_increase or 0,
                                                                 saved["probe_step_increase"]):
            why = (f"the lean step's increase {(b.probe_step_increase or 0) / 2**20:.2f} MiB, saved "
                   f"{(saved.get('probe_step_increase') or 0) / 2**20:.2f}")
        elif set(kinds) != set(saved["probes"]):
            why = "other layer kinds were probed"
        else:
            for r, p in kinds.items():
                then = saved["probes"][r]
                if not (near(p.held_none, then["held_none"]) and near(p.sac_bytes, then["sac_bytes"])):
                    why = (f"a layer without checkpointing holds {p.held_none / 2**20:.2f} MiB, saved "
                           f"{then['held_none'] / 2**20:.2f}")
                    break
        if why:
            logger.info("hsoffload: policy auto: the saved measurements of bucket %s are not reused (%s): "
                        "calibrating", b.shape.key(), why)
        return not why

    def _settle_restored(self, b: Bucket, ok: bool) -> None:
        """Apply bucket `b`'s saved figures where every rank's check passed (each byte figure the larger of the saved
        and the measured one), or calibrate it on."""
        saved, b.restored = b.restored, None
        if not ok or saved is None:
            return
        kinds = {repr(k): k for k in b.probes}
        measured = b.probe_step_increase or 0
        grown = max(0, measured - int(saved["probe_step_increase"]))  # what the check measured beyond the file
        b.lean_increase = int(saved["lean_increase"]) + grown
        phases = saved.get("phases")
        if phases and len(phases["backward"]) == len(self._layer_refs):
            b.phases = Phases(**{k: v if isinstance(v, int) else tuple(v) for k, v in phases.items()}).shifted(grown)
            b.phases_probed = bool(saved.get("phases_probed", True))
        b.lean_forwards, b.lean_probed = int(saved["lean_forwards"]), bool(saved["lean_probed"])
        b.lean_step_s = float(saved["lean_step_s"])
        b.probe_shape = Shape.parse(saved["probe_shape"]) if saved.get("probe_shape") else b.probe_shape
        b.forward_shape = Shape.parse(saved["forward_shape"]) if saved.get("forward_shape") else b.forward_shape
        b.forward_s = {int(k): float(v) for k, v in saved["forward_s"].items()}
        b.held_keep = {int(k): max(int(v), b.held_keep.get(int(k), 0)) for k, v in saved["held_keep"].items()}
        for r, p in saved["probes"].items():
            now = b.probes[kinds[r]]
            b.probes[kinds[r]] = dataclasses.replace(
                _Probe(**p), held_none=max(int(p["held_none"]), now.held_none),
                sac_bytes=max(int(p["sac_bytes"]), now.sac_bytes))
        b.calibrated = max(b.calibrated, self.calibration_steps)
        b.stale = f"measurements read from {self.restored}"
        logger.info("hsoffload: policy auto: bucket %s's first step measured what %s says: its saved measurements "
                    "are used", b.shape.key(), self.restored)

    def request(self, why: str) -> None:
        """Decide again (after calibration) for what the user changed (a budget, pins): at once in one process; on
        several ranks at the next micro-batch's start, where the wish is agreed and every rank marks the same
        decisions to be made again (a rank marking its own alone would decide, and all-reduce, alone: a hang)."""
        if self.ranks is None or self.ranks.size > 1:
            self._pending = why
            return
        for b in self.buckets.values():
            if b.decision is not None:
                b.stale = b.stale or why
        if self.bucket.ready(self.calibration_steps):
            self._decide(why)

    def _agree(self, costs: list[LayerCost], fixed_s: float, slack: int, phases: Phases, host_room: Optional[int]
               ) -> tuple[list[LayerCost], float, int, Phases, Optional[int]]:
        """On several ranks: each layer's largest cost over the ranks, the longest fixed time, each phase's largest
        lean peak and the smallest budgets (the device's, the host's), so that the deterministic chooser makes one
        decision everywhere. Raises on every rank if the ranks' models or pins differ (a decision for different
        layers cannot be one)."""
        assert self.ranks is not None
        if self.ranks.size == 1:
            return costs, fixed_s, slack, phases, host_room
        fields = ("held_none", "held_keep", "forward_s", "backward_s", "copy_s", "sac_bytes", "projection_s",
                  "sac_extra_s", "none_forward", "none_backward")
        pins = zlib.crc32(repr(sorted((k, v.value) for k, v in self.pins.items())).encode())
        shape = zlib.crc32(repr([c.name for c in costs]).encode())
        flat = [float(getattr(c, f)) for c in costs for f in fields]
        unlimited = float(NEVER)
        # sac is offered for a layer only if every rank can apply it (-1 where offered: the max is -1 iff all are)
        offered = [-1.0 if c.sac_offered else 0.0 for c in costs]
        # every rank's phases in one shape (a flat bound where one measured none: its per-layer tuples filled)
        n = len(costs)
        full = dataclasses.replace(phases, layers=phases.layers or (0,) * n,
                                   layer_work=phases.layer_work or (1 << 50,) * n,
                                   backward_work=phases.backward_work or (1 << 50,) * n)
        lean = [float(v) for v in (full.forward, *full.backward, full.after, *full.layers)]
        # the work figures are agreed by their smallest (the excess of a layer without checkpointing: the largest)
        lean += [-float(v) for v in (*full.layer_work, *full.backward_work)]
        lean += [-float(v) for v in (phases.restores or (0,) * n)]  # subtracted: the smallest
        agreed, same = self.ranks.max_and_same(
            flat + offered + lean + [fixed_s, -slack, -(unlimited if host_room is None else host_room),
                                     self.sac_window], [shape, pins])
        at = len(flat) + len(offered)
        lean = [int(v) for v in agreed[at:at + len(lean)]]
        fixed_s, neg_slack, neg_host, window = agreed[at + len(lean):]
        if not same:
            raise RuntimeError("hsoffload: policy auto: the ranks' models have different decoder layers, or "
                               "auto.pin() was given different pins on different ranks; every rank must run the same "
                               "model with the same pins (one decision is applied by all)")
        out = []
        everywhere = agreed[len(flat):len(flat) + len(offered)]
        for k, c in enumerate(costs):
            v = agreed[k * len(fields):(k + 1) * len(fields)]
            on = everywhere[k] < 0
            out.append(dataclasses.replace(c, held_none=int(v[0]), held_keep=int(v[1]), forward_s=v[2],
                                           backward_s=v[3], copy_s=v[4], sac_bytes=int(v[5]) if on else 0,
                                           projection_s=v[6] if on else 0.0, sac_extra_s=v[7],
                                           none_forward=int(v[8]), none_backward=int(v[9])))
        self.sac_window = int(window)  # the deepest prefetch of the ranks: one window for all
        agreed_phases = Phases(lean[0], tuple(lean[1:n + 1]), lean[n + 1], tuple(lean[n + 2:2 * n + 2]),
                               tuple(-v for v in lean[2 * n + 2:3 * n + 2]), tuple(-v for v in lean[3 * n + 2:4 * n + 2]),
                               tuple(-v for v in lean[4 * n + 2:]))
        return (out, fixed_s, int(-neg_slack), agreed_phases, None if -neg_host >= unlimited else int(-neg_host))

    def report(self) -> str:
        """The last decision made (whichever bucket it is for): why, and its table (empty before the first)."""
        b = max(self.buckets.values(), key=lambda x: x.decision_index, default=None)
        if b is None or b.decision is None:
            return ""
        return (f"policy auto, decision {b.decision_index} ({b.reason}; bucket {b.shape.key()}, {b.tokens} tokens)"
                f"{' REPORT ONLY, every layer offloaded' if self.report_only else ''}:\n"
                f"{b.decision.table(b.costs)}")

    def log_values(self) -> dict[str, float]:
        """Numbers for a trainer's logs (`hsoffload/auto_*`): the layers per choice run now, the decisions made, the
        budget, and the last decided step's predicted and measured peak (GiB) and time (ms) (the last whose own peak
        is known: a step whose peak counter did not rise above an earlier step's has none)."""
        gib = float(1 << 30)
        values: dict[str, float] = {f"auto_{c.value}_layers": 0.0 for c in Choice}
        for c in self.choices():
            values[f"auto_{c.value}_layers"] += 1
        values["auto_decisions"] = float(self.decisions)
        values["auto_fits"] = float(self.bucket.decision is not None and self.bucket.decision.fits)
        values["auto_budget_gib"] = (self.budget or 0) / gib
        values["auto_prefetch_depth"] = float(self.prefetch_depth())
        values["auto_buckets"] = float(len(self.buckets))
        if self.agree_s:  # the ranks' agreement per micro-batch: the host's median wait
            values["auto_agree_ms"] = sorted(self.agree_s)[len(self.agree_s) // 2] * 1e3
        # the largest whole-step peak auto read (auto resets the device's peak counter at the steps it measures)
        values["auto_peak_read_gib"] = self.peak_read / gib
        last = next((r for r in reversed(self.history) if r.decided and r.measured_peak_bytes is not None), None)
        if last is not None:
            values["auto_predicted_peak_gib"] = (last.predicted_peak_bytes or 0) / gib
            values["auto_measured_peak_gib"] = (last.measured_peak_bytes or 0) / gib
            values["auto_predicted_step_ms"] = (last.predicted_step_s or 0.0) * 1e3
            values["auto_measured_step_ms"] = last.measured_step_s * 1e3
        return values

    def choices(self) -> list[Choice]:
        """What each layer runs with now."""
        if self.bucket.decision is None or self.report_only:
            return [Choice.OFFLOAD] * len(self.layers)  # calibration (the lean baseline), or report only
        if self._step is not None and self._step["unplanned"]:
            # a forward beyond those the decision was made for: the leanest the ranks can run apart
            if self.ranks is not None and self.ranks.size > 1:
                return [c if c is Choice.NONE else Choice.OFFLOAD for c in self.bucket.decision.choices]
            return [Choice.OFFLOAD] * len(self.layers)
        return list(self.bucket.decision.choices)

    def prefetch_depth(self) -> int:
        """The prefetch depth run now: the decision's, or the configured one (calibration, report only)."""
        if self.bucket.decision is None or self.report_only or self.bucket.decision.prefetch_depth is None:
            return self.sac_window - 1
        return self.bucket.decision.prefetch_depth

    def _apply(self, scope: Any) -> None:
        tracker = scope.layer_tracker
        scope.set_prefetch_depth(self.prefetch_depth())
        for (name, layer), choice in zip(self.layers, self.choices()):
            if id(layer) not in self._flags:
                self._flags[id(layer)] = bool(getattr(layer, "gradient_checkpointing", False))
            layer.gradient_checkpointing = choice is not Choice.NONE
            self._set_selective(layer, choice is Choice.SAC)
            stats = tracker.layers.get(name)
            if stats is not None:
                stats.selected = choice in (Choice.OFFLOAD, Choice.SAC)

    def _set_selective(self, layer: torch.nn.Module, on: bool) -> None:
        """Give a `sac` layer's checkpoint the selective context (SAC_CONTEXT), or its own function back."""
        entry = self._checkpoints.get(id(layer))
        installed = layer.__dict__.get(LAYER_ATTR, _ABSENT)
        if entry is not None:
            if _is_selective(installed):
                entry[1] = installed  # ours, as the patch wrapped it (its SAC memory kept for the next time)
            elif installed is not entry[0]:  # the user set another checkpoint function since: theirs from now on
                del self._checkpoints[id(layer)]
                entry = None
        if not on:
            if entry is not None and _is_selective(installed):
                if entry[0] is _ABSENT:
                    del layer.__dict__[LAYER_ATTR]
                else:
                    layer.__dict__[LAYER_ATTR] = entry[0]
            return
        if entry is None:
            func = _selective_ready(layer)
            if func is None:  # the decision offers sac only where the probe found it ready
                raise RuntimeError(f"hsoffload: policy auto chose sac for {type(layer).__name__}, whose checkpoint "
                                   "function changed since it was probed (it is no longer torch's non-reentrant "
                                   "checkpoint without a context_fn): call auto.pin() with keep or offload for it")
            entry = [installed, functools.partial(func.func, *func.args, **{**func.keywords,
                                                                             "context_fn": SAC_CONTEXT})]
            self._checkpoints[id(layer)] = entry
        layer.__dict__[LAYER_ATTR] = entry[1]

    def restore(self) -> None:
        """Give every layer back the gradient_checkpointing flag and the checkpoint function it had (the scope
        exits)."""
        for _, layer in self.layers:
            if id(layer) in self._flags:
                layer.gradient_checkpointing = self._flags.pop(id(layer))
            if id(layer) in self._checkpoints:
                self._set_selective(layer, False)

    # -- the probe ------------------------------------------------------------------------------------------------

    def _maybe_probe(self, layer: torch.nn.Module, i: int, x: torch.Tensor, args: tuple, kwargs: dict,
                     run: Callable[..., Any]) -> None:
        sig = _signature(layer)
        if sig in self.bucket.probes:
            return
        nbytes = x.numel() * x.element_size()
        allocated = self.memory.allocated()
        fits = allocated is None or allocated + PROBE_GUESS * nbytes <= self.budget
        sharded = _sharded(layer)
        collective = self.collectives.get(sig, False)
        assert self.ranks is not None
        if self.ranks.size > 1:  # every rank probes the same layers, or none does
            fits, unsharded, quiet = (v > 0 for v in self.ranks.min(
                [1.0 if fits else 0.0, 0.0 if sharded else 1.0, 0.0 if collective else 1.0]))
            sharded, collective = not unsharded, not quiet
        if collective and not sharded:
            log_once("auto-collectives", logging.INFO, "hsoffload: policy auto: %s issues collectives in its forward "
                     "(sequence parallelism's all-to-alls): it is not probed without checkpointing (a probe failing on "
                     "one rank between two collectives would leave the others waiting), so it stays checkpointed",
                     type(layer).__name__)
        if sharded:
            log_once("auto-sharded", logging.INFO, "hsoffload: policy auto: the decoder layers' parameters are sharded "
                     "(FSDP, DeepSpeed ZeRO-3): a layer is not probed without checkpointing (its forward and backward "
                     "would gather the shards and reduce gradients outside the step), so every layer stays "
                     "checkpointed and auto chooses between keeping and offloading its input")
        elif not fits:
            logger.info("hsoffload: policy auto: %s is not probed without checkpointing (it might not fit the budget): "
                        "it stays checkpointed", self.layers[i][0])
        if sharded or collective or not fits:
            self.bucket.probes[sig] = _Probe(NEVER, 0.0, self._copy_s(x))
            return
        out_of_memory = False
        probe: Optional[_Probe] = None
        try:
            probe = self._probe(layer, x, args, kwargs, run)
        except torch.OutOfMemoryError:
            out_of_memory = True
        except RuntimeError as exc:  # other backends raise a plain RuntimeError
            if "out of memory" not in str(exc).lower():
                raise
            out_of_memory = True
        ran = not out_of_memory
        if self.ranks.size > 1:  # the outcome agreed before any rank goes on: probed everywhere, or nowhere
            ran = self.ranks.min([1.0 if ran else 0.0])[0] > 0
        if not ran or probe is None:  # outside the handler: the partial forward's tensors are gone with its traceback
            logger.info("hsoffload: policy auto: %s ran out of memory without checkpointing%s: it stays checkpointed",
                        self.layers[i][0], "" if out_of_memory else " on another rank")
            probe = _Probe(NEVER, 0.0, self._copy_s(x))
        self.bucket.probes[sig] = probe

    def _copy_s(self, x: torch.Tensor) -> float:
        return copy_time_s(x, self._sync_time)

    def _probe(self, layer: torch.nn.Module, x: torch.Tensor, args: tuple, kwargs: dict,
               run: Callable[..., Any]) -> _Probe:
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if projections is not None:
                projections.saved()
            if t.device == x.device and t.layout == torch.strided and t.numel() > 0:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in params:
                    saved[ptr] = t.untyped_storage().nbytes()
            return t

        projections = _Projections(self.memory.synchronize_compute) if _selective_ready(layer) is not None else None
        flag = layer.gradient_checkpointing
        layer.gradient_checkpointing = False
        try:
            with _forked_rng(x.device), _no_output_capture(layer), torch.enable_grad():
                probe_x = x.detach().requires_grad_(True)
                probe_args = (probe_x,) + tuple(args[1:]) if args else ()
                probe_kwargs = kwargs if args else {**kwargs, "hidden_states": probe_x}
                meter: Optional[_PhaseMeter] = self._step["meter"] if self._step is not None else None
                if meter is not None:  # the phase in progress: its peak so far kept, the counter the probe's now
                    meter.other = max(meter.other, meter.read())
                s0 = int(self.memory.allocated() or 0)
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), (
                        projections if projections is not None else contextlib.nullcontext()):
                    out = _first_tensor(run(layer, *probe_args, **probe_kwargs))
                if out is None or not out.requires_grad:
                    return _Probe(NEVER, 0.0, self._copy_s(x))
                none_forward = int(self.memory.peak() or 0) - s0
                inputs = [probe_x] + [p for p in layer.parameters() if p.requires_grad]
                t0 = self._sync_time()
                if meter is not None:
                    self.memory.reset_peak()
                torch.autograd.grad(out, inputs, grad_outputs=torch.ones_like(out), allow_unused=True)
                backward_s = self._sync_time() - t0
                none_backward = int(self.memory.peak() or 0) - s0
                del out
                if meter is not None:
                    meter.other = max(meter.other, meter.read())
        finally:
            layer.gradient_checkpointing = flag
        sac_bytes, projection_s = projections.measured() if projections is not None else (0, 0.0)
        return _Probe(sum(saved.values()), backward_s, self._copy_s(x), sac_bytes, projection_s,
                      max(0, none_forward), max(0, none_backward))


def copy_time_s(x: torch.Tensor, sync_time: Callable[[], float], repeats: int = COPY_REPEATS) -> float:
    """One direction of a copy of `x` to pinned host memory and back (the slower), each direction the fastest of
    `repeats` round trips: the link's speed is what the copies can reach; a copy measured while its thread waited
    for a core (a busy host) or behind another process's transfer is slower, never faster."""
    pin = x.device.type != "cpu"
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=pin)
    back = torch.empty_like(x)
    out_s, in_s = math.inf, math.inf
    for _ in range(repeats):
        t0 = sync_time()
        host.copy_(x.detach(), non_blocking=pin)
        t1 = sync_time()
        back.copy_(host, non_blocking=pin)
        t2 = sync_time()
        out_s, in_s = min(out_s, t1 - t0), min(in_s, t2 - t1)
    return max(out_s, in_s)


@contextlib.contextmanager
def _forked_rng(device: torch.device) -> Iterator[None]:
    """The CPU generator, and the device's where its module has one, as they were after the block (the probe's
    dropout must not move the step's)."""
    mod = getattr(torch, device.type, None)
    if device.type != "cpu" and mod is not None and hasattr(mod, "get_rng_state"):
        with torch.random.fork_rng(devices=[device], device_type=device.type):
            yield
    else:
        with torch.random.fork_rng(devices=[]):
            yield


def _is_capture_wrapper(fn: Any) -> bool:
    """transformers 4.5x's `check_model_inputs` output recorder: a function it sets as a module's `forward` for the
    model call, identified by its code object (its own file and name: `functools.wraps` gave it the wrapped
    forward's name), never by an attribute it answers."""
    code = getattr(fn, "__code__", None) if inspect.isfunction(fn) else None
    if code is None or not hasattr(fn, "__wrapped__"):
        return False
    name = getattr(code, "co_qualname", code.co_name)
    return name.endswith("wrapped_forward") and code.co_filename.replace(os.sep, "/").endswith(
        "transformers/utils/generic.py")


@contextlib.contextmanager
def _no_output_capture(layer: torch.nn.Module) -> Iterator[None]:
    """The probe's forward must not add to the model call's collected outputs (a second router-logits entry, a
    graph freed twice, a hidden state more): transformers >= 5 collects through the call's collector (switched off
    here); 4.5x's `check_model_inputs` wraps the forwards of the decoder layer and the modules in it (unwrapped here,
    for `layer`'s modules only, and put back after)."""
    unwrapped = []
    for module in layer.modules():
        fn = module.__dict__.get("forward")
        if fn is not None and _is_capture_wrapper(fn):
            unwrapped.append((module, fn))
            inner = fn.__wrapped__
            for _ in range(8):  # a module recorded for several keys is wrapped once per key
                if not _is_capture_wrapper(inner):
                    break
                inner = inner.__wrapped__
            module.__dict__["forward"] = inner
    try:
        collector = None
        try:
            from transformers.utils import output_capturing

            collector = getattr(output_capturing, "_active_collector", None)
        except ImportError:
            pass
        if collector is None:
            yield
            return
        token = collector.set(None)
        try:
            yield
        finally:
            collector.reset(token)
    finally:
        for module, fn in unwrapped:
            module.__dict__["forward"] = fn


class _OptimizerSteps:
    """Counts, per controller, the steps of optimizers that hold its model's parameters (torch.optim's global step
    post-hook, registered at first use), so that a controller can tell an optimizer step's first micro-batch. The
    hook is process-wide by nature; it runs on the thread that steps the optimizer, the count is read on the one that
    runs forward (the same, in a training loop)."""

    def __init__(self) -> None:
        self._hooked = False

    def _step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for ctl in list(_controllers.values()):
            if any(id(p) in held for _, layer in ctl.layers for p in layer.parameters()):
                ctl.optimizer_steps += 1
                ctl.at_optimizer_step()

    def at_boundary(self, ctl: AutoController) -> bool:
        """Whether `ctl`'s micro-batch starting now is an optimizer step's first: its model's optimizer stepped since
        its last micro-batch, or never did (no torch optimizer holds its parameters, as under DeepSpeed, whose
        optimizer holds copies; or before the first step): then every micro-batch is one."""
        if not self._hooked:
            self._hooked = True
            from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: PLC0415

            register_optimizer_step_post_hook(self._step)
        seen, ctl._optimizer_steps_seen = ctl._optimizer_steps_seen, ctl.optimizer_steps
        return ctl.optimizer_steps == 0 or ctl.optimizer_steps != seen


_optimizer_steps = _OptimizerSteps()

# One controller per model, beside it while it lives (the decision is the model's, across scopes and steps).
_controllers: "weakref.WeakKeyDictionary[torch.nn.Module, AutoController]" = weakref.WeakKeyDictionary()


def controller_for(model: torch.nn.Module, layer_cls: type, config: Any) -> AutoController:
    """The model's controller, made at first use with `config`'s auto options (a later scope with another budget
    sets it)."""
    ctl = _controllers.get(model)
    if ctl is None:
        ctl = AutoController(model, layer_cls, config.device_budget, config.auto_calibration_steps,
                             config.auto_report_only, config.auto_state_path)
        ctl.sac_window = config.prefetch_depth + 1
        _controllers[model] = ctl
    else:
        ctl.report_only = config.auto_report_only
        ctl.calibration_steps = config.auto_calibration_steps
        if config.prefetch_depth + 1 != ctl.sac_window:
            ctl.sac_window = config.prefetch_depth + 1
            ctl.request("prefetch_depth changed")
        if config.auto_state_path is not None:
            ctl.state_path = config.auto_state_path
        if config.device_budget is not None and config.device_budget != ctl.budget_arg:
            ctl.budget_arg = ctl.budget = config.device_budget
            ctl.request("device_budget changed")
    return ctl


def pin(model: torch.nn.Module, pins: dict[str, str]) -> None:
    """Fix some layers' choices (layer name -> "none", "keep", "sac" or "offload"); policy "auto" decides the others. Takes
    effect at the model's next decision (call before its first step, or with its scope's next budget)."""
    ctl = _controllers.get(model)
    if ctl is None:
        raise RuntimeError("hsoffload: pin() needs a model with policy auto: enter "
                           "hsoffload.offload_hidden_states(model, policy='auto', ...) once first")
    names = {n for n, _ in ctl.layers}
    parsed = {k: Choice.parse(v, f"the pin of {k}") for k, v in pins.items()}
    unknown = sorted(set(parsed) - names)
    if unknown:
        raise ValueError(f"hsoffload: pin() names layers this model does not have: {', '.join(unknown)}")
    ctl.pins.update(parsed)
    ctl.request("pins changed")


def report_unseen(layer: torch.nn.Module, why: str) -> None:
    """A decoder layer policy auto cannot choose for (it runs as hidden_states): said once per cause."""
    log_once(f"auto-unseen-{why}", logging.WARNING, "hsoffload: policy auto cannot choose for %s (%s): it runs as "
             "policy hidden_states (every such layer checkpointed and offloaded)", type(layer).__name__, why)


def controller(model: torch.nn.Module) -> Optional[AutoController]:
    """The model's controller, if policy auto ever ran on it."""
    return _controllers.get(model)
