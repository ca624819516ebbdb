"""`hsoffload plan`: will a run fit, before launch, from a model's config.json alone.

The model is built on the meta device (no weights, no memory) to count its parameters; the byte figures follow
from what the offload policy moves: each checkpointed decoder layer's input, micro_batch x seq_len x hidden_size
elements of `dtype`, once per layer and step (policy "hidden_states"); with policy "sac" and a selective-checkpoint
policy that keeps the projections' matmul outputs (q, k, v, o, gate, up, down; attention by SDPA/flash, whose
S x S scores are never saved), also those. `keep_last_layers` leaves the last k layers' bytes on the device. Times are estimates: the copy at the given bandwidth, the layer's
forward at the given compute rate (2 FLOPs per parameter and token, plus causal attention).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}
_GIB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class PlanInput:
    config: str
    seq_len: int
    micro_batch: int = 1
    world_size: int = 1
    local_world_size: Optional[int] = None  # default: min(world_size, 8)
    dtype: str = "bfloat16"
    bandwidth_gbps: float = 25.0  # host <-> device, GB/s per rank
    tflops: float = 400.0  # sustained compute per rank, TFLOP/s
    host_ram_bytes: Optional[int] = None  # available RAM of one node; default: this machine's MemAvailable
    device_bytes: int = 80 * (1 << 30)
    prefetch_depth: int = 1
    policy: str = "hidden_states"  # or "sac"
    keep_last_layers: int = 0


def _load_config(path: str) -> Any:
    import transformers

    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"hsoffload plan: {path}: no config.json there; pass a config.json or a directory holding one")
    data = json.loads(p.read_text())
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ValueError(f"hsoffload plan: {p} has no model_type; it must be a transformers config.json")
    return transformers.AutoConfig.for_model(model_type, **data)


def _mem_available() -> int:
    """This machine's MemAvailable: what max_host_bytes=auto starts from."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _count_parameters(config: Any) -> tuple[int, int]:
    """(all parameters, parameters of one decoder layer), from the model built on the meta device."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    per_layer = sum(p.numel() for p in layers[0].parameters()) if layers else 0
    return total, per_layer


PLAN_POLICIES = ("hidden_states", "sac")


def sac_elements_per_token(config: Any) -> int:
    """Elements per token that a selective-checkpoint policy keeping every projection's matmul output saves in one
    decoder layer: q, k, v, o, and the MLP's gate, up and down (a gated MLP; two matrices otherwise)."""
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    inter = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    gated = getattr(config, "hidden_act", "silu") in ("silu", "swiglu", "gelu_pytorch_tanh") or hasattr(
        config, "mlp_bias"
    )
    attention = heads * head_dim + 2 * kv_heads * head_dim + hidden
    mlp = (2 * inter if gated else inter) + hidden
    return attention + mlp


