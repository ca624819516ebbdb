"""The step time of a plan, before launch: compute per layer from FLOPs and a device profile, the offload's copies on
the side streams and the part of them compute does not hide, the collectives on the step's path, the optimizer step
on the host. Predicts the step of one micro-batch per rank; the same model for every choice, so that choices compare.

The model, per rank (times in seconds):
- forward of a layer: 2 x active parameters x tokens + attention (causal: 2 x tokens x keys x q width) FLOPs at the
  profile's sustained rate; recompute (checkpointing) is one forward again; backward two forwards of the
  projections, and of attention 2.5 with a fused (flash) kernel, which recomputes the scores
  (`attention_backward_factor`);
- gradient accumulation: a step is `grad_accum` micro-batches (each with its copies and collectives) and one
  optimizer step;
- the offload's copies run on side streams beside compute: in forward, layer i's input copies to the host while
  layers i, i+1, ... compute, and the last copy must end before backward's first restore (the head's forward and
  backward hide what outlasts the layers: `costs.copies_out_exposed_s`); in backward the restore of a layer runs `prefetch_depth`
  layers ahead, a two-stage pipeline: L layers of compute c (recompute and backward) beside copies x take
  max(L c, L x) + min(c, x) (the first restore is waited for); the exposed copy time is that minus L c
  (`costs.restores_exposed_s`: the cost model's, shared with policy auto);
- the copy bandwidth per rank is the profile's host link, or the node's host memory bandwidth shared by its ranks
  when that is less;
- collectives: FSDP's per-layer all-gather (forward, recompute) and reduce-scatter (backward) overlap compute (FSDP
  prefetches), only what exceeds the layer's compute shows; Ulysses' four all-to-alls per attention (q, k, v, output;
  again in recompute, and their gradients in backward) are on the critical path; ring attention's key/value passes
  overlap the attention compute;
- the head and loss: forward and backward of the LM head's matmul; the optimizer: on the device a bandwidth-bound
  sweep over the states, with `cpu_offload` on the host at the profile's host Adam rate plus the gradients down and
  the weights up.

Device profiles carry their sources (`PROFILES`); `--device-profile FILE` reads one from JSON. Stdlib only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

from .. import costs
from .model import ModelShape, Setup, is_moe_layer, model_states_device_bytes
from .settings import PlanError

GB = 1e9


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What the time model needs to know of one accelerator and its node."""

    name: str
    tflops: float  # sustained dense bf16/fp16 matmul TFLOP/s in training (not the datasheet's peak)
    hbm_gbps: float  # device memory bandwidth, GB/s (the optimizer's sweep)
    host_link_gbps: float  # pinned host <-> device copies, GB/s per direction per GPU
    node_host_gbps: float  # host memory bandwidth the node's ranks share for those copies, GB/s
    intra_node_gbps: float  # per-GPU all-gather / all-to-all bandwidth inside a node (NVLink), GB/s
    inter_node_gbps: float  # per-GPU bandwidth across nodes, GB/s
    host_adam_params_per_s: float  # parameters per second one rank's CPU Adam updates (ZeRO-Offload's)
    source: str

    @classmethod
    def from_file(cls, path: str) -> "DeviceProfile":
        try:
            data: dict[str, Any] = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise PlanError(f"hsoffload plan: --device-profile {path}: not a readable JSON file ({exc})") from None
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        missing = sorted(names - set(data) - {"source"})
        if unknown or missing:
            raise PlanError(f"hsoffload plan: --device-profile {path}: unknown keys {unknown}, missing {missing} "
                            f"(keys: {', '.join(sorted(names))})")
        return cls(**{"source": str(path), **data})


# Sustained rates are 60 % of the dense bf16 datasheet peak (the MFU large-matmul training reaches); the host link is
# what pinned copies measure on the bus generation, not the bus's nominal rate.
PROFILES: dict[str, DeviceProfile] = {
    "h100-sxm": DeviceProfile(
        name="h100-sxm", tflops=0.6 * 989, hbm_gbps=3350, host_link_gbps=50, node_host_gbps=300, intra_node_gbps=350,
        inter_node_gbps=50, host_adam_params_per_s=1.0e9,
        source="NVIDIA H100 datasheet (989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 900 GB/s both directions, "
               "PCIe Gen5 x16); pinned copies measure about 50 GB/s on Gen5; DeepSpeed's CPU Adam about 1e9 "
               "parameters/s on a 2-socket host (ZeRO-Offload paper)"),
    "h100-pcie": DeviceProfile(
        name="h100-pcie", tflops=0.6 * 756, hbm_gbps=2000, host_link_gbps=50, node_host_gbps=300, intra_node_gbps=50,
        inter_node_gbps=25, host_adam_params_per_s=1.0e9,
        source="NVIDIA H100 PCIe datasheet (756 TFLOP/s dense bf16, 2.0 TB/s HBM2e, PCIe Gen5; no NVSwitch: "
               "collectives over PCIe)"),
    "h200": DeviceProfile(
        name="h200", tflops=0.6 * 989, hbm_gbps=4800, host_link_gbps=50, node_host_gbps=300, intra_node_gbps=350,
        inter_node_gbps=50, host_adam_params_per_s=1.0e9,
        source="NVIDIA H200 datasheet (989 TFLOP/s dense bf16 as H100, 4.8 TB/s HBM3e, NVLink 900 GB/s, PCIe Gen5)"),
    "a100-80gb": DeviceProfile(
        name="a100-80gb", tflops=0.6 * 312, hbm_gbps=2039, host_link_gbps=25, node_host_gbps=200, intra_node_gbps=250,
        inter_node_gbps=25, host_adam_params_per_s=1.0e9,
        source="NVIDIA A100 80GB SXM datasheet (312 TFLOP/s dense bf16, 2.0 TB/s HBM2e, NVLink 600 GB/s, PCIe Gen4: "
               "pinned copies about 25 GB/s)"),
}
DEFAULT_PROFILE = "h100-sxm"


