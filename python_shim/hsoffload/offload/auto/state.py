"""Measurements kept across restarts (`auto_state_path`): a cache per shape bucket, checked by one lean step before
use."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import zlib
from typing import Any, Optional

import torch

from ..._logging import log_once
from ...choose import Phases
from ..calibration import Shape
from .layers import _attention_implementation, _signature
from .records import Bucket, _Probe

logger = logging.getLogger("hsoffload")


STATE_VERSION = 4  # of the file auto_state_path names (2: probes measure the projections; 3: buckets by shape;
# 4: the lean step's peak by phase, a probe's peaks without checkpointing and its projections' share)
RESTORE_TOLERANCE = 0.02  # a saved bucket is reused where its first step measures its figures within this share


class StateMixin:
    """The controller's state file."""

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
