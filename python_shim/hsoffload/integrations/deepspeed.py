"""DeepSpeed next to hidden-state offload: the host memory ZeRO-Offload takes, left out of hsoffload's auto budget.

ZeRO-Offload keeps the model states in host memory (`offload_optimizer`: the fp32 master copy, the fp32 gradients
and Adam's two moments, 16 bytes per parameter) and, under ZeRO-3 with `offload_param` in bf16/fp16, the 16-bit
parameter partitions too (2 bytes per parameter; an fp32 run's weights are the master copy). Each rank holds its
partition: 1 / world size of it. The accounting is the planner's (`plan_memory.host_state_bytes_per_parameter`), so
the auto budget at run time is the one `hsoffload plan` reports. Part of it (Adam's moments) is allocated at the first
optimizer step, after hsoffload's auto budget was read from MemAvailable at the first scope entry, so without room
left for it offload and ZeRO-Offload together could pin more than the node has. `leave_room_for_zero_offload` sets
that room (`hsoffload.set_host_room`); the Trainer integration calls it.

Counts and figures only: importing this module imports neither DeepSpeed nor torch.distributed.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Optional

import torch

from ..offload.host import set_host_room

logger = logging.getLogger("hsoffload")

# Bytes per parameter in host memory (DeepSpeed's accounting, as in runtime/zero/stage3.py's
# estimate_zero3_model_states_mem_needs without its headroom factor, and as the planner counts them): Adam's two fp32
# moments, the fp32 gradient and the fp32 master weight; with offload_param, the bf16/fp16 weight.
OPTIMIZER_BYTES_PER_PARAM = 16
PARAM_BYTES_PER_PARAM = 2


def _config_dict(engine_or_config: Any) -> Mapping[str, Any]:
    """The DeepSpeed config as a dict: a dict as is, a DeepSpeedEngine's or DeepSpeedConfig's parsed one."""
    if isinstance(engine_or_config, Mapping):
        return engine_or_config
    for holder in (engine_or_config, getattr(engine_or_config, "_config", None)):
        params = getattr(holder, "_param_dict", None)
        if isinstance(params, Mapping):
            return params
    config = getattr(engine_or_config, "config", None)
    if isinstance(config, Mapping):
        return config
    raise TypeError(
        "hsoffload: expected a DeepSpeed config dict, a DeepSpeedEngine or a DeepSpeedConfig, got "
        f"{type(engine_or_config).__name__}"
    )


def _offloads(zero: Mapping[str, Any], key: str) -> bool:
    section = zero.get(key)
    return isinstance(section, Mapping) and str(section.get("device", "none")).lower() in ("cpu", "nvme")


def parameter_count(model: torch.nn.Module) -> int:
    """The model's parameters, each once (a ZeRO-3 partitioned parameter counts its full `ds_numel`)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[id(p)] = int(getattr(p, "ds_numel", p.numel()))
    return sum(seen.values())


def zero_offload_host_bytes(engine_or_config: Any, model: torch.nn.Module, world_size: Optional[int] = None) -> int:
    """This rank's host bytes for ZeRO-Offload's states of `model`: 0 without `offload_optimizer`/`offload_param` on
    the CPU or NVMe (counted as CPU: NVMe offload stages through host buffers), else parameters x bytes per parameter
    / world size. `world_size`: default torch.distributed's, else $WORLD_SIZE, else 1."""
    config = _config_dict(engine_or_config)
    zero = config.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        return 0
    per_param = 0
    if _offloads(zero, "offload_optimizer"):
        per_param += OPTIMIZER_BYTES_PER_PARAM
    half = any(isinstance(config.get(k), Mapping) and config[k].get("enabled") in (True, "auto") for k in ("bf16", "fp16"))
    if int(zero.get("stage", 0)) == 3 and _offloads(zero, "offload_param") and half:
        per_param += PARAM_BYTES_PER_PARAM
    if per_param == 0:
        return 0
    if world_size is None:
        import os

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world_size = torch.distributed.get_world_size()
        else:
            world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return math.ceil(parameter_count(model) * per_param / max(1, int(world_size)))


def leave_room_for_zero_offload(engine_or_config: Any, model: Optional[torch.nn.Module] = None,
                                world_size: Optional[int] = None) -> int:
    """Leave this rank's ZeRO-Offload bytes (`zero_offload_host_bytes`) out of hsoffload's auto host budget
    (`hsoffload.set_host_room`). `model`: default the engine's module. Returns the bytes (0: no ZeRO-Offload)."""
    if model is None:
        model = getattr(engine_or_config, "module", None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError("hsoffload: leave_room_for_zero_offload needs the model (pass model=, or a DeepSpeedEngine)")
    nbytes = zero_offload_host_bytes(engine_or_config, model, world_size)
    set_host_room(nbytes)
    if nbytes:
        logger.info("hsoffload: %.2f GiB of host memory left to ZeRO-Offload on this rank (not in the auto budget)",
                    nbytes / 2**30)
    return nbytes


def trainer_deepspeed_config(trainer: Any) -> Optional[Mapping[str, Any]]:
    """The DeepSpeed config a transformers Trainer (accelerate) runs with, or None when DeepSpeed is not enabled."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None)
    if isinstance(config, Mapping):
        return config
    engine = getattr(trainer, "model_wrapped", None)
    try:
        return _config_dict(engine)
    except TypeError:
        return None
