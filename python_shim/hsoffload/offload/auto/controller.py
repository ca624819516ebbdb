"""The controller of one model: sees every decoder-layer call, runs steps, and wires the parts."""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import time
import weakref
from typing import Any, Callable, Optional

import torch

from ..._logging import log_once
from ...choose import SAC_WINDOW, Choice, Decision, LayerCost
from ...targets import LAYER_ATTR
from ..calibration import Shape, bucket_of
from ..ranks import Ranks
from .agree import AgreeMixin
from .apply import ApplyMixin
from .decide import DecideMixin
from .device import BUDGET_FRACTION, DeviceMemory, default_budget
from .layers import _first_tensor, _shape, _signature
from .measure import MeasureMixin
from .phases import _PhaseMeter, shared_bytes
from .probe import ProbeMixin, _Collectives
from .records import Bucket, Step, StepRecord
from .report import DECISION_LOG, HISTORY, ReportMixin
from .state import StateMixin
from .steps import StepsMixin

logger = logging.getLogger("hsoffload")


class AutoController(StepsMixin, ProbeMixin, AgreeMixin, StateMixin, ApplyMixin, MeasureMixin, DecideMixin,
                     ReportMixin):
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
        self._step: Optional[Step] = None  # the step in progress
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
            if self._step is not None and self._step.hooks > 0 and self._step.t1 is None:
                self._another_forward(scope, _shape(layer, x, args, kwargs))  # one step, two graphs
            else:
                self._new_step(scope, x, _shape(layer, x, args, kwargs))
            if x.requires_grad:  # the step's measurements end when backward has passed every forward's first layer
                self._step.hooks += 1
                x.register_hook(self._first_layer_backward_done)
            else:
                log_once("auto-no-grad-input", logging.INFO,
                         "hsoffload: policy auto: the first decoder layer's input does not require grad (frozen "
                         "embeddings, LoRA without enable_input_require_grads): a step's peak and time are read "
                         "when the next one starts, and include the optimizer's step")
        calibrating = self._step is not None and not self._step.decided
        watch = None
        if calibrating:
            self._time_previous_layer(i)
            if self._step.probe:
                self._maybe_probe(layer, i, x, args, kwargs, run)
                self.bucket.probe_shape = self._step.shape
            elif self.ranks is not None and self.ranks.size > 1 and _signature(layer) not in self.collectives:
                watch = _Collectives(self.collectives, _signature(layer))
            meter: Optional[_PhaseMeter] = self._step.meter
            if meter is not None:
                if i > 0 and x.requires_grad:
                    x.register_hook(meter.backward_ended(i))
                meter.layer_started(i)
                if i == 0:
                    meter.shared = shared_bytes(x, args, kwargs)
            self.bucket.held_keep[i] = x.numel() * x.element_size()
            self.bucket.forward_shape = self._step.shape
            self.memory.synchronize_compute()
            self._layer_t0 = (i, time.perf_counter())
        return watch

    def after_layer(self, layer: torch.nn.Module, out: Any) -> None:
        """Called after a decoder layer's forward call (not its recompute): a calibration step hooks the last
        layer's output, whose gradient starts backward's first layer (the phases' meter)."""
        step = self._step
        if step is None or step.meter is None or step.output_hooked:
            return
        if self.index.get(id(layer)) != len(self._layer_refs) - 1:
            return
        t = _first_tensor(out)
        if t is not None and t.requires_grad:
            step.output_hooked = True
            step.meter.last_layer_ended()
            t.register_hook(step.meter.head_ended)

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
            self.budget = default_budget(total)  # refined after full steps (what the process holds outside)
            logger.info("hsoffload: policy auto: device_budget %.2f GiB = %.0f%% of %s's %.2f GiB",
                        self.budget / 2**30, BUDGET_FRACTION * 100, device, total / 2**30)

    def _time_previous_layer(self, i: int) -> None:
        if self._layer_t0 is not None and self._layer_t0[0] == i - 1:
            self.memory.synchronize_compute()
            self.bucket.forward_s[i - 1] = time.perf_counter() - self._layer_t0[1]
        self._layer_t0 = None

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
        boundary = self._count_start(start)
        if not self._state_read:
            self._state_read = True
            self._read_state()
        local = bucket_of(shape)
        reason, wish = self._wish(local, start, reason, urgent)
        target, wish, boundary, reason = self._agree_micro_batch(local, wish, boundary, reason)
        reason = reason or urgent
        if reason is not None:  # a changed measurement, budget or pin: every bucket's decision is made again
            for b in self.buckets.values():
                if b.decision is not None:
                    b.stale = b.stale or reason
        ended = self.bucket  # the last step's: calibrated by it, it is decided for now (not at its next batch)
        if ended.decision is None and ended.ready(self.calibration_steps):
            self._decide(ended.stale or "calibrated")
        self._enter(target, shape)
        self._decide_due(wish, boundary)
        self._begin(scope, shape, start)



