"""The probe: a layer's forward and backward run once without checkpointing (its held bytes, its peaks, its
projections), its input's copy timed; and the watch for collectives that keeps such a layer from being probed."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..._logging import log_once
from .device import _forked_rng, copy_time_s
from .layers import _first_tensor, _no_output_capture, _sharded, _signature
from .phases import _PhaseMeter, _tensors
from .records import NEVER, _Probe
from .selective import _Projections, _selective_ready

logger = logging.getLogger("hsoffload")


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


PROBE_GUESS = 24  # a probe runs only if this many times the layer's input still fits under the budget


class ProbeMixin:
    """The controller's probes (one per kind of layer and bucket)."""

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
        # Storages alive anyway: the parameters, and the call's other tensors (the attention mask, the position
        # embeddings: made once per forward, shared by every layer, held by each layer's checkpoint as well)
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        params |= {t.untyped_storage().data_ptr() for t in _tensors((args[1:], kwargs))
                   if t is not x and t.layout == torch.strided}
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
                meter: Optional[_PhaseMeter] = self._step.meter if self._step is not None else None
                if meter is not None:  # the phase in progress: its peak so far kept, the counter the probe's now
                    meter.other = max(meter.other, meter.read())
                s0 = int(self.memory.allocated() or 0)
                f0 = self._sync_time()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), (
                        projections if projections is not None else contextlib.nullcontext()):
                    out = _first_tensor(run(layer, *probe_args, **probe_kwargs))
                forward_s = self._sync_time() - f0
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
        share = min(1.0, projection_s / forward_s) if forward_s > 0 else 0.0
        return _Probe(sum(saved.values()), backward_s, self._copy_s(x), sac_bytes, share,
                      max(0, none_forward), max(0, none_backward))
