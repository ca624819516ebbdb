"""One decoder layer's activations (what it saves, its working sets in forward and backward), the head's and the
embedding's: one function per term, for the peak model (hsoffload.planning.memory)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from .model import (
    F32, ModelShape, Setup)

# ---------------------------------------------------------------------------------------------------------------
# Activations of one decoder layer (T tokens on this rank)


def hidden_bytes(shape: ModelShape, s: Setup) -> int:
    """One hidden-state tensor: tokens x hidden in the dtype (a checkpointed layer's input; a gradient in flight)."""
    return s.tokens * shape.hidden * s.dtype_bytes


def norm_saved_bytes(width: int, tokens: int, b: int, with_input: bool = False, output_saved: bool = True) -> int:
    """What one RMSNorm over `width` saves (transformers': upcast, normalise, cast back, scale): the normalised tensor
    in the dtype and the output (when the next op saves it: a projection does, RoPE's multiplication by cos/sin does
    not), and when the dtype is narrower the float32 copy of its input (the float32 normalised tensor is not saved:
    its cast back saves nothing); `with_input`: also its input when that is the float32 copy itself (held by no one
    else)."""
    saved = tokens * width * ((2 if output_saved else 1) * b + (F32 if b < F32 else 0))
    return saved + (tokens * width * b if with_input and b >= F32 else 0)


def liger_norm_saved_bytes(width: int, rows: int, tokens: int, b: int, input_held: bool,
                           output_saved: bool = True) -> int:
    """What Liger's RMSNorm saves (LigerRMSNormFunction: its input X in the dtype, the weight, one float32 inverse
    RMS per row), plus its output when the next op saves it; the input only when no one else holds it already (a
    checkpointed layer's input is held as that)."""
    saved = rows * F32 + (tokens * width * b if output_saved else 0)
    return saved + (0 if input_held else tokens * width * b)


def norm_bytes(width: int, s: Setup, with_input: bool = False, output_saved: bool = True) -> int:
    """One RMSNorm over `width` per token: transformers' (`norm_saved_bytes`) or Liger's (`liger_norm_saved_bytes`,
    one row per token) as `s.fused_kernels` says; `with_input`: its input is held by no one else."""
    if s.liger:
        return liger_norm_saved_bytes(width, s.tokens, s.tokens, s.dtype_bytes, input_held=not with_input,
                                      output_saved=output_saved)
    return norm_saved_bytes(width, s.tokens, s.dtype_bytes, with_input=with_input, output_saved=output_saved)


def sac_elements_per_token(shape: ModelShape) -> int:
    """Elements per token that policy "sac" keeping every projection's matmul output saves in one layer."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    mlp = 2 * shape.intermediate if not shape.moe_layers else 2 * shape.expert_intermediate * shape.experts_per_token
    return q + 2 * kv + shape.hidden + mlp + shape.hidden


def sac_copied_elements_per_token(shape: ModelShape, moe: bool) -> int:
    """Elements per token of one layer's projection outputs that policy auto's `sac` choice copies to the host: every
    projection's (a dense MLP's down projection's too: its output is never read by the recompute, but it is copied in
    a sac layer's first step, and every step on torch releases that ask the policy again in the recompute); an MoE
    layer's router logits, its experts' (gate, up, down per expert a token goes to) and its shared expert's (gate, up,
    down, and its one-wide gate)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if not moe:
        return q + 2 * kv + shape.hidden + 2 * shape.intermediate + shape.hidden
    experts = shape.experts_per_token * (2 * shape.expert_intermediate + shape.hidden) + shape.experts
    si = shape.shared_expert_intermediate
    shared = 2 * si + shape.hidden + 1 if si else 0
    return q + 2 * kv + shape.hidden + experts + shared


def _local_heads(shape: ModelShape, s: Setup) -> int:
    return shape.heads // s.sequence_parallel