def plan(inp: PlanInput) -> dict[str, Any]:
    if inp.dtype not in _DTYPES:
        raise ValueError(f"hsoffload plan: --dtype must be one of {', '.join(_DTYPES)}, got {inp.dtype!r}")
    if inp.policy not in PLAN_POLICIES:
        raise ValueError(
            f"hsoffload plan: --policy must be one of {', '.join(PLAN_POLICIES)}, got {inp.policy!r} (what policy "
            "'all' saves depends on every op of the model: measure it with a short run and scope.stats)"
        )
    if inp.keep_last_layers < 0:
        raise ValueError(f"hsoffload plan: --keep-last-layers must be >= 0, got {inp.keep_last_layers}")
    config = _load_config(inp.config)
    dsize = _DTYPES[inp.dtype]
    layers = int(config.num_hidden_layers)
    hidden = int(config.hidden_size)
    local = inp.local_world_size or min(inp.world_size, 8)
    total_params, layer_params = _count_parameters(config)
    tokens = inp.micro_batch * inp.seq_len
    per_token = hidden + (sac_elements_per_token(config) if inp.policy == "sac" else 0)
    layer_input = tokens * per_token * dsize  # what one checkpointed layer keeps for backward
    kept_layers = min(inp.keep_last_layers, layers)
    offloaded_per_rank = (layers - kept_layers) * layer_input
    host_ram = inp.host_ram_bytes if inp.host_ram_bytes is not None else _mem_available()
    budget_node = int(host_ram * 0.8)  # max_host_bytes=auto: 80 % of the node's available RAM, shared by its ranks
    need_node = offloaded_per_rank * local
    host_node = min(need_node, budget_node)
    spill_node = need_node - host_node
    # Model states per rank under FSDP: weights and gradients in dtype, Adam moments in float32, sharded W ways.
    model_states = total_params * (2 * dsize + 8) // inp.world_size
    device_ckpt = layers * layer_input
    device_offload = min(layers, kept_layers + 1 + inp.prefetch_depth) * layer_input
    transfer_s = layer_input / (inp.bandwidth_gbps * 1e9)
    attention_flops = 2 * inp.micro_batch * inp.seq_len * inp.seq_len * hidden  # causal QK^T and AV
    forward_s = (2 * layer_params * tokens + attention_flops) / (inp.tflops * 1e12)
    hides = transfer_s <= forward_s
    if model_states + device_offload > inp.device_bytes:
        verdict = "does not fit"
    elif spill_node > 0:
        verdict = "fits with spill"
    else:
        verdict = "fits"
    return {
        "model_type": config.model_type,
        "layers": layers,
        "hidden_size": hidden,
        "parameters": total_params,
        "seq_len": inp.seq_len,
        "micro_batch": inp.micro_batch,
        "world_size": inp.world_size,
        "local_world_size": local,
        "dtype": inp.dtype,
        "policy": inp.policy,
        "keep_last_layers": kept_layers,
        "layer_input_bytes": layer_input,
        "offloaded_bytes_per_rank": offloaded_per_rank,
        "device_bytes_checkpointing": device_ckpt,
        "device_bytes_offload": device_offload,
        "device_bytes_model_states": model_states,
        "device_bytes": inp.device_bytes,
        "host_ram_bytes": host_ram,
        "host_budget_bytes_per_node": budget_node,
        "host_bytes_per_node": host_node,
        "spill_bytes_per_node": spill_node,
        "transfer_s_per_layer": transfer_s,
        "forward_s_per_layer": forward_s,
        "copies_hide_behind_compute": hides,
        "verdict": verdict,
    }


def format_plan(p: dict[str, Any]) -> str:
    g = lambda n: f"{n / _GIB:,.2f} GiB"  # noqa: E731
    ms = lambda s: f"{s * 1e3:,.2f} ms"  # noqa: E731
    rows = [
        ("per rank, on the device:", None),
        ("held for backward, checkpointing only", g(p["device_bytes_checkpointing"])),
        ("held for backward, with hsoffload", g(p["device_bytes_offload"])),
        ("model states (FSDP-sharded, Adam)", f"{g(p['device_bytes_model_states'])} of {g(p['device_bytes'])}"),
        ("per node, in host memory:", None),
        ("offloaded, all ranks", g(p["offloaded_bytes_per_rank"] * p["local_world_size"])),
        (f"host budget (80 % of {g(p['host_ram_bytes'])})", g(p["host_budget_bytes_per_node"])),
        ("in host memory", g(p["host_bytes_per_node"])),
        ("to spill_dir", g(p["spill_bytes_per_node"])),
        ("per layer:", None),
        (
            f"copy of its {'input' if p['policy'] == 'hidden_states' else 'input and SAC outputs'} "
            f"({g(p['layer_input_bytes'])})",
            ms(p["transfer_s_per_layer"]),
        ),
        ("forward compute (estimate)", ms(p["forward_s_per_layer"])),
    ]
    width = max(len(label) for label, value in rows if value is not None) + 4
    lines = [
        f"hsoffload plan: {p['model_type']}, {p['layers']} layers, hidden {p['hidden_size']}, "
        f"{p['parameters'] / 1e9:.2f} B parameters; {p['micro_batch']} x {p['seq_len']:,} tokens per rank, "
        f"{p['dtype']}, {p['world_size']} ranks ({p['local_world_size']} per node); policy {p['policy']}"
        + (f", keep_last_layers {p['keep_last_layers']}" if p["keep_last_layers"] else "")
    ]
    lines += [label if value is None else f"  {label:<{width}}{value}" for label, value in rows]
    hide = (
        "the copies hide behind compute"
        if p["copies_hide_behind_compute"]
        else f"the copies take {p['transfer_s_per_layer'] / p['forward_s_per_layer']:.1f}x the compute: expect waits"
    )
    extra = " (set spill_dir)" if p["verdict"] == "fits with spill" else ""
    lines.append(f"verdict: {p['verdict']}{extra}; {hide}")
    return "\n".join(lines)