def profile(name_or_path: Optional[str]) -> DeviceProfile:
    """A named profile, or one read from a JSON file; the default (H100 SXM) for None."""
    if name_or_path is None:
        return PROFILES[DEFAULT_PROFILE]
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    if name_or_path.endswith(".json"):
        return DeviceProfile.from_file(name_or_path)
    raise PlanError(f"hsoffload plan: --device-profile must be one of {', '.join(PROFILES)} or a JSON file, got "
                    f"{name_or_path!r}")


@dataclasses.dataclass(frozen=True)
class StepTime:
    """One step's predicted time on one rank, by part (seconds)."""

    total_s: float
    parts: dict[str, float]  # forward, recompute, backward, head, exposed copies, collectives, optimizer


def copy_bandwidth(p: DeviceProfile, local_world_size: int) -> float:
    """Bytes/s one rank's offload copies get: its host link, or the node's host memory bandwidth shared by its ranks
    when that is less."""
    return min(p.host_link_gbps, p.node_host_gbps / max(1, local_world_size)) * GB


def with_overrides(p: DeviceProfile, tflops: Optional[float], host_link_gbps: Optional[float]) -> DeviceProfile:
    """`p` with the plan's --tflops / --bandwidth where given."""
    return dataclasses.replace(p, tflops=tflops or p.tflops, host_link_gbps=host_link_gbps or p.host_link_gbps)


def _active_layer_parameters(shape: ModelShape, moe: bool) -> int:
    """Parameters one token goes through in a layer (an MoE layer: its experts per token and the shared ones)."""
    if not moe:
        return shape.layer_parameters(False)
    experts = shape.experts_per_token * 3 * shape.hidden * shape.expert_intermediate
    shared = 3 * shape.hidden * shape.shared_expert_intermediate
    return shape.attention_parameters() + experts + shared + shape.hidden * shape.experts


def attention_backward_factor(attn: str) -> float:
    """Attention's backward FLOPs over its forward's. A fused (flash) kernel keeps no score matrix: its backward
    recomputes QK^T and runs four more matmuls (dV, dP, dQ, dK), 5 against the forward's 2 (FlashAttention-2, Dao
    2023, section 3.1); the math and eager paths keep the probabilities, and their backward is the usual two matmuls
    per forward matmul."""
    return 2.5 if attn in ("sdpa", "flash") else 2.0


def attention_flops(shape: ModelShape, s: Setup) -> float:
    """One layer's attention forward on one rank. Each rank's share of attention is its tokens against the whole
    sequence's keys (Ulysses: all tokens, 1/D of the heads; ring: its queries, every key over the passes). Causal:
    half of QK^T's and AV's 2 x 2 x t x k x d. Packed sequences (flash-attention's varlen kernel): each token against
    its own sequence's keys only, `packed_sequence_len` of them on average (a causal sequence of length n costs n^2/2
    score pairs: the mean length stands for it when the lengths are alike; longer outliers cost more)."""
    keys = s.seq_len
    if s.sample_packing and s.packed_sequence_len:
        keys = min(s.seq_len, s.packed_sequence_len)
    return 2 * s.tokens * keys * shape.heads * shape.head_dim


def layer_times(shape: ModelShape, s: Setup, p: DeviceProfile) -> list[tuple[float, float]]:
    """Each decoder layer's forward and backward (seconds) on profile `p`."""
    rate = p.tflops * 1e12
    attention = attention_flops(shape, s) / rate
    out = []
    for i in range(shape.layers):
        linear = 2 * _active_layer_parameters(shape, is_moe_layer(shape, i)) * s.tokens / rate
        out.append((linear + attention, 2 * linear + attention_backward_factor(s.attn) * attention))
    return out


