"""Axolotl plugin: `activation_offloading: hidden_states` runs on hsoffload.

In the Axolotl YAML::

    plugins:
      - hsoffload.axolotl_plugin.HsOffloadPlugin
    gradient_checkpointing: true
    activation_offloading: hidden_states
    # optional, defaults shown
    hsoffload_min_offload_size: 1024      # bytes; smaller marked tensors stay on the device
    hsoffload_prefetch_depth: 1           # restores issued ahead of their use in backward
    hsoffload_max_pool_bytes: null        # cap of the pinned host pool (null: unbounded)
    hsoffload_use_streams: true           # copies on side streams
    hsoffload_offload_cpu_tensors: false  # also copy CPU tensors (CPU smoke runs; no benefit otherwise)

What it does once Axolotl has built its trainer (`post_trainer_create`): it turns Axolotl's own
offload context for that mode into a no-op, puts torch's reentrant `CheckpointFunction` back if
Axolotl swapped in its offloading one, and enables `hsoffload.integrations.enable_hidden_state_offload`
on the trainer (offload scope around each training step, `hsoffload/*` counters in the logs).
Other `activation_offloading` values are left to Axolotl.

Imports without Axolotl installed (a stand-in base class), so the wiring can be unit tested.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from typing import Any, Optional

import torch.utils.checkpoint

from .integrations.trainer import enable_hidden_state_offload
from .patch import patch
from .scope import OffloadConfig

logger = logging.getLogger("hsoffload")

try:  # pragma: no cover - depends on whether Axolotl is installed
    from axolotl.integrations.base import BasePlugin
except ImportError:  # Axolotl absent: a stand-in with the same (no-op) constructor

    class BasePlugin:  # type: ignore[no-redef]
        """Stand-in for `axolotl.integrations.base.BasePlugin` when Axolotl is not installed."""

        def __init__(self) -> None:
            pass


try:
    from pydantic import BaseModel

    class HsOffloadArgs(BaseModel):
        """Axolotl config keys read by `HsOffloadPlugin` (merged into Axolotl's config schema)."""

        hsoffload_min_offload_size: Optional[int] = None
        hsoffload_prefetch_depth: Optional[int] = None
        hsoffload_max_pool_bytes: Optional[int] = None
        hsoffload_use_streams: Optional[bool] = None
        hsoffload_offload_cpu_tensors: Optional[bool] = None

except ImportError:  # pragma: no cover - pydantic ships with Axolotl
    HsOffloadArgs = None  # type: ignore[assignment,misc]

HIDDEN_STATES_MODE = "hidden_states"
# Axolotl's trainer attribute holding the context it enters around each training step.
_AXOLOTL_CONTEXT_ATTR = "activation_offload_context"
# Captured at import (plugins are imported when Axolotl reads the config, before the model loads).
_TORCH_CHECKPOINT_FUNCTION = torch.utils.checkpoint.CheckpointFunction


def _cfg_get(cfg: Any, key: str) -> Any:
    getter = getattr(cfg, "get", None)
    return getter(key) if callable(getter) else getattr(cfg, key, None)


def is_enabled(cfg: Any) -> bool:
    """True when the config asks for hidden-state offload (`activation_offloading: hidden_states`)."""
    return _cfg_get(cfg, "activation_offloading") == HIDDEN_STATES_MODE


def wants_ram_efficient_loading(cfg: Any) -> bool:
    """True for FSDP configs with `cpu_ram_efficient_loading` (Axolotl's `fsdp_config`, either key spelling)."""
    fsdp_config = _cfg_get(cfg, "fsdp_config") or {}
    getter = fsdp_config.get if isinstance(fsdp_config, dict) else (lambda key: getattr(fsdp_config, key, None))
    return bool(getter("cpu_ram_efficient_loading") or getter("fsdp_cpu_ram_efficient_loading"))


def offload_config(cfg: Any) -> OffloadConfig:
    """The `OffloadConfig` for an Axolotl config (`hsoffload_*` keys; defaults where unset)."""
    values = {
        "min_offload_size": _cfg_get(cfg, "hsoffload_min_offload_size"),
        "prefetch_depth": _cfg_get(cfg, "hsoffload_prefetch_depth"),
        "max_pool_bytes": _cfg_get(cfg, "hsoffload_max_pool_bytes"),
        "use_streams": _cfg_get(cfg, "hsoffload_use_streams"),
        "offload_cpu_tensors": _cfg_get(cfg, "hsoffload_offload_cpu_tensors"),
    }
    return OffloadConfig(**{k: v for k, v in values.items() if v is not None})


def restore_torch_checkpoint_function() -> bool:
    """Undo Axolotl's swap of `torch.utils.checkpoint.CheckpointFunction` (its reentrant
    hidden-states offload), so reentrant checkpoints save their inputs through hsoffload's hooks.
    Returns True if something was restored."""
    current = torch.utils.checkpoint.CheckpointFunction
    if current is _TORCH_CHECKPOINT_FUNCTION:
        return False
    try:
        axolotl_patch = importlib.import_module("axolotl.monkeypatch.activation_offload_checkpoint")
        axolotl_patch.unpatch_hidden_states_offload()
    except (ImportError, AttributeError):
        pass
    if torch.utils.checkpoint.CheckpointFunction is not _TORCH_CHECKPOINT_FUNCTION:
        torch.utils.checkpoint.CheckpointFunction = _TORCH_CHECKPOINT_FUNCTION
    logger.info("hsoffload: restored torch's reentrant CheckpointFunction (was %r)", current)
    return True


class HsOffloadPlugin(BasePlugin):
    """Makes Axolotl's `activation_offloading: hidden_states` use hsoffload."""

    def get_input_args(self) -> Optional[str]:
        return "hsoffload.axolotl_plugin.HsOffloadArgs" if HsOffloadArgs is not None else None

    def pre_model_load(self, cfg: Any) -> None:
        if is_enabled(cfg):
            patch()
        if wants_ram_efficient_loading(cfg):
            from . import fsdp

            fsdp.patch()
            logger.info("hsoffload: FSDP cpu_ram_efficient_loading: non-rank-0 weight init is skipped (hsoffload.fsdp)")

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        if not is_enabled(cfg):
            return
        if not _cfg_get(cfg, "gradient_checkpointing"):
            logger.warning(
                "hsoffload: activation_offloading: hidden_states needs gradient_checkpointing: true; without it "
                "there are no checkpointed hidden states to offload"
            )
        if hasattr(trainer, _AXOLOTL_CONTEXT_ATTR):
            setattr(trainer, _AXOLOTL_CONTEXT_ATTR, contextlib.nullcontext())
        restore_torch_checkpoint_function()
        enable_hidden_state_offload(trainer, offload_config(cfg))
