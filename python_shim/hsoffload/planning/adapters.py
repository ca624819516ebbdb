"""Model states of the runs users make beside a full fine-tune: LoRA and QLoRA adapters over a frozen base (a 4-bit
one for QLoRA), and bitsandbytes' 8-bit and paged optimizers. Bytes for hsoffload.planning.memory's model-state
terms; stdlib only. What each count assumes:

- LoRA (PEFT): each targeted linear of d_in x d_out gains A (r x d_in) and B (d_out x r), in float32 (PEFT's
  `autocast_adapter_dtype=True`, its default since 0.12, upcasts bf16/fp16 adapters); the base weights are frozen:
  no gradients, no optimizer states. Only the adapters train (their gradients float32, their optimizer states by
  the optimizer). The output head and the embedding stay frozen (no `modules_to_save`).
- QLoRA (bitsandbytes `Linear4bit`, nf4, as transformers' `BitsAndBytesConfig(load_in_4bit=True)` quantises a
  model): every decoder layer's linear weight (not the embedding, the head, the norms or biases) of n elements is
  ceil(n / 2) packed bytes, one absmax per block of 64 (float32; with double quantisation a uint8, plus one
  float32 absmax per 256 of those and one float32 offset) and its 16-entry nf4 code table (float32). The dynamic
  map double quantisation shares across weights (1 KiB) is not counted.
- bitsandbytes' 8-bit AdamW (`adamw_8bit`): two uint8 moments per parameter and one float32 absmax per moment and
  block of 256; its update is one fused kernel (no temporaries). Tensors under bitsandbytes' `min_8bit_size`
  (4,096 elements: the norms) keep float32 moments in truth: counted as 8-bit (a few KiB per layer less).
- Paged optimizers (`paged_adamw_8bit`, `paged_adamw_32bit`): bitsandbytes allocates the states in CUDA unified
  memory, which "automatically evicts to CPU RAM when the GPU runs out of memory" (bitsandbytes' docs, Paged
  optimizers); they are outside torch's allocator. Counted as host memory of the node, and at the optimizer step
  the largest trainable tensor's states paged in on the device.
"""

from __future__ import annotations

import math
from typing import Any

from .settings import ALL_LINEAR, LORA_MODULES

F32 = 4
ADAPTER_BYTES = F32  # bytes per adapter parameter (and per adapter gradient): float32
NF4_BLOCK = 64  # bitsandbytes' 4-bit blocksize
NF4_CODE_BYTES = 16 * F32  # the nf4 code table each quantised weight's state holds
DOUBLE_QUANT_BLOCK = 256  # double quantisation: the absmax quantised in blocks of 256
BNB_OPTIMIZER_BLOCK = 256  # bitsandbytes' blockwise 8-bit optimizer states: one float32 absmax per 256 values
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def linear_dims(shape: Any) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each linear of a dense decoder layer, by PEFT's module name."""
    q, kv, h, inter = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden, shape.intermediate
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def lora_targets(s: Any) -> tuple[str, ...]:
    """The module names LoRA targets ("all-linear": every one)."""
    names = s.lora_target_modules
    return LORA_MODULES if ALL_LINEAR in names else tuple(n for n in LORA_MODULES if n in names)


def lora_layer_parameters(shape: Any, s: Any, moe: bool) -> int:
    """One decoder layer's adapter parameters: r x (d_in + d_out) per targeted linear (an MoE layer's attention
    only: its experts' adapters are not modelled, `unmodelled_adapter_targets`)."""
    if s.adapter == "none":
        return 0
    dims = linear_dims(shape)
    return sum(s.lora_r * sum(dims[n]) for n in lora_targets(s) if not (moe and n in MLP_MODULES))


def unmodelled_adapter_targets(shape: Any, s: Any) -> list[str]:
    """What an adapter run sets that the planner cannot count: LoRA on MoE experts, a 4-bit MoE base."""
    if s.adapter == "none" or not shape.moe_layers:
        return []
    out = []
    if any(n in MLP_MODULES for n in lora_targets(s)):
        out.append("lora_target_modules (the MLP projections of MoE experts)")
    if s.adapter == "qlora":
        out.append("adapter (qlora: a 4-bit MoE base's experts)")
    return out


def nf4_bytes(elements: int, double_quant: bool) -> int:
    """One bitsandbytes nf4 weight of `elements`: packed data, absmax (double-quantised or not), code table."""
    blocks = math.ceil(elements / NF4_BLOCK)
    absmax = blocks + math.ceil(blocks / DOUBLE_QUANT_BLOCK) * F32 + F32 if double_quant else blocks * F32
    return math.ceil(elements / 2) + absmax + NF4_CODE_BYTES


def layer_weight_bytes(shape: Any, s: Any, moe: bool) -> int:
    """One decoder layer's weights on the device, unsharded: in the dtype, or (QLoRA, a dense layer) its linears
    in nf4 and the rest (norms, biases) in the dtype; plus its adapters."""
    params = shape.layer_parameters(moe)
    if s.adapter == "qlora" and not moe:
        dims = linear_dims(shape).values()
        linear = sum(i * o for i, o in dims)
        base = sum(nf4_bytes(i * o, s.double_quant) for i, o in dims) + (params - linear) * s.dtype_bytes
    else:
        base = params * s.dtype_bytes
    return base + lora_layer_parameters(shape, s, moe) * ADAPTER_BYTES


def trainable_parameters(shape: Any, s: Any, layers_moe: list[bool]) -> int:
    """What the optimizer updates: every parameter, or an adapter run's adapters."""
    if s.adapter == "none":
        return shape.parameters()
    return sum(lora_layer_parameters(shape, s, moe) for moe in layers_moe)


def trainable_bytes_per_parameter(s: Any) -> int:
    """A trainable parameter's bytes (and its gradient's): the dtype's, or float32 adapters'."""
    return ADAPTER_BYTES if s.adapter != "none" else s.dtype_bytes


def optimizer_states_of(parameters: int, per_parameter: int, s: Any) -> int:
    """The optimizer's state bytes for `parameters` trainable ones at `per_parameter` bytes each; bitsandbytes'
    8-bit states add one float32 absmax per moment and block of 256."""
    states = parameters * per_parameter
    if s.optimizer.endswith("_8bit"):
        states += math.ceil(parameters / BNB_OPTIMIZER_BLOCK) * 2 * F32
    return states


def largest_trainable_tensor(shape: Any, s: Any) -> int:
    """Elements of the largest tensor the optimizer updates (a paged optimizer pages in one tensor's states at a
    time): the embedding or a projection (an MoE layer's fused experts), or an adapter's larger matrix."""
    if s.adapter != "none":
        return max((s.lora_r * max(linear_dims(shape)[n]) for n in lora_targets(s)), default=0)
    experts = 2 * shape.experts * shape.expert_intermediate * shape.hidden if shape.moe_layers else 0
    return max(shape.vocab * shape.hidden, shape.hidden * shape.intermediate, experts)
