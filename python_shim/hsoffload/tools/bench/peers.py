"""The methods compared side by side: plain checkpointing, hsoffload, and the peers a user would
otherwise pick. Each is set up on the same model in turn, in one process.

Every method uses non-reentrant gradient checkpointing on the decoder layers; they differ in what
happens to the tensors autograd saves outside the checkpointed regions (the layer inputs and what
the embedding, final norm and loss save).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
from typing import Any, ContextManager, Optional

import torch

from ...targets import checkpointing_enable_name, disable_checkpointing, enable_checkpointing

logger = logging.getLogger("hsoffload")

_CKPT_KWARGS = {"use_reentrant": False}


def _accelerator() -> Optional[torch.device]:
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    return acc.current_accelerator()


class Method:
    """One way to train with checkpointing. `setup` (once per model), then `context()` around the
    forward and backward of every step, then `teardown`."""

    name = "?"
    description = ""

    def available(self) -> tuple[bool, str]:
        return True, ""

    def setup(self, model: torch.nn.Module) -> None:
        enable_checkpointing(model, dict(_CKPT_KWARGS))

    def context(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def teardown(self, model: torch.nn.Module) -> None:
        disable_checkpointing(model)

    def counters(self) -> dict[str, Any]:
        """Method-specific counters after the run (bytes offloaded and the like)."""
        return {}


class PlainCheckpointing(Method):
    name = "checkpointing"
    description = "non-reentrant checkpointing, layer inputs stay on the device (baseline)"


class HsOffload(Method):
    name = "hsoffload"
    description = "hsoffload.offload_hidden_states: only decoder-layer inputs go to pinned host memory"

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.scope: Any = None

    def setup(self, model: torch.nn.Module) -> None:
        import hsoffload

        super().setup(model)
        self.scope = hsoffload.offload_hidden_states(model, **self.options)

    def context(self) -> ContextManager[Any]:
        return self.scope

    def teardown(self, model: torch.nn.Module) -> None:
        import hsoffload

        super().teardown(model)
        hsoffload.unpatch()  # the pool keeps its buffers for the next use; hsoffload.empty_pool() frees them

    def counters(self) -> dict[str, Any]:
        import hsoffload

        s = self.scope.stats
        return {
            "offloaded_tensors": s.offloaded_tensors,
            "offloaded_bytes": s.offloaded_bytes,
            "restored_bytes": s.restored_bytes,
            "prefetch_hits": s.prefetch_hits,
            "wait_ns": s.wait_ns,
            "pool_peak_held_bytes": hsoffload.pool_stats().peak_held_bytes,
        }


class SaveOnCpu(Method):
    name = "save_on_cpu"
    description = "torch.autograd.graph.save_on_cpu(pin_memory=True) around the step: every saved tensor outside the checkpoints"

    def __init__(self, pin_memory: bool = True) -> None:
        self.pin_memory = pin_memory
        if not pin_memory:
            self.name = "save_on_cpu(pageable)"
            self.description = "torch.autograd.graph.save_on_cpu(pin_memory=False) around the step (CPU run)"

    def available(self) -> tuple[bool, str]:
        if self.pin_memory and _accelerator() is None:
            return False, "pin_memory=True needs an accelerator"
        return True, ""

    def context(self) -> ContextManager[Any]:
        device_type = (_accelerator() or torch.device("cpu")).type
        return torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory, device_type=device_type)


class TransformersOffload(Method):
    name = "transformers_offload"
    description = "model.activation_checkpointing_enable(offload=True) (gradient_* before 5.23): save_on_cpu around each checkpoint"

    def available(self) -> tuple[bool, str]:
        try:
            from transformers import PreTrainedModel
        except ImportError:
            return False, "transformers not installed"
        name = checkpointing_enable_name()
        params = inspect.signature(getattr(PreTrainedModel, name)).parameters
        if "offload" not in params:
            import transformers

            return False, f"transformers {transformers.__version__} has no {name}(offload=)"
        if _accelerator() is None:
            # save_on_cpu(pin_memory=True, device_type="cpu") raises at the first saved tensor on a
            # CPU-only torch ("pin_memory=True requires a CUDA or other accelerator backend").
            return False, "needs an accelerator (save_on_cpu(pin_memory=True) raises on a CPU-only torch)"
        return True, ""

    def setup(self, model: torch.nn.Module) -> None:
        enable_checkpointing(model, dict(_CKPT_KWARGS), offload=True)


class TrlOffloadActivations(Method):
    name = "trl"
    description = "trl OffloadActivations (streams, pinned), lm_head excluded as get_act_offloading_ctx_manager does"

    def __init__(self) -> None:
        self.ctx: Any = None
        self._handles: list[Any] = []

    def available(self) -> tuple[bool, str]:
        try:
            importlib.import_module("trl.models.activation_offloading")
        except Exception as exc:  # not installed, or its import failed
            return False, f"trl not importable ({type(exc).__name__})"
        if _accelerator() is None:
            return False, "OffloadActivations needs an accelerator (it reads torch.accelerator.current_accelerator().type)"
        return True, ""

    def setup(self, model: torch.nn.Module) -> None:
        mod = importlib.import_module("trl.models.activation_offloading")
        super().setup(model)
        self.ctx = mod.OffloadActivations(use_pin_memory=True, use_streams=True)
        self.ctx.update_model_params(model)
        # What get_act_offloading_ctx_manager does for the output head, with removable hooks.
        head = getattr(model, "lm_head", None)
        if isinstance(head, torch.nn.Module):
            noop = mod.NoOpManager()
            self._handles.append(head.register_forward_pre_hook(lambda *a: noop.__enter__()))
            self._handles.append(head.register_forward_hook(lambda *a: noop.__exit__(), always_call=True))

    def context(self) -> ContextManager[Any]:
        return self.ctx

    def teardown(self, model: torch.nn.Module) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        super().teardown(model)


_AXOLOTL_PATHS = (
    ("axolotl", "axolotl.monkeypatch.checkpoint_activation_offload"),
    ("deepspeed", "deepspeed.runtime.activation_checkpointing.offload_activations"),
)


class CheckpointHiddenStatesOffload(Method):
    """Axolotl's (or DeepSpeed's) CheckpointHiddenStatesOffload, only when the package is importable."""

    name = "axolotl"
    description = "Axolotl CheckpointHiddenStatesOffload (marks GradientCheckpointingLayer inputs while entered)"

    def __init__(self) -> None:
        self._cls: Any = None
        self.ctx: Any = None
        for owner, path in _AXOLOTL_PATHS:
            try:
                self._cls = getattr(importlib.import_module(path), "CheckpointHiddenStatesOffload")
            except Exception:  # package absent or this version lacks the class
                continue
            self.name = owner
            self.description = f"{owner} CheckpointHiddenStatesOffload"
            break

    def available(self) -> tuple[bool, str]:
        if self._cls is None:
            return False, "neither axolotl nor deepspeed provides CheckpointHiddenStatesOffload here"
        return True, ""

    def setup(self, model: torch.nn.Module) -> None:
        super().setup(model)
        self.ctx = self._cls()

    def context(self) -> ContextManager[Any]:
        return self.ctx


def all_methods(*, cpu: bool = False) -> list[Method]:
    """The side-by-side line-up. On CPU hsoffload must copy CPU tensors to show any work."""
    hs = HsOffload(offload_cpu_tensors=True) if cpu else HsOffload()
    return [
        PlainCheckpointing(),
        hs,
        TrlOffloadActivations(),
        SaveOnCpu(pin_memory=not cpu),
        TransformersOffload(),
        CheckpointHiddenStatesOffload(),
    ]