def attention_quadratic_bytes(shape: ModelShape, s: Setup) -> int:
    """One S x S score tensor per head on this rank (math/eager attention): in the dtype for eager, in float32 for
    math (SDPA's math fallback upcasts half and bfloat16 inputs unless allow_fp16_bf16_reduction_math_sdp)."""
    b = F32 if s.attn == "math" else s.dtype_bytes
    return s.micro_batch * _local_heads(shape, s) * s.seq_len * s.seq_len * b


def attention_mask_bytes(shape: ModelShape, s: Setup) -> int:
    """The additive causal mask: eager attention's 4-D mask (batch x 1 x S x S, alive through the step under
    checkpointing), math SDPA's float32 S x S one built per call (plus its boolean source)."""
    if s.attn == "eager":
        return s.micro_batch * s.seq_len * s.seq_len * s.dtype_bytes
    if s.attn == "math":
        return s.seq_len * s.seq_len * (F32 + 1)
    return 0


def attention_saved_bytes(shape: ModelShape, s: Setup) -> int:
    """What the attention block saves for backward: q/k/v after RoPE (and their QK-norm tensors), the kernel's saved
    tensors, o_proj's input; math/eager also the softmax probabilities (S x S per head)."""
    t, b = s.tokens, s.dtype_bytes
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    # QK-norm's output goes into RoPE, whose products save only cos and sin (which need no gradient)
    qk_norm = 0
    if shape.qk_norm and s.liger:  # its input is the projection's output, held by no one else; one row per head
        qk_norm = liger_norm_saved_bytes(q + kv, t * (shape.heads + shape.kv_heads), t, b, input_held=False,
                                         output_saved=False)
    elif shape.qk_norm:
        qk_norm = norm_saved_bytes(q + kv, t, b, with_input=True, output_saved=False)
    if s.attn in ("sdpa", "flash"):
        # q, k, v (GQA's k and v not repeated), the output (tokens-major already: making it contiguous for o_proj
        # copies nothing, so o_proj saves the same tensor), logsumexp
        return qk_norm + t * (q + 2 * kv + q) * b + t * shape.heads * F32
    if s.attn == "math":  # scaled q and k, v repeated to every head, probabilities: float32
        kernel = t * 3 * q * F32 + attention_quadratic_bytes(shape, s)
    else:  # eager: k and v repeated to every head; float32 softmax, cast back to the dtype when narrower
        quad = attention_quadratic_bytes(shape, s)
        kernel = t * 3 * q * b + quad * F32 // b + (quad if b < F32 else 0)
    return qk_norm + kernel + t * q * b  # + o_proj's input (the head-major output made contiguous)


def attention_forward_transient_bytes(shape: ModelShape, s: Setup) -> int:
    """Beyond what attention saves, the most its forward has in flight: math/eager, one more score tensor per head
    (the masked scores beside the probabilities; eager in a narrower dtype also their float32 copy for the
    softmax); sdpa/flash, the kernel's output before it is made contiguous."""
    if s.attn in ("sdpa", "flash"):
        return s.tokens * shape.heads * shape.head_dim * s.dtype_bytes
    quad = attention_quadratic_bytes(shape, s)
    if s.attn == "eager" and s.dtype_bytes < F32:
        return quad + quad * F32 // s.dtype_bytes
    return quad


