"""`policy="auto"` at run time: measure, decide per decoder layer, apply, verify every step.

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
  that would not fit the budget is not run (that layer is never left unchekpointed); one that runs out of memory
  marks the same. The last calibration step's device peak and time are the lean baseline.
- The decision (hsoffload.choose): the least predicted step time whose predicted peak (the lean peak plus what the
  decision holds, plus a safety margin) is under the budget; logged as a table once per decision.
- Applied per layer: `none` clears the layer's `gradient_checkpointing` flag (transformers honours it per layer),
  `keep` leaves it checkpointed but not offloaded (the layer tracker's selection), `offload` is policy
  hidden_states, `sac` is offload with the layer's checkpoint given a selective context (`SAC_CONTEXT`) that asks
  `CheckpointPolicy.MUST_CPU_OFFLOAD` for its projections (hsoffload.offload.sac moves them). Restored when the scope
  exits.
- Verified every step: the measured peak against the budget and the prediction, the step time against the
  prediction. A peak over the prediction raises the margin by the difference (the margin only grows: no
  oscillation) and, when the decision then no longer fits, decides again. A batch with more tokens than any
  calibrated runs with the leanest choice and calibrates again at its length before it is decided for: a longer
  batch is planned, never discovered by an OOM.
- `auto_report_only`: decide and log, keep every layer offloaded.

Thread-safety: a controller is used on the thread that runs the model's forward (as the scope it serves).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
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
from ..choose import SAC_WINDOW, Choice, Decision, LayerCost, choose, predict, prefetch_depths
from ..targets import LAYER_ATTR, unwrap_marking
from .ranks import Ranks

logger = logging.getLogger("hsoffload")

BUDGET_FRACTION = 0.95  # without device_budget: at most this share of the device's memory
HEADROOM_FRACTION = 0.02  # without device_budget: this share of the device left free beside what the process holds
# outside the allocator (measured at the decision: the CUDA context, communicators' buffers, other processes)
PROBE_GUESS = 24  # a probe runs only if this many times the layer's input still fits under the budget
BUCKET = 1.25  # a longer batch calibrates for at least this many times the longest calibrated (variable lengths)
HISTORY = 1000  # steps kept in `history`
DECISION_LOG = 100  # decisions kept in `decision_log`
VERIFY_STEPS = 3  # a decision with sac: its first this many steps' median time is checked against the prediction
TIME_SLACK = 0.10  # ... and sac's cost learned where that median passes the prediction by more than this share
COPY_REPEATS = 3  # a probe's copy time: the fastest of this many round trips of the layer's input
STATE_VERSION = 2  # of the file auto_state_path names (2: probes measure the projections)

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



@dataclasses.dataclass
class StepRecord:
    """One step (micro-batch) under a decision: predicted and measured."""

    tokens: int
    decided: bool  # False: a calibration step
    predicted_peak_bytes: Optional[int]
    measured_peak_bytes: Optional[int]
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


@dataclasses.dataclass
class _Probe:
    held_none: int  # bytes (math.inf-like huge: never leave unchekpointed)
    backward_s: float
    copy_s: float
    sac_bytes: int = 0  # the projections' outputs its recompute reads (0: the sac choice not offered)
    projection_s: float = 0.0


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
        self.restored: Optional[str] = None  # the file the measurements came from, when a run started with them
        self._state_read = False
        self.pins: dict[str, Choice] = {}
        self.memory: Optional[DeviceMemory] = None
        self.tokens = 0  # the longest batch the costs are for (tokens of a layer's input; grows by BUCKET at least)
        self.calibrated = 0  # calibration steps done for `tokens`
        self.probes: dict[tuple, _Probe] = {}
        self.probe_tokens = 0  # the batch the probes ran at
        self.forward_s: dict[int, float] = {}  # per layer index, measured in the last calibration step
        self.forward_tokens = 0
        self.held_keep: dict[int, int] = {}  # per layer index, at forward_tokens
        self.lean_increase: Optional[int] = None  # the lean step's peak above what the step started with (scaled)
        self.lean_step_s: Optional[float] = None
        self.start_bytes = 0  # device bytes steps start with (weights, optimizer states, ...): the most of the last
        # optimizer step's micro-batches and this one's
        self._cycle_starts = (0, 0)  # the most micro-batches started with: the last optimizer step's, this one's
        self.optimizer_steps = 0  # steps of optimizers holding this model's parameters (torch.optim's hook)
        self._optimizer_steps_seen = 0
        self.decided_start_bytes = 0  # ... when the decision was made
        self.forwards = 1  # forwards seen before one backward (several: each holds what the decision keeps)
        self.margin = 0  # bytes added to every predicted peak; grows by each overshoot seen
        # The allocator's reserved peak above its allocated peak in the last calibration step (the cache's blocks
        # not in use, fragmentation): room taken from the budget, which bounds what the device gives the process
        self.allocator_gap = 0
        self._fresh: Optional[tuple[int, bool, int]] = None  # the step the allocator's cache was last given back at
        self.decision: Optional[Decision] = None
        self.costs: list[LayerCost] = []
        self.decisions = 0
        self.reason = ""  # why the last decision was made
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
        self._verify: list[float] = []  # the running decision's first steps' times (decisions with sac)

    @property
    def lean_peak(self) -> Optional[int]:
        """The leanest choice's predicted peak now: what steps start with, plus the lean step's increase."""
        return None if self.lean_increase is None else self.start_bytes + self.lean_increase

    @property
    def predicted_peak(self) -> Optional[int]:
        """The decision's predicted peak for a step that starts with what steps started with when it was made (the
        margin included); None before a decision."""
        return None if self.decision is None else self.decision.peak_bytes + self.margin

    @property
    def layers(self) -> list[tuple[str, torch.nn.Module]]:
        """The decoder layers in forward order, with their names."""
        out = [(name, ref()) for name, ref in self._layer_refs]
        return [(name, m) for name, m in out if m is not None]

    # -- per layer call -----------------------------------------------------------------------------------------

    def before_layer(self, scope: Any, layer: torch.nn.Module, args: tuple, kwargs: dict,
                     run: Callable[..., Any]) -> None:
        """Called before a decoder layer's forward call in `scope` (not its recompute)."""
        i = self.index.get(id(layer))
        x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        if i is None or not isinstance(x, torch.Tensor) or scope.layer_tracker.current is not None:
            return
        if self.memory is None:
            self._bind_device(x.device)
        if i == 0:
            if self._step is not None and self._step["hooked"] and "t1" not in self._step:
                self._another_forward(scope)  # a forward before the last one's backward: one step, two graphs
            else:
                self._new_step(scope, x)
            if x.requires_grad:  # the step's measurements end when backward has passed the first layer
                x.register_hook(self._first_layer_backward_done)
            else:
                log_once("auto-no-grad-input", logging.INFO,
                         "hsoffload: policy auto: the first decoder layer's input does not require grad (frozen "
                         "embeddings, LoRA without enable_input_require_grads): a step's peak and time are read "
                         "when the next one starts, and include the optimizer's step")
        calibrating = self._step is not None and not self._step["decided"]
        if calibrating:
            self._time_previous_layer(i)
            if self._step["probe"]:
                self._maybe_probe(layer, i, x, args, kwargs, run)
                self.probe_tokens = self._step["tokens"]
            self.held_keep[i] = x.numel() * x.element_size()
            self.forward_tokens = self._step["tokens"]
            self.memory.synchronize_compute()
            self._layer_t0 = (i, time.perf_counter())

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
            self.forward_s[i - 1] = time.perf_counter() - self._layer_t0[1]
        self._layer_t0 = None

    # -- steps ----------------------------------------------------------------------------------------------------

    def offloads_none(self) -> bool:
        """The layers run now offload nothing (a decision of only none and keep)."""
        return not {Choice.OFFLOAD, Choice.SAC} & set(self.choices())

    def _another_forward(self, scope: Any) -> None:
        """A forward whose first layer runs before the previous forward's backward reached it (two losses, one
        backward): both hold what the decision keeps. Counted; a decision for one forward is made again for them (at
        once in one process; at the next micro-batch on several ranks, which decide together: no collective here)."""
        assert self._step is not None and self.ranks is not None
        self._step["forwards"] += 1
        if self._step["forwards"] <= self.forwards:
            return
        self.forwards = self._step["forwards"]
        log_once("auto-forwards", logging.INFO, "hsoffload: policy auto: %d forwards before one backward: each holds "
                 "what the decision keeps, and the decision counts them", self.forwards)
        if self.decision is None:
            return
        if self.ranks.size > 1:
            self._pending = f"{self.forwards} forwards before one backward"
        else:
            self._decide(f"{self.forwards} forwards before one backward")
            self._step["decision"] = self.decision
            self._apply(scope)

    def _first_layer_backward_done(self, grad: torch.Tensor) -> None:
        """The gradient of the first layer's input: every layer's backward ran. The step's peak and time are read
        here, before the optimizer step and the next batch (whose own peaks the decision does not move)."""
        if self._step is not None and "t1" not in self._step:
            self._mark(self._step, "t1")
            self._step["peak"] = self.memory.peak()
            self._step["reserved"] = self.memory.reserved_peak()

    def _new_step(self, scope: Any, x: torch.Tensor) -> None:
        """A micro-batch starts: the last one is recorded; a decision is made when one is due, at an optimizer step's
        first micro-batch (micro-batches of one step share a decision) unless the running one no longer fits."""
        assert self.ranks is not None and self.memory is not None
        reason = self._end_step() if self._step is not None else None
        reason, self._pending = reason or self._pending, None
        local_tokens = tokens = x.numel() // max(1, x.shape[-1])
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
            reason = self._restore() or reason
        if (reason is None and self.decision is not None and not self.report_only
                and self.start_bytes > self.decided_start_bytes + 0.01 * self.budget):
            reason = (f"steps now start with {(self.start_bytes - self.decided_start_bytes) / 2**20:.1f} MiB more on "
                      "the device (the optimizer's states, gradients, or another model)")
        # 0: nothing to decide; 1: a decision is due (at the next optimizer step); 2: the running one does not fit.
        want = 0 if reason is None else 1
        if reason is not None and self.decision is not None and self.decision.fits and (
                self.predicted_peak + self.allocator_gap + start - self.decided_start_bytes > self.budget):
            want = 2
        ready = True
        if self.ranks.size > 1:  # one collective per micro-batch on every rank: tokens, wishes, the step boundary
            tokens, want_any, boundary, ready = self._agree_step(tokens, want, boundary)
            if want_any > want:
                reason = reason or "another rank's measurements changed (its peak, its start bytes or its calibration)"
                want = int(want_any)
        if tokens > self.tokens:
            ceiling = tokens if not self.tokens else max(tokens, math.ceil(self.tokens * BUCKET))
            if self.tokens:
                logger.info("hsoffload: policy auto: a batch of %d tokens, longer than the %d the decision is for: "
                            "this step runs every layer offloaded and calibrates again, for up to %d tokens", tokens,
                            self.tokens, ceiling)
            self.tokens, self.calibrated, self.decision, self.lean_increase = ceiling, 0, None, None
            self.probes.clear()
            reason = None
        if reason is not None and ready and self.lean_increase is not None and self.calibrated >= self.calibration_steps:
            if boundary or want == 2:
                self._decide(reason)
            else:
                self._pending = reason  # kept for the next optimizer step's first micro-batch
        decided = self.decision is not None
        # The reserved peak must be the lean step's or the decision's own, not a cache an earlier step left (the
        # probe's, or a decision that held more): the last calibration step and a decision's first step start with
        # the allocator's cache given back.
        fresh = (self.decisions, decided, self.calibrated)
        if (decided or self.calibrated == self.calibration_steps - 1) and fresh != self._fresh:
            self._fresh = fresh
            self.memory.empty_cache()
        self._step = {"tokens": local_tokens, "decided": decided, "probe": not decided and not self.probes,
                      "decision": self.decision, "hooked": x.requires_grad, "forwards": 1, "start": start,
                      "predicted": self.predicted_peak, "index": self.decisions}
        self._apply(scope)
        self.memory.reset_peak()
        self._mark(self._step, "t0")

    def _agree_step(self, tokens: int, want: int, boundary: bool) -> tuple[int, int, bool, bool]:
        """The ranks' one collective per micro-batch (at its first layer): the longest batch, the strongest wish to
        decide (0 none, 1 due, 2 the running decision no longer fits), whether every rank is at an optimizer step's
        first micro-batch and ready to decide (calibrated). Raises on every rank if their models or controller states
        differ (their next collectives would not match: a hang)."""
        assert self.ranks is not None
        ready = self.lean_increase is not None and self.calibrated >= self.calibration_steps
        state = zlib.crc32(repr(([n for n, _ in self.layers], self.tokens, self.calibrated, self.decisions,
                                 len(self.probes))).encode())
        (longest, want_any, not_boundary, not_ready), same = self.ranks.max_and_same(
            [tokens, want, 0.0 if boundary else 1.0, 0.0 if ready else 1.0], [state])
        if not same:
            raise RuntimeError("hsoffload: policy auto: the ranks' models or auto states differ (decoder layers, the "
                               "tokens calibrated for, calibration steps, decisions or probes): every rank must run the "
                               "same model through the same steps, forward and backward, for one decision to hold")
        return int(longest), int(want_any), not_boundary == 0, not_ready == 0

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
        assert step is not None
        if not step["decided"] and self._layer_t0 is not None:
            self._layer_t0 = None  # the last layer's forward: measured as the others' mean below
        if "t1" not in step:
            if step["hooked"]:  # no backward reached the first layer (a forward only, or another graph): not a step
                self._step = None
                return None
            self._mark(step, "t1")  # no hook possible: up to this step's start
            step["peak"] = self.memory.peak()
            step["reserved"] = self.memory.reserved_peak()
        peak, reserved = step["peak"], step.get("reserved")
        measured_s = self._elapsed(step["t0"], step["t1"])
        decision: Optional[Decision] = step["decision"]
        predicted = step["predicted"] + step["start"] - self.decided_start_bytes if decision else None
        rec = StepRecord(step["tokens"], step["decided"], predicted, peak, decision.step_s if decision else None,
                         measured_s, step["index"] if decision else 0, reserved)
        self.history.append(rec)
        self._step = None
        if not step["decided"]:
            # What the lean step added to what it started with, at the tokens the decision is for: bytes that grow
            # with the length counted as growing with its square (attention without a fused kernel), time linearly.
            f = self.tokens / max(1, step["tokens"])
            self.calibrated += 1
            increase = math.ceil((peak - step["start"]) * f * f)
            self.lean_increase = max(self.lean_increase or 0, increase) if self.calibrated > 1 else increase
            self.lean_step_s = measured_s * f
            if reserved is not None and peak is not None:
                self.allocator_gap = max(0, reserved - peak)
            return "calibrated" if self.calibrated >= self.calibration_steps else None
        if decision is None or peak is None:
            return None
        self.decided_steps += 1
        if self.decided_steps == 1 or peak > rec.predicted_peak_bytes:
            logger.info("hsoffload: policy auto: step measured %.1f MiB peak (predicted %.1f, budget %.1f), %.1f ms "
                        "(predicted %.1f)", peak / 2**20, rec.predicted_peak_bytes / 2**20, self.budget / 2**20,
                        measured_s * 1e3, decision.step_s * 1e3)
        over = 0
        if peak > rec.predicted_peak_bytes:
            over = peak - rec.predicted_peak_bytes
            self.margin += over
            if step["predicted"] + over + self.allocator_gap > self.budget:
                self.replans += 1
                return f"the measured peak {peak / 2**20:.1f} MiB passed the prediction by {over / 2**20:.1f} MiB"
        if reserved is not None and reserved - self.budget > over and decision.fits:
            # What the allocator reserved passed the budget by more than the lent bytes' overshoot (now in the
            # margin): fragmentation beyond the gap measured; the gap grows by the rest and the decision is made again
            over = reserved - self.budget - over
            self.allocator_gap += over
            self.replans += 1
            return (f"the allocator reserved {reserved / 2**20:.1f} MiB, {over / 2**20:.1f} MiB over the budget "
                    "(its cache and fragmentation)")
        return self._verify_sac(decision, step["index"], measured_s)

    def _verify_sac(self, decision: Decision, index: int, measured_s: float) -> Optional[str]:
        """A decision with sac: the median of its first VERIFY_STEPS steps against the prediction. sac's cost is the
        one the model does not see whole (the selective checkpoint's dispatch runs on every op of the layer, in
        forward and recompute; its projections are many small copies): past TIME_SLACK, the excess is learned as sac's
        per layer and the decision made again (sac kept only where it still pays)."""
        if (self.report_only or Choice.SAC not in decision.choices or index != self.decisions
                or not math.isfinite(measured_s)):
            return None
        self._verify.append(measured_s)
        if len(self._verify) != VERIFY_STEPS:
            return None
        measured = sorted(self._verify)[VERIFY_STEPS // 2]
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
        assert self.lean_increase is not None and self.lean_step_s is not None
        # A layer's forward time: the mean over the layers of its kind (alike layers cost alike, whatever the timer's
        # noise; the decision then lays them out canonically, as the planner does).
        layers = self.layers
        kinds = [_signature(layer) for _, layer in layers]
        by_kind: dict[tuple, list[float]] = {}
        for k, kind in enumerate(kinds):
            if k in self.forward_s:
                by_kind.setdefault(kind, []).append(self.forward_s[k])
        known = [t for ts in by_kind.values() for t in ts]
        mean_fwd = sum(known) / len(known) if known else 0.0
        # At the tokens the decision is for: times linear in the tokens, bytes held quadratic for a probe (attention
        # without a fused kernel) and linear for a layer's input; each forward in flight holds its own.
        fp = self.tokens / max(1, self.probe_tokens)
        ff = self.tokens / max(1, self.forward_tokens)
        costs = []
        for k, ((name, _), kind) in enumerate(zip(layers, kinds)):
            probe = self.probes.get(kind)
            times = by_kind.get(kind)
            fwd = sum(times) / len(times) if times else mean_fwd
            held_none = probe.held_none if probe else NEVER
            costs.append(LayerCost(
                name=name, held_none=held_none if held_none >= NEVER else math.ceil(held_none * fp * fp * self.forwards),
                held_keep=math.ceil(self.held_keep.get(k, NEVER) * ff * self.forwards) if k in self.held_keep else NEVER,
                forward_s=fwd * ff, backward_s=(probe.backward_s * fp) if probe else 2 * fwd * ff,
                copy_s=(probe.copy_s * fp) if probe else 0.0,
                # per step like held_keep (each forward in flight copies its own); 0 where the layer's checkpoint can
                # no longer take the selective context (restored measurements, a function changed since the probe)
                sac_bytes=math.ceil(probe.sac_bytes * fp * self.forwards) if probe and self._selective_offered(
                    layers[k][1]) else 0,
                projection_s=(probe.projection_s * fp) if probe else 0.0,
                sac_extra_s=self.sac_extra_per_token.get(kind, 0.0) * self.tokens))
        lean = [Choice.OFFLOAD] * len(layers)
        lean_depth = self.sac_window - 1  # the configured prefetch depth, the calibration's
        _, lean_s = predict(costs, lean, 0, 0.0, self.sac_window, lean_depth)
        fixed_s = self.lean_step_s - lean_s  # the step without any layer's extra: what the lean step measured, less
        lean_peak = self.lean_peak
        if self.budget_arg is None:
            self._default_budget()
        room = self.budget - self.margin - self.allocator_gap - lean_peak
        host_room = self._host_room(costs)
        costs, fixed_s, room, host_room = self._agree(costs, fixed_s, room, host_room)
        self.costs = costs
        self.decided_start_bytes = self.start_bytes
        # the agreed window: the ranks' deepest configured prefetch (one set of depths everywhere)
        self.decision = choose(costs, lean_peak + room, lean_peak, fixed_s, self.pins, self.sac_window, host_room,
                               prefetch_depths=prefetch_depths(self.sac_window - 1))
        self.decisions += 1
        self.reason = why
        self.decision_log.append(f"{''.join(str(c)[0] for c in self.decision.choices)} ({why})")
        self._verify = []
        self._save()
        logger.info("hsoffload: policy auto, decision %d (%s; %d tokens; margin %.1f MiB)%s:\n%s", self.decisions,
                    why, self.tokens, self.margin / 2**20, " REPORT ONLY, every layer offloaded" if self.report_only
                    else "", self.decision.table(costs))

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
        assert self.ranks is not None and self.memory is not None
        device = self.memory.device
        name = getattr(getattr(torch, device.type, None), "get_device_name", None)
        try:
            device_name = str(name(device)) if name is not None and device.type != "cpu" else device.type
        except RuntimeError:
            device_name = device.type
        return {"version": STATE_VERSION, "layers": [n for n, _ in self.layers],
                "kinds": [repr(_signature(m)) for _, m in self.layers], "world": self.ranks.size,
                "rank": self.ranks.rank, "device": device_name}

    def _save(self) -> None:
        path = self.state_file()
        if path is None:
            return
        kinds = {repr(k): k for k in self.probes}
        state = {**self._identity(), "tokens": self.tokens, "calibrated": self.calibrated,
                 "probe_tokens": self.probe_tokens, "forward_tokens": self.forward_tokens, "forwards": self.forwards,
                 "margin": self.margin, "lean_increase": self.lean_increase, "lean_step_s": self.lean_step_s,
                 "allocator_gap": self.allocator_gap,
                 "forward_s": {str(k): v for k, v in self.forward_s.items()},
                 "held_keep": {str(k): v for k, v in self.held_keep.items()},
                 "probes": {r: dataclasses.asdict(self.probes[k]) for r, k in kinds.items()},
                 "sac_extra_per_token": {repr(k): v for k, v in self.sac_extra_per_token.items()},
                 "decisions": self.decisions,
                 "choices": [c.value for c in self.decision.choices] if self.decision else None}
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

    def _restore(self) -> Optional[str]:
        """At the first step: the saved measurements, if the file matches this model, rank and world (on every
        rank, or on none). Returns the reason to decide, or None (calibrate)."""
        assert self.ranks is not None
        path = self.state_file()
        if path is None:
            return None
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
                why = f"it was saved for another {', '.join(differ)}"
                state = None
        ok = state is not None
        if self.ranks.size > 1:  # every rank reuses a file saved at the same decision, or none does
            saved = zlib.crc32(repr([state.get(k) for k in ("decisions", "tokens", "calibrated")]).encode()) if ok else 0
            (low,), same = self.ranks.min_and_same([1.0 if ok else 0.0], [saved])
            ok = low > 0 and same
            if not ok and state is not None:
                why = "another rank has no matching file, or one saved at another decision"
        if not ok:
            logger.info("hsoffload: policy auto: calibrating (%s not reused: %s)", path, why)
            return None
        assert state is not None
        kinds = {repr(_signature(m)): _signature(m) for _, m in self.layers}
        self.tokens, self.probe_tokens = int(state["tokens"]), int(state["probe_tokens"])
        self.forward_tokens = int(state["forward_tokens"])
        self.calibrated = max(int(state["calibrated"]), self.calibration_steps)
        self.forwards, self.margin = int(state["forwards"]), int(state["margin"])
        self.allocator_gap = int(state.get("allocator_gap", 0))
        self.lean_increase, self.lean_step_s = int(state["lean_increase"]), float(state["lean_step_s"])
        self.forward_s = {int(k): float(v) for k, v in state["forward_s"].items()}
        self.held_keep = {int(k): int(v) for k, v in state["held_keep"].items()}
        self.probes = {kinds[r]: _Probe(**p) for r, p in state["probes"].items() if r in kinds}
        self.sac_extra_per_token = {kinds[r]: float(v) for r, v in state.get("sac_extra_per_token", {}).items()
                                    if r in kinds}
        self.restored = path
        logger.info("hsoffload: policy auto: measurements of %d tokens read from %s: no calibration", self.tokens, path)
        return f"measurements read from {path}"

    def request(self, why: str) -> None:
        """Decide again (after calibration) for what the user changed (a budget, pins): at once in one process; on
        several ranks at the next micro-batch's start, where they all decide."""
        if self.lean_increase is None or self.calibrated < self.calibration_steps:
            return
        if self.ranks is None or self.ranks.size > 1:
            self._pending = why
        else:
            self._decide(why)

    def _agree(self, costs: list[LayerCost], fixed_s: float, room: int,
               host_room: Optional[int]) -> tuple[list[LayerCost], float, int, Optional[int]]:
        """On several ranks: each layer's largest cost over the ranks, the longest fixed time and the smallest rooms
        (the device's, the host's), so that the deterministic chooser makes one decision everywhere. Raises on every
        rank if the ranks' models or pins differ (a decision for different layers cannot be one)."""
        assert self.ranks is not None
        if self.ranks.size == 1:
            return costs, fixed_s, room, host_room
        fields = ("held_none", "held_keep", "forward_s", "backward_s", "copy_s", "sac_bytes", "projection_s",
                  "sac_extra_s")
        pins = zlib.crc32(repr(sorted((k, v.value) for k, v in self.pins.items())).encode())
        shape = zlib.crc32(repr([c.name for c in costs]).encode())
        flat = [float(getattr(c, f)) for c in costs for f in fields]
        unlimited = float(NEVER)
        # sac is offered for a layer only if every rank can apply it (-1 where offered: the max is -1 iff all are)
        offered = [-1.0 if c.sac_offered else 0.0 for c in costs]
        agreed, same = self.ranks.max_and_same(
            flat + offered + [fixed_s, -room, -(unlimited if host_room is None else host_room), self.sac_window],
            [shape, pins])
        fixed_s, neg_room, neg_host, window = agreed[len(flat) + len(offered):]
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
                                           projection_s=v[6] if on else 0.0, sac_extra_s=v[7]))
        self.sac_window = int(window)  # the deepest prefetch of the ranks: one window for all
        return out, fixed_s, int(-neg_room), None if -neg_host >= unlimited else int(-neg_host)

    def report(self) -> str:
        """The last decision: why it was made, and its table (empty before the first)."""
        if self.decision is None:
            return ""
        return (f"policy auto, decision {self.decisions} ({self.reason}; {self.tokens} tokens)"
                f"{' REPORT ONLY, every layer offloaded' if self.report_only else ''}:\n"
                f"{self.decision.table(self.costs)}")

    def log_values(self) -> dict[str, float]:
        """Numbers for a trainer's logs (`hsoffload/auto_*`): the layers per choice run now, the decisions made, the
        budget, and the last decided step's predicted and measured peak (GiB) and time (ms)."""
        gib = float(1 << 30)
        values: dict[str, float] = {f"auto_{c.value}_layers": 0.0 for c in Choice}
        for c in self.choices():
            values[f"auto_{c.value}_layers"] += 1
        values["auto_decisions"] = float(self.decisions)
        values["auto_fits"] = float(self.decision is not None and self.decision.fits)
        values["auto_budget_gib"] = (self.budget or 0) / gib
        values["auto_prefetch_depth"] = float(self.prefetch_depth())
        last = next((r for r in reversed(self.history) if r.decided), None)
        if last is not None:
            values["auto_predicted_peak_gib"] = (last.predicted_peak_bytes or 0) / gib
            values["auto_measured_peak_gib"] = (last.measured_peak_bytes or 0) / gib
            values["auto_predicted_step_ms"] = (last.predicted_step_s or 0.0) * 1e3
            values["auto_measured_step_ms"] = last.measured_step_s * 1e3
        return values

    def choices(self) -> list[Choice]:
        """What each layer runs with now."""
        if self.decision is None or self.report_only:
            return [Choice.OFFLOAD] * len(self.layers)  # calibration (the lean baseline), or report only
        return list(self.decision.choices)

    def prefetch_depth(self) -> int:
        """The prefetch depth run now: the decision's, or the configured one (calibration, report only)."""
        if self.decision is None or self.report_only or self.decision.prefetch_depth is None:
            return self.sac_window - 1
        return self.decision.prefetch_depth

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
        if sig in self.probes:
            return
        nbytes = x.numel() * x.element_size()
        allocated = self.memory.allocated()
        fits = allocated is None or allocated + PROBE_GUESS * nbytes <= self.budget
        sharded = _sharded(layer)
        assert self.ranks is not None
        if self.ranks.size > 1:  # every rank probes the same layers, or none does
            fits, unsharded = (v > 0 for v in self.ranks.min([1.0 if fits else 0.0, 0.0 if sharded else 1.0]))
            sharded = not unsharded
        if sharded:
            log_once("auto-sharded", logging.INFO, "hsoffload: policy auto: the decoder layers' parameters are sharded "
                     "(FSDP, DeepSpeed ZeRO-3): a layer is not probed without checkpointing (its forward and backward "
                     "would gather the shards and reduce gradients outside the step), so every layer stays "
                     "checkpointed and auto chooses between keeping and offloading its input")
        elif not fits:
            logger.info("hsoffload: policy auto: %s is not probed without checkpointing (it might not fit the budget): "
                        "it stays checkpointed", self.layers[i][0])
        if sharded or not fits:
            self.probes[sig] = _Probe(NEVER, 0.0, self._copy_s(x))
            return
        out_of_memory = False
        try:
            self.probes[sig] = self._probe(layer, x, args, kwargs, run)
        except torch.OutOfMemoryError:
            out_of_memory = True
        except RuntimeError as exc:  # other backends raise a plain RuntimeError
            if "out of memory" not in str(exc).lower():
                raise
            out_of_memory = True
        if out_of_memory:  # outside the handler: the partial forward's tensors are gone with its traceback
            logger.info("hsoffload: policy auto: %s ran out of memory without checkpointing: it stays checkpointed",
                        self.layers[i][0])
            self.probes[sig] = _Probe(NEVER, 0.0, self._copy_s(x))

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
            with _forked_rng(x.device), _no_output_capture(), torch.enable_grad():
                probe_x = x.detach().requires_grad_(True)
                probe_args = (probe_x,) + tuple(args[1:]) if args else ()
                probe_kwargs = kwargs if args else {**kwargs, "hidden_states": probe_x}
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), (
                        projections if projections is not None else contextlib.nullcontext()):
                    out = _first_tensor(run(layer, *probe_args, **probe_kwargs))
                if out is None or not out.requires_grad:
                    return _Probe(NEVER, 0.0, self._copy_s(x))
                inputs = [probe_x] + [p for p in layer.parameters() if p.requires_grad]
                t0 = self._sync_time()
                torch.autograd.grad(out, inputs, grad_outputs=torch.ones_like(out), allow_unused=True)
                backward_s = self._sync_time() - t0
                del out
        finally:
            layer.gradient_checkpointing = flag
        sac_bytes, projection_s = projections.measured() if projections is not None else (0, 0.0)
        return _Probe(sum(saved.values()), backward_s, self._copy_s(x), sac_bytes, projection_s)


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


@contextlib.contextmanager
def _no_output_capture() -> Iterator[None]:
    """transformers >= 5 collects hidden states, attentions and router logits through hooks into the model call's
    collector: the probe's forward must not add to it (a second router-logits entry, a graph freed twice)."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        yield
        return
    collector = getattr(output_capturing, "_active_collector", None)
    if collector is None:
        yield
        return
    token = collector.set(None)
    try:
        yield
    finally:
        collector.reset(token)


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
