"""Axolotl plugin: `activation_offloading: hidden_states` runs on hsoffload.

In the Axolotl YAML::

    plugins:
      - hsoffload.axolotl_plugin.HsOffloadPlugin
    gradient_checkpointing: true
    activation_offloading: hidden_states
    # optional, defaults shown
    hsoffload_min_offload_size: 1024      # bytes; smaller marked tensors stay on the device
    hsoffload_prefetch_depth: 1           # restores issued ahead of their use in backward
    hsoffload_max_pool_bytes: null        # cap of the pinned host pool (null: follows max_host_bytes)
    hsoffload_max_host_bytes: null        # offloaded bytes in host RAM at once ("64GiB", bytes, or auto:
                                          # 80% of MemAvailable / LOCAL_WORLD_SIZE; null: auto unless set)
    hsoffload_reserve_host_bytes: null    # host bytes pinned before the first step ("24GiB": `hsoffload plan`'s
                                          # host figure; null: the pool grows during the first steps)
    hsoffload_spill_dir: null             # local directory for what exceeds it (null: it stays on the GPU)
    hsoffload_spill_prefetch_depth: 2     # spilled tensors read back ahead of their use
    hsoffload_spill_wait_ms: 30000        # a pack's longest wait for host room when the disk lags (0: keep on device)
    hsoffload_use_streams: true           # copies on side streams
    hsoffload_pin_memory: true            # pinned host buffers (needed for asynchronous copies)
    hsoffload_share_copies: false         # true: saves of one tensor by several ops share one host copy (fewer
                                          # bytes; a .data write between the saves then restores the first's bytes)
    hsoffload_offload_cpu_tensors: false  # also copy CPU tensors (CPU smoke runs; no benefit otherwise)
    hsoffload_policy: hidden_states       # or sac (plus what selective checkpointing keeps), all (every saved
                                          # activation; works without gradient_checkpointing) or auto (per layer)
    hsoffload_keep_last_layers: 0         # the last k decoder layers keep their tensors on the GPU
    hsoffload_offload_fraction: 1.0       # share of the other decoder layers (the first ones) that offload
    hsoffload_offload_output_head: false  # policy all: also the output head's saved tensors
    hsoffload_device_budget: null         # policy auto: device bytes a step may peak at (null: 95 % of the GPU)
    hsoffload_auto_calibration_steps: 2   # policy auto: measuring steps before the first decision
    hsoffload_auto_report_only: false     # policy auto: decide and log, keep every layer offloaded
    hsoffload_auto_state_path: null       # policy auto: JSON of its measurements, reused on resume ({rank}: the rank)
    hsoffload_zero3_loading: false        # true, with a ZeRO-3 `deepspeed:` config: ranks other than rank 0 receive
                                          # only their partition while the model loads (hsoffload.zero3_loading)
    hsoffload_zero3_loading_verify: false # true: check every partition against rank 0's values (a checksum each)

RAM-efficient loading does not need `activation_offloading`: FSDP's `cpu_ram_efficient_loading` installs
`hsoffload.fsdp.patch()`, and `hsoffload_zero3_loading: true` with a ZeRO-3 `deepspeed` config installs
`hsoffload.zero3_loading.patch()` (on every rank, as the plugin runs on every rank), both before the model is
loaded. The ZeRO-3 one is opt-in: it changes the loading collectives, and its NCCL path has not run on GPUs yet.

What it does once Axolotl has built its trainer (`post_trainer_create`): it turns Axolotl's own
offload context for that mode into a no-op, puts torch's reentrant `CheckpointFunction` back if
Axolotl swapped in its offloading one, and enables `hsoffload.integrations.enable_hidden_state_offload`
on the trainer (offload scope around each training step, `hsoffload/*` counters in the logs).
Other `activation_offloading` values are left to Axolotl.

Imports without Axolotl installed (a stand-in base class), so the wiring can be unit tested.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch.utils.checkpoint

from .trainer import enable_hidden_state_offload
from ..offload.patch import patch
from .._logging import log_once, route_info_to
from .. import options
from ..offload.config import OffloadConfig

logger = logging.getLogger("hsoffload")

try:  # pragma: no cover - depends on whether Axolotl is installed
    from axolotl.integrations.base import BasePlugin
except ImportError:  # Axolotl absent: a stand-in with the same (no-op) constructor

    class BasePlugin:  # type: ignore[no-redef]
        """Stand-in for `axolotl.integrations.base.BasePlugin` when Axolotl is not installed."""

        def __init__(self) -> None:
            pass


# Every Axolotl key the plugin reads, with what it accepts: `hsoffload_<name>` for each option of the one table of
# knobs (hsoffload.options), from which validation (below) and the pydantic schema Axolotl merges into its config (so
# Axolotl's own config check refuses bad values too) are made.
KEYS: dict[str, options.Option] = {o.axolotl_key: o for o in options.OPTIONS}
KEY: dict[str, str] = {o.name: o.axolotl_key for o in options.OPTIONS}  # option name -> its Axolotl key


def _pydantic_field(option: options.Option) -> tuple[Any, Any]:
    from pydantic import Field, StrictBool, StrictInt, StrictStr

    kind = {
        options.INT: StrictInt, options.BOOL: StrictBool, options.FLOAT: float, options.PATH: StrictStr,
        options.FILE: StrictStr,
        options.BYTES: Union[StrictInt, StrictStr], options.BYTES_OR_AUTO: Union[StrictInt, StrictStr],
        options.POLICY: Literal[tuple(p.value for p in options.PolicyName)],
    }[option.kind]
    bounds = {k: v for k, v in (("ge", option.minimum), ("le", option.maximum)) if v is not None}
    return Optional[kind], Field(default=None, **bounds)


try:
    import pydantic

    HsOffloadArgs = pydantic.create_model(  # type: ignore[call-overload]
        "HsOffloadArgs",
        __doc__="Axolotl config keys read by `HsOffloadPlugin` (merged into Axolotl's config schema).",
        **{key: _pydantic_field(option) for key, option in KEYS.items()},
    )
except ImportError:  # pragma: no cover - pydantic ships with Axolotl
    HsOffloadArgs = None  # type: ignore[assignment,misc]


def _cfg_keys(cfg: Any) -> list[str]:
    keys = getattr(cfg, "keys", None)
    if callable(keys):
        return [str(k) for k in keys()]
    return [k for k in vars(cfg)] if hasattr(cfg, "__dict__") else []


def validate_config(cfg: Any) -> None:
    """Refuses unknown `hsoffload_*` keys (naming the closest known one) and invalid values (naming key, value and
    what is allowed). Runs when Axolotl reads the config, before any model is loaded."""
    import difflib

    for key in _cfg_keys(cfg):
        if key.startswith("hsoffload_") and key not in KEYS:
            prefix = len("hsoffload_")  # compare what follows the common prefix, which would make anything "close"
            close = difflib.get_close_matches(key[prefix:], [k[prefix:] for k in KEYS], n=1)
            hint = f"; did you mean hsoffload_{close[0]}?" if close else f"; known keys: {', '.join(KEYS)}"
            raise ValueError(f"hsoffload plugin: unknown Axolotl config key {key}{hint}")
    for key, option in KEYS.items():
        value = _cfg_get(cfg, key)
        if value is None:
            continue
        try:
            options.validate(option, value, what=key)
        except (TypeError, ValueError):
            raise ValueError(f"hsoffload plugin: {key}: {value!r} is not allowed; expected "
                             f"{options.allowed(option)}") from None


HIDDEN_STATES_MODE = "hidden_states"
# Axolotl's handlers serve the "axolotl" logger tree at AXOLOTL_LOG_LEVEL (INFO by default); its root handlers show
# other libraries' records only from WARNING up.
AXOLOTL_LOGGER = "axolotl.integrations.hsoffload"
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


def _read_deepspeed_config(value: Any) -> Optional[dict]:
    """Axolotl's `deepspeed` value as a dict: a dict (Axolotl loads the file itself), a JSON file's path, or a
    base64-encoded JSON string (as transformers' HfDeepSpeedConfig accepts); None when it is none of these."""
    if isinstance(value, dict) or (hasattr(value, "get") and hasattr(value, "keys")):
        return dict(value)
    if not isinstance(value, (str, os.PathLike)):
        return None
    try:
        path = Path(value)
        if path.is_file():
            data = json.loads(path.read_text())
        else:
            data = json.loads(base64.urlsafe_b64decode(str(value)).decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def deepspeed_zero_stage(cfg: Any) -> Optional[int]:
    """The ZeRO stage of Axolotl's `deepspeed` key, None without one or when it cannot be read."""
    ds = _cfg_get(cfg, "deepspeed")
    if not ds:
        return None
    data = _read_deepspeed_config(ds)
    zero = data.get("zero_optimization") if data is not None else None
    stage = zero.get("stage") if isinstance(zero, dict) else None
    return int(stage) if isinstance(stage, (int, str)) and str(stage).isdigit() else None


def wants_zero3_loading(cfg: Any) -> bool:
    """True for `hsoffload_zero3_loading: true` with a ZeRO-3 `deepspeed` config."""
    return _cfg_get(cfg, KEY["zero3_loading"]) is True and deepspeed_zero_stage(cfg) == 3


def offload_config(cfg: Any) -> OffloadConfig:
    """The `OffloadConfig` for an Axolotl config (`hsoffload_*` keys; defaults where unset)."""
    values = {o.name: _cfg_get(cfg, o.axolotl_key) for o in options.CONFIG_OPTIONS}
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

    def register(self, cfg: Any = None) -> None:
        """Called by Axolotl when it loads the plugin while reading the config: the `hsoffload_*` keys are checked
        here, before any model is loaded. From here on hsoffload's INFO messages go to Axolotl's log output."""
        route_info_to(AXOLOTL_LOGGER)
        if cfg is not None:
            validate_config(cfg)

    def pre_model_load(self, cfg: Any) -> None:
        validate_config(cfg)  # again, for Axolotl versions that call register() without the config
        if is_enabled(cfg):
            patch()
        if wants_ram_efficient_loading(cfg):
            from ..loading import fsdp

            fsdp.patch()
            logger.info("hsoffload: FSDP cpu_ram_efficient_loading: non-rank-0 weight init is skipped (hsoffload.fsdp)")
        if wants_zero3_loading(cfg):
            from ..loading import zero3 as zero3_loading

            zero3_loading.patch(verify=_cfg_get(cfg, KEY["zero3_loading_verify"]) is True)  # logs what it patched
        elif _cfg_get(cfg, KEY["zero3_loading"]) is True:
            log_once("zero3_loading_without_zero3", logging.WARNING,
                     "hsoffload: hsoffload_zero3_loading: true does nothing here: deepspeed: %r is not a readable "
                     "ZeRO-3 config (a JSON file, dict or base64 JSON with zero_optimization.stage 3)",
                     _cfg_get(cfg, "deepspeed"))

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        if not is_enabled(cfg):
            return
        policy = options.PolicyName.parse(_cfg_get(cfg, KEY["policy"]) or options.default("policy"))
        if not _cfg_get(cfg, "gradient_checkpointing") and not policy.offloads_every_save:
            logger.warning(
                "hsoffload: activation_offloading: hidden_states needs gradient_checkpointing: true; without it "
                "there are no checkpointed hidden states to offload (or set hsoffload_policy: all, which offloads "
                "every saved activation)"
            )
        if hasattr(trainer, _AXOLOTL_CONTEXT_ATTR):
            setattr(trainer, _AXOLOTL_CONTEXT_ATTR, contextlib.nullcontext())
        restore_torch_checkpoint_function()
        enable_hidden_state_offload(trainer, offload_config(cfg))
