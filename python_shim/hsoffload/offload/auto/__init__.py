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

The package, one module per concept (the controller wires them; each part is a mixin of its own module):

- `controller`: the controller of one model: every decoder-layer call, the steps, the buckets;
- `device`: the device's allocator figures, a copy's time, the default budget;
- `layers`: what is read of a layer and its call (kind, sharding, attention, the batch's shape);
- `records`: a step's, a probe's and a bucket's records;
- `phases`: a calibration step's peak by phase (hsoffload.costs.Phases);
- `probe`: a layer run once without checkpointing, its copy timed; the watch for collectives;
- `selective`: the `sac` choice's selective-checkpoint context and the probe's record of projections;
- `measure`: a step that ended, into its bucket (calibration) or verified (a decision);
- `decide`: a bucket's decision (hsoffload.costs and hsoffload.choose);
- `agree`: the agreement across ranks;
- `apply`: a decision applied to the layers;
- `state`: the measurements kept across restarts;
- `report`: the decision's table and the numbers for a trainer's logs;
- `optimizer`, `registry`: one controller per model, the optimizer-step hook, the public functions.
"""

from __future__ import annotations

from .controller import AutoController
from .device import DeviceMemory, copy_time_s, default_budget
from .layers import _shape
from .measure import VERIFY_STEPS
from .optimizer import _controllers
from .records import Bucket, StepRecord
from .registry import controller, controller_for, pin, report_unseen
from .selective import SAC_CONTEXT, _is_selective, _projections_to_host
from .state import STATE_VERSION

__all__ = ["AutoController", "Bucket", "DeviceMemory", "STATE_VERSION", "SAC_CONTEXT", "StepRecord", "VERIFY_STEPS",
           "controller", "controller_for", "copy_time_s", "default_budget", "pin", "report_unseen"]
__all__ += ["_controllers", "_is_selective", "_projections_to_host", "_shape"]  # read by the tests