def attention_backward_transient_bytes(shape: ModelShape, s: Setup) -> int:
    """Gradients in flight in attention's backward: math/eager, the probabilities' gradient and the scores'
    (S x S per head each, float32 in eager's softmax), beside the saved float32 probabilities (eager's copy in the
    dtype is released by then); sdpa/flash, dq, dk, dv and the output's gradient."""
    t, b = s.tokens, s.dtype_bytes
    if s.attn in ("sdpa", "flash"):
        return t * (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim * b
    quad = attention_quadratic_bytes(shape, s)
    if s.attn == "math":
        return 2 * quad
    return 2 * quad * F32 // b - (quad if b < F32 else 0)


def ulysses_buffer_bytes(shape: ModelShape, s: Setup) -> int:
    """Ulysses sequence parallelism: one all-to-all buffer of q, k, v and the output, on top of their tensors; key/value
    heads fewer than D are replicated to D first (DeepSpeed's UlyssesSPAttentionHF), so k and v count max(kv heads,
    D) heads."""
    if s.sequence_parallel == 1 or s.sequence_parallel_kind != "ulysses":
        return 0
    kv_heads = max(shape.kv_heads, s.sequence_parallel)
    return s.tokens * (2 * shape.heads + 2 * kv_heads) * shape.head_dim * s.dtype_bytes


def ring_buffer_bytes(shape: ModelShape, s: Setup) -> int:
    """Ring attention (torch's context parallel): the key/value chunk being used and the one being received (each
    tokens-per-rank long, key/value heads), and in backward also their gradients travelling with them (counted
    once: the larger of the two phases, an upper bound for both); the partial outputs are merged in float32 (one
    output-sized float32 accumulator and its logsumexp)."""
    if s.sequence_parallel == 1 or s.sequence_parallel_kind != "ring":
        return 0
    t, b = s.tokens, s.dtype_bytes
    kv_chunk = t * 2 * shape.kv_heads * shape.head_dim * b
    merge = t * shape.heads * (shape.head_dim + 1) * F32
    return 2 * kv_chunk + 2 * kv_chunk + merge


def sequence_parallel_buffer_bytes(shape: ModelShape, s: Setup) -> int:
    """The communication buffers of whichever sequence parallelism runs (0 without)."""
    return ulysses_buffer_bytes(shape, s) + ring_buffer_bytes(shape, s)


def routing_weight_bytes(shape: ModelShape, s: Setup) -> int:
    """Bytes per element of the routing weights and of the routed outputs weighted by them (float32 when the
    router hands over float32 weights: the product promotes)."""
    return F32 if shape.routing_weights_float32 else s.dtype_bytes


def mlp_saved_bytes(shape: ModelShape, s: Setup, moe: bool) -> int:
    """What the MLP saves for backward. Dense gated MLP: gate, act(gate), up, their product (4 x intermediate per
    token; Liger's SwiGLU saves gate and up only, recomputing act in backward, and down_proj the product: 3). MoE (transformers' expert loop): per routed token the gathered input, gate_up, act, product, the
    expert's output and its weighted output (which `index_add_`'s backward keeps for its shape), plus the router's
    float32 probabilities and a shared expert; grouped_mm keeps the gathered input instead of the weighted output (see
    below). With tiled_mlp N only the input is saved (each chunk is recomputed
    in backward)."""
    t, b = s.tokens, s.dtype_bytes
    if s.tiled_mlp > 1:
        return t * shape.hidden * b
    if not moe:
        return (3 if s.liger else 4) * t * shape.intermediate * b
    shared = 4 * t * shape.shared_expert_intermediate * b
    routed_tokens = t * shape.experts_per_token
    router_input = t * (shape.hidden + shape.experts) * F32 if shape.router_input_float32 else 0
    if s.experts_implementation == "grouped_mm":
        # Per routed token: the gathered input and the down projection's output (hidden each), gate_up, act and
        # their product (4 x intermediate); the routing weight and three int64 indices (the gather's, the weights'
        # and the inverse permutation's); the router's float32 probabilities and top-k values and indices (and a
        # float32 copy of its input with float32 scores, for routers that upcast).
        w = routing_weight_bytes(shape, s)
        routed = routed_tokens * ((2 * shape.hidden + 4 * shape.expert_intermediate) * b + w + 3 * 8)
        router = t * shape.experts * F32 + routed_tokens * (F32 + 8) + router_input
        return routed + router + shared
    routed = routed_tokens * (3 * shape.hidden + 4 * shape.expert_intermediate) * b
    router = t * shape.experts * (b + F32) + router_input
    return routed + router + shared


def moe_routing_bytes(shape: ModelShape, s: Setup, moe: bool) -> int:
    """The routed-token bookkeeping of an MoE block's forward, alive while its experts run and freed with it. The
    expert loop: the int64 one-hot expert mask (tokens x experts-per-token x (experts + 1)), the top-k indices (int64)
    and weights (the dtype), and the output accumulator the routed tokens are added into. grouped_mm: the routed
    outputs twice over (weighted, then in token order) and the sort's bookkeeping."""
    if not moe:
        return 0
    t, k = s.tokens, shape.experts_per_token
    if s.experts_implementation == "grouped_mm":
        # The weighted outputs and their copy back in token order (routed tokens x hidden each, float32 with float32
        # routing weights) before the top-k sum; the sort's int64 keys and permutation, histc's float32 input, the
        # inverse permutation's arange.
        return 2 * t * k * shape.hidden * routing_weight_bytes(shape, s) + t * k * (3 * 8 + F32)
    return t * k * (shape.experts + 1) * 8 + t * k * (8 + s.dtype_bytes) + hidden_bytes(shape, s)


def mlp_forward_live_bytes(shape: ModelShape, s: Setup, moe: bool) -> int:
    """The MLP's tensors alive at once in a forward without grad (checkpointing's first forward). Dense: three
    intermediates (eager: act, up and their product, gate freed; Liger's SwiGLU: gate, up and the product), one
    chunk's when tiled. MoE, expert loop: three quarters of what it would save, and its routing bookkeeping;
    grouped_mm: the gathered input with gate_up, act and product, or with the down projection's output and the
    routing bookkeeping, whichever is more."""
    t, b = s.tokens, s.dtype_bytes
    if not moe:
        return 3 * t * shape.intermediate * b // max(1, s.tiled_mlp)
    if s.experts_implementation == "grouped_mm":
        # The gathered input is a local of the experts' forward until it returns; with it either gate_up, act and
        # their product, or (at the end) the down projection's output and the routing bookkeeping. Per chunk when
        # tiled.
        untiled = dataclasses.replace(s, tiled_mlp=1)
        routed = t * shape.experts_per_token
        gate = routed * (shape.hidden + 4 * shape.expert_intermediate) * b
        end = 2 * routed * shape.hidden * b + moe_routing_bytes(shape, untiled, moe)
        live = max(gate, end) + 4 * t * shape.shared_expert_intermediate * b
        return live // max(1, s.tiled_mlp)
    saved = mlp_chunk_bytes(shape, s, moe) if s.tiled_mlp > 1 else mlp_saved_bytes(shape, s, moe)
    return saved * 3 // 4 + moe_routing_bytes(shape, s, moe)


def mlp_chunk_bytes(shape: ModelShape, s: Setup, moe: bool) -> int:
    """With tiled_mlp: one chunk's recompute (what the untiled MLP would save, for tokens / N)."""
    untiled = dataclasses.replace(s, tiled_mlp=1)
    return mlp_saved_bytes(shape, untiled, moe) // s.tiled_mlp if s.tiled_mlp > 1 else 0


def mlp_backward_transient_bytes(shape: ModelShape, s: Setup, moe: bool) -> int:
    """Gradients in flight in the MLP's backward: the product's, then act's and up's (two intermediates more than
    it saves, per chunk when tiled; Liger's SwiGLU writes gate's and up's gradients into their saved tensors: one);
    MoE: also one expert's weight gradient made full-size by indexing the stacked
    expert weights (select backward) before it is accumulated."""
    t, b = s.tokens, s.dtype_bytes
    if moe and s.experts_implementation == "grouped_mm":
        return grouped_mm_backward_transient_bytes(shape, s)
    inter = shape.intermediate if not moe else shape.expert_intermediate
    routed_tokens = t if not moe else t * shape.experts_per_token // max(1, shape.experts)
    grads = 1 if s.liger and not moe else 2
    if s.tiled_mlp > 1:
        extra = grads * t * inter * b // s.tiled_mlp + mlp_chunk_bytes(shape, s, moe)
    else:
        extra = grads * routed_tokens * inter * b
    if moe:
        extra += 3 * shape.hidden * shape.expert_intermediate * shape.experts * b
    return extra


def grouped_mm_backward_transient_bytes(shape: ModelShape, s: Setup) -> int:
    """grouped_mm's backward beyond what the block saves, in two stages; the phase already counts the layer's expert
    weight gradients (3 x experts x hidden x intermediate), which the stages may not have yet. First the down
    projection's end: the output's gradient put back in expert order, the gradient through the routing weights and
    their product with the saved output (three routed x hidden, float32 with float32 routing weights), before any
    expert gradient exists. Then the gated product's backward: the gradients of the product, act and up (three
    routed x intermediate) against the product and the down projection's output freed, with down_proj's gradient
    made (one third of the expert gradients). Further on (gate_up's backward) what is in flight is no larger than
    what was freed. Per chunk when tiled. Assumes the expert gradients do not exist before the layer's backward
    (one micro-batch per step, gradients set to None: the step's general assumption)."""
    routed = s.tokens * shape.experts_per_token // max(1, s.tiled_mlp)
    b = s.dtype_bytes
    # An adapter run's experts are frozen: no gradients of theirs
    expert_gradients = (0 if s.frozen_base
                        else 3 * shape.experts * shape.hidden * shape.expert_intermediate * b // s.shards)
    down_end = 3 * routed * shape.hidden * routing_weight_bytes(shape, s) + mlp_chunk_bytes(shape, s, True)
    gated = (routed * (2 * shape.expert_intermediate - shape.hidden) * b + mlp_chunk_bytes(shape, s, True)
             + expert_gradients // 3)
    return max(0, max(down_end, gated) - expert_gradients)


def layer_saved_bytes(shape: ModelShape, s: Setup, moe: bool) -> int:
    """Everything one decoder layer saves for backward, its input excluded: what it holds without checkpointing,
    and what its recompute materialises with it."""
    b = s.dtype_bytes
    norms = shape.norms_per_layer * norm_bytes(shape.hidden, s)
    # The attention block's residual sum, the second norm's input: saved by it in float32; in a narrower dtype the
    # norm saves its float32 copy (counted in `norms`) and the sum itself is held by no one; Liger's norm saves it.
    mid_residual = hidden_bytes(shape, s) if b >= F32 or s.liger else 0
    return norms + mid_residual + attention_saved_bytes(shape, s) + mlp_saved_bytes(shape, s, moe)


def layer_backward_bytes(shape: ModelShape, s: Setup, moe: bool, offloaded: bool = True) -> int:
    """The most one layer's backward (after its recompute) has on the device, its input excluded. Autograd frees each
    node's saved tensors once it ran, so the MLP's are gone when attention's backward runs: the larger of
    (everything saved + the MLP's gradients in flight, or an MoE recompute's routing bookkeeping) and (first norm +
    attention saved + attention's gradients in flight), each with the two residual gradients (of the layer's output
    and of its mid residual)."""
    residual_grads = 2 * hidden_bytes(shape, s)
    # The copies each save makes of its own come back with the layer; the probabilities' second copy is counted with
    # the prefetched layer only (held_per_layer_bytes): the emulated allocator's peaks show it once, not twice.
    attention_copies, mlp_copies, _ = unshared_save_parts(shape, s, moe, offloaded)
    mlp_stage = (layer_saved_bytes(shape, s, moe) + attention_copies + mlp_copies
                 + max(mlp_backward_transient_bytes(shape, s, moe), moe_routing_bytes(shape, s, moe)))
    attention_stage = (norm_bytes(shape.hidden, s) + attention_saved_bytes(shape, s) + attention_copies
                       + attention_backward_transient_bytes(shape, s) + sequence_parallel_buffer_bytes(shape, s))
    return max(mlp_stage, attention_stage) + residual_grads


def layer_forward_transient_bytes(shape: ModelShape, s: Setup, moe: bool) -> int:
    """The most one layer's forward has in flight beyond what it saves. With checkpointing nothing is saved in the
    first forward: the layer's tensors come and go, the largest set being attention's (its would-be saved tensors
    and transients) or the MLP's (`mlp_forward_live_bytes`). Without checkpointing: attention's transients, or an
    MoE block's routing bookkeeping."""
    extra = (attention_forward_transient_bytes(shape, s) + sequence_parallel_buffer_bytes(shape, s)
             + hidden_bytes(shape, s))
    if s.checkpointing:
        return max(attention_saved_bytes(shape, s) + extra, mlp_forward_live_bytes(shape, s, moe)
                   + hidden_bytes(shape, s))
    return max(extra, moe_routing_bytes(shape, s, moe))


def unshared_save_parts(shape: ModelShape, s: Setup, moe: bool, offloaded: bool = True) -> tuple[int, int, int]:
    """Policy "all" without checkpointing, `share_copies` off: what one layer's saves copy beyond `layer_saved_bytes`
    because each save gets a copy of its own (hsoffload's default, docs/design.md "Copy sharing") where several ops
    save one tensor, as (attention block, MLP block, attention probabilities). Attention: the first norm's output
    (q, k and v projections: two more), its float32 input and rsqrt (its pow and mul; rsqrt and mul), QK-norm's
    likewise, rotary cos and sin (q's and k's products: two each, per layer), sdpa/flash's output (o_proj saves it
    again). MLP: the second norm's output (a dense MLP's gate and up: one more; an MoE block's router alone saves it
    -- its experts gather their tokens --, a shared expert's gate and up two more, Qwen2-MoE's shared-expert gate
    one more) and its float32 input and rsqrt; an MoE block's fused gate_up output, whose two chunks are saved by
    two ops (act and the product): each copies the whole output (it spans nearly all of it), one more per routed
    token. A layer that keeps its tensors on the device (`keep_last_layers`, `offloaded` False) copies nothing. Probabilities: math's and eager float32's (softmax and the matmul with v). Liger's norms
    and RoPE are one node each (their saves share). Zeros when nothing is offloaded this way."""
    if s.checkpointing or s.policy is None or not s.policy.offloads_every_save or s.share_copies or not offloaded:
        return 0, 0, 0
    t, b = s.tokens, s.dtype_bytes
    norm = 0 if s.liger else t * (shape.hidden + 1) * F32
    attention = 2 * t * shape.hidden * b + norm * (shape.norms_per_layer - 1)
    if moe:
        shared = (2 + shape.text_model_type.startswith("qwen2_moe")) if shape.shared_expert_intermediate else 0
        mlp = shared * t * shape.hidden * b + norm + t * shape.experts_per_token * 2 * shape.expert_intermediate * b
    else:
        mlp = t * shape.hidden * b + norm
    if not s.liger:
        if shape.qk_norm:
            attention += t * (shape.heads + shape.kv_heads) * (shape.head_dim + 1) * F32
        attention += 4 * t * shape.head_dim * b  # cos and sin, each saved by q's and k's products
    if s.attn in ("sdpa", "flash"):
        attention += t * shape.heads * shape.head_dim * b
    probabilities = attention_quadratic_bytes(shape, s) if s.attn == "math" or (s.attn == "eager" and b >= F32) else 0
    return attention, mlp, probabilities


def unshared_save_bytes(shape: ModelShape, s: Setup, moe: bool, offloaded: bool = True) -> int:
    """The host bytes one layer's saves copy beyond `layer_saved_bytes` (`unshared_save_parts`, all of them)."""
    return sum(unshared_save_parts(shape, s, moe, offloaded))


def held_per_layer_bytes(shape: ModelShape, s: Setup, moe: bool, offloaded: bool = True) -> int:
    """What backward holds for one layer between its forward and its backward: the checkpointed input (policy
    "sac": also the projections' outputs), or without checkpointing everything the layer saves and its input (with
    policy "all", the copies each save makes of its own: `unshared_save_bytes`)."""
    if not s.checkpointing:
        return (layer_saved_bytes(shape, s, moe) + hidden_bytes(shape, s)
                + unshared_save_bytes(shape, s, moe, offloaded))
    sac = s.selective_checkpointing or (s.policy is not None and s.policy.offloads_sac_saves)
    per_token = shape.hidden + (sac_elements_per_token(shape) if sac else 0)
    return s.tokens * per_token * s.dtype_bytes


# ---------------------------------------------------------------------------------------------------------------
# Head, loss and embeddings


def loss_chunk_tokens(shape: ModelShape, s: Setup) -> int:
    """Liger's fused linear cross-entropy chunk: next power of two of tokens / ceil(vocab / hidden)."""
    chunks = math.ceil(shape.vocab / shape.hidden)
    return min(s.tokens, 1 << max(0, math.ceil(math.log2(max(1, math.ceil(s.tokens / chunks))))))


def logits_bytes(shape: ModelShape, s: Setup) -> int:
    """The logits in the dtype: tokens x vocab (0 with a chunked loss)."""
    return 0 if s.chunked_loss else s.tokens * shape.vocab * s.dtype_bytes


def head_saved_bytes(shape: ModelShape, s: Setup) -> int:
    """What the head saves for backward: the final norm's tensors and input, and the loss's float32 log-probabilities
    (with a chunked loss: the input's gradient, computed in forward)."""
    norm = norm_bytes(shape.hidden, s, with_input=True)
    if s.chunked_loss:
        return norm + hidden_bytes(shape, s)
    return norm + s.tokens * shape.vocab * F32


def head_forward_transient_bytes(shape: ModelShape, s: Setup) -> int:
    """In flight at the loss: the logits and their float32 copy (the same tensor in float32); chunked (Liger's
    fused linear cross-entropy): one chunk's logits, whose gradient the kernel writes in place, and the head's
    weight-gradient accumulator."""
    if s.chunked_loss:
        chunk = loss_chunk_tokens(shape, s) * shape.vocab
        return chunk * s.dtype_bytes + shape.vocab * shape.hidden * s.dtype_bytes
    upcast = s.tokens * shape.vocab * F32 if s.dtype_bytes < F32 else 0
    return logits_bytes(shape, s) + upcast


def head_backward_transient_bytes(shape: ModelShape, s: Setup) -> int:
    """In flight in the head's backward: the loss's gradient and the logits' (float32), beside the saved
    log-probabilities (their cast to a narrower dtype comes after those two are freed: less); then the hidden
    states' gradient. Chunked: none beyond what it saved."""
    if s.chunked_loss:
        return hidden_bytes(shape, s)
    return 2 * s.tokens * shape.vocab * F32 + hidden_bytes(shape, s)


def head_parts(shape: ModelShape, s: Setup) -> dict[str, dict[str, int]]:
    """The head's bytes in its forward (at the loss) and backward phases, by part, for the phase table."""
    norm = norm_bytes(shape.hidden, s, with_input=True)
    if s.chunked_loss:
        saved = hidden_bytes(shape, s)
        return {"forward": {"final_norm": norm, "chunked_loss": saved + head_forward_transient_bytes(shape, s)},
                "backward": {"final_norm": norm, "chunked_loss": saved + head_backward_transient_bytes(shape, s)}}
    tv = s.tokens * shape.vocab
    upcast = tv * F32 if s.dtype_bytes < F32 else 0
    return {
        "forward": {"final_norm": norm, "logits": logits_bytes(shape, s), "logits_float32": upcast,
                    "log_probs": tv * F32},
        "backward": {"final_norm": norm, "log_probs": tv * F32,
                     "logits_gradients": head_backward_transient_bytes(shape, s)},
    }


def embedding_bytes(shape: ModelShape, s: Setup) -> int:
    """The embedding's output (the first layer's input; counted as held by that layer) and, in its backward, the
    embedding's weight gradient (vocab x hidden), counted in the gradients."""
    return hidden_bytes(shape, s)