def projection_times(shape: ModelShape, s: Setup, p: DeviceProfile) -> list[float]:
    """Each decoder layer's forward of the projections its recompute reads (seconds on profile `p`): what policy
    auto's `sac` choice saves; a dense MLP's down projection is not read (torch's early stop ends the recompute
    before it)."""
    rate = p.tflops * 1e12
    out = []
    for i in range(shape.layers):
        moe = is_moe_layer(shape, i)
        read = _active_layer_parameters(shape, moe) - (0 if moe else shape.hidden * shape.intermediate)
        out.append(2 * read * s.tokens / rate)
    return out


def step_time(shape: ModelShape, s: Setup, p: DeviceProfile, offloaded_layer_bytes: list[int],
              local_world_size: int) -> StepTime:
    """The predicted step of `s` on profile `p`; `offloaded_layer_bytes[i]`: what layer i copies to the host and back
    (0 for a layer that keeps its tensors, or without hsoffload)."""
    rate = p.tflops * 1e12
    tokens = s.tokens
    q_width = shape.heads * shape.head_dim
    attention = attention_flops(shape, s)
    times = layer_times(shape, s, p)
    forward = [f for f, _ in times]
    fwd = sum(forward)
    recompute = fwd if s.checkpointing else 0.0
    backward = sum(b for _, b in times)
    head = 3 * 2 * shape.hidden * shape.vocab * tokens / rate  # forward and its two backward matmuls
    parts: dict[str, float] = {"forward": fwd, "recompute": recompute, "backward": backward, "head": head}

    link = copy_bandwidth(p, local_world_size)
    moved = [b for b in offloaded_layer_bytes if b]
    if moved:
        n = len(moved)
        per_copy = sum(moved) / n / link
        layer_fwd = fwd / shape.layers
        layer_bwd = (recompute + backward) / shape.layers
        parts["exposed_d2h"] = costs.copies_out_exposed_s(n, shape.layers, layer_fwd, per_copy, head)
        # Prefetching `prefetch_depth` layers ahead absorbs jitter; it cannot raise the copies' throughput: a copy
        # slower than its layer's compute shows, whatever the depth.
        parts["exposed_h2d"] = costs.restores_exposed_s(n, layer_bwd, per_copy)

    # Collectives.
    nodes = max(1, s.world_size // max(1, local_world_size))
    bw = (p.inter_node_gbps if nodes > 1 else p.intra_node_gbps) * GB
    if s.fsdp and s.world_size > 1:
        shard = (s.world_size - 1) / s.world_size
        layer_bytes = [shape.layer_parameters(is_moe_layer(shape, i)) * s.dtype_bytes * shard
                       for i in range(shape.layers)]
        gathers = 2 if s.checkpointing else 1  # forward and recompute
        exposed = sum(max(0.0, gathers * b / bw - f * gathers) for b, f in zip(layer_bytes, forward))
        exposed += sum(max(0.0, b / bw - 2 * f) for b, f in zip(layer_bytes, forward))  # reduce-scatter
        parts["fsdp_collectives"] = exposed
    if s.sequence_parallel > 1:
        d = s.sequence_parallel
        a2a_bw = (p.inter_node_gbps if d > local_world_size else p.intra_node_gbps) * GB
        if s.sequence_parallel_kind == "ulysses":
            kv = shape.kv_heads * shape.head_dim
            per_layer = (2 * q_width + 2 * kv) * tokens * s.dtype_bytes * (d - 1) / d / a2a_bw
            passes = 2 + (1 if s.checkpointing else 0)  # forward, recompute, and the gradients in backward
            parts["ulysses_all_to_all"] = shape.layers * per_layer * passes
        else:
            kv = 2 * shape.kv_heads * shape.head_dim * tokens * s.dtype_bytes
            attn_time = attention / rate
            passes = 3 + (1 if s.checkpointing else 0)
            parts["ring_exchanges"] = shape.layers * passes * max(0.0, (d - 1) * kv / a2a_bw - attn_time)
    # The optimizer step.
    states = model_states_device_bytes(shape, s)
    if s.states_on_host:
        params = shape.parameters() / (s.world_size if s.fsdp else 1)
        # The gradients go down after every micro-batch's backward (accumulated on the host); Adam runs on the host
        # and the weights come up once per optimizer step.
        parts["gradients_to_host"] = params * s.dtype_bytes / link
        parts["optimizer_on_host"] = params / p.host_adam_params_per_s + params * s.dtype_bytes / link
    else:
        parts["optimizer"] = 2 * states / (p.hbm_gbps * GB)  # read and write every state once
    if s.grad_accum > 1:  # every micro-batch runs the layers, copies and collectives; the optimizer steps once
        parts = {k: v if k.startswith("optimizer") else v * s.grad_accum for k, v in parts.items()}
    return StepTime(total_s=sum(parts.values()), parts=parts)
