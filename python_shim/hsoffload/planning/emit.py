"""`hsoffload plan --emit axolotl`: the fastest combination that fits (the `--max-seq` table's pick), written back as
the Axolotl keys that make it, ready to merge into the user's config (hsoffload.planning.user_files reads them back
to the same plan). Stdlib only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .settings import PlanError
from .shapes import MaxSeqResult, PlanInput
from .user_files import HIDDEN_STATES_MODE

# What the pick replaces: Axolotl's own offload (activation_offloading is written either way).
_REPLACED = ("activation_offloading=", "gradient_checkpointing=")


def fastest_input(result: MaxSeqResult) -> PlanInput:
    """The PlanInput of the table's pick: the searched input with the pick's settings."""
    if result.fastest is None:
        raise PlanError("hsoffload plan: --emit axolotl: no combination fits this length on the device; see the "
                        "--max-seq table for the longest each one fits")
    inp = result.input
    kept = tuple(u for u in inp.unmodelled if not u.startswith(_REPLACED))
    policy = inp.policy if inp.policy == "auto" else result.policy  # the hsoffload column's
    # Axolotl puts the weights on the host through FSDP's offload_params (or DeepSpeed's offload_param): FSDP then.
    fsdp = inp.fsdp or (result.fastest.settings["cpu_offload"] == "params" and inp.deepspeed_config is None)
    return dataclasses.replace(inp, **result.fastest.settings, unmodelled=kept, policy=policy, fsdp=fsdp)


def axolotl_keys(result: MaxSeqResult) -> dict[str, Any]:
    """The Axolotl keys of the pick (hsoffload's under `activation_offloading: hidden_states` and the plugin's
    hsoffload_* keys when the pick is the hsoffload column; policy auto where the input asked for it)."""
    inp, pick = fastest_input(result), result.fastest
    assert pick is not None
    keys: dict[str, Any] = {
        "sequence_len": inp.seq_len, "micro_batch_size": inp.micro_batch,
        "gradient_accumulation_steps": inp.grad_accum, "gradient_checkpointing": True,
        "chunked_cross_entropy": inp.chunked_loss, "tiled_mlp": inp.tiled_mlp > 1,
    }
    if inp.tiled_mlp > 1:
        keys["tiled_mlp_num_shards"] = inp.tiled_mlp
    if inp.sequence_parallel > 1:
        keys["sequence_parallel_degree"] = inp.sequence_parallel
    if inp.cpu_offload == "params" and inp.deepspeed_config is None:
        keys["fsdp_config"] = {"offload_params": True}
    keys["activation_offloading"] = HIDDEN_STATES_MODE if pick.column == "hsoffload" else False
    keys.update(hsoffload_policy=inp.policy, hsoffload_keep_last_layers=inp.keep_last_layers,
                hsoffload_prefetch_depth=inp.prefetch_depth)
    return keys


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def axolotl_yaml(result: MaxSeqResult) -> str:
    """The pick's keys as YAML, headed by comments naming the pick (and the DeepSpeed key to set by hand)."""
    pick = result.fastest
    keys = axolotl_keys(result)
    assert pick is not None
    lines = [f"# hsoffload plan: the fastest that fits at {pick.seq_len} tokens: {pick.knobs}, {pick.column} "
             f"({pick.step_time_s:.3g} s a step, {pick.tokens_per_s:,.0f} tokens/s per rank)"]
    if keys.get("activation_offloading") == HIDDEN_STATES_MODE:
        lines.append("# plugins: add hsoffload.axolotl_plugin.HsOffloadPlugin")
    if result.fastest.settings.get("cpu_offload") == "params" and result.input.deepspeed_config is not None:
        lines.append(f"# in {result.input.deepspeed_config}: zero_optimization.offload_param.device: cpu")
    for key, value in keys.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines += [f"  {k}: {_scalar(v)}" for k, v in value.items()]
        else:
            lines.append(f"{key}: {_scalar(value)}")
    return "\n".join(lines)
