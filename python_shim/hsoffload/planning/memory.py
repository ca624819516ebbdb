"""The device-peak model of `hsoffload plan`: what one rank's device allocator holds at its peak during one training
step (forward, backward, optimizer step), from a transformers config alone.

The peak is the maximum over the step's phases, not a sum of maxima, so it can be compared with what an allocator
reports (`torch.cuda.max_memory_allocated()`, or the emulated device's `peak_allocated_bytes` in tests/device/emu):

- forward of decoder layer i: model states, what backward holds for layers < i, layer i's forward working set;
- head forward: everything backward holds, the final norm, the logits and the loss (float32);
- head backward: the same, the loss's and the logits' gradients, the head's parameter gradients;
- backward of decoder layer i (L-1 down to 0): model states with the gradients produced so far, what backward still
  holds for layers <= i, layer i's recompute (everything it saves) and its backward's gradients in flight;
- optimizer step: weights, gradients, optimizer states and the update's temporaries.

Every term is one function below (bytes per rank). The formulas follow how transformers (5.x) and torch compute a
Llama-style decoder layer; `tests/device/emu/test_device_peak.py` checks the predicted peak against a real allocator
within 10 % on tiny Llama, Qwen3 and Qwen3-MoE models. What they assume:

- Steady state: the optimizer's states exist, gradients were freed by ``zero_grad(set_to_none=True)``.
- Weights and gradients in the training dtype; AdamW keeps two moments per parameter in float32 (torch's AdamW
  keeps them in the parameter's dtype: a float32 model is exact, bf16 weights without float32 masters hold half);
  its foreach update allocates one moment-sized temporary.
- RMSNorm upcasts to float32 (saves a float32 copy of its input when the dtype is narrower).
- Attention ``sdpa``/``flash``: fused kernels, memory linear in the sequence (q, k, v, output, logsumexp saved);
  ``math``: SDPA's fallback on devices without fused kernels (the S x S probabilities saved per head, two more in
  flight); ``eager``: transformers' eager attention (float32 softmax, the 4-D additive mask alive through the step).
- The loss: transformers' ForCausalLMLoss (logits upcast to float32, log_softmax saved), or with ``chunked_loss`` a
  fused linear cross-entropy in chunks of Liger's size (logits never materialised, input gradient made in forward).
- Sequence parallelism (tokens per rank = micro_batch * seq / D), of two kinds: Ulysses (DeepSpeed, ALST) lets
  attention see the whole sequence for heads / D heads, plus one all-to-all buffer of q, k, v and the output (key/value
  heads fewer than D replicated); ring attention (torch's context parallel) keeps each rank's queries and passes
  key/value chunks round (two in flight, their gradients in backward, a float32 merge of the partial outputs).
- ``tiled_mlp`` N: the MLP runs in N sequence chunks and saves only its input (ALST's TiledMLP), recomputing each
  chunk in backward.
- FSDP (``fsdp`` and world_size > 1) shards weights, gradients and optimizer states; the layer being computed and
  one prefetched are gathered whole, and one layer's unsharded gradients exist before their reduce-scatter.
- Model states on the host (``cpu_offload``): "optimizer" leaves the weights and gradients on the device and puts
  the optimizer states, float32 masters and float32 gradients in pinned host memory (the step on the CPU);
  "params" also the weights (the device keeps the root's embedding and head, two gathered layers and one layer's
  gradients in flight).
- ``fused_kernels`` "liger": Liger's RMSNorm (saves its input and a float32 inverse RMS per row), SwiGLU (saves gate
  and up; the product is down_proj's input) and fused linear cross-entropy (the chunked loss), from their autograd
  functions; MoE experts are left as transformers runs them.
- MoE experts (``experts_implementation``): "grouped_mm", transformers 5.x's default (the routed tokens sorted by
  expert and gathered, one grouped GEMM per projection, the outputs weighted, put back in token order and summed
  over the top-k; checked at Qwen3-30B-A3B's real widths under FakeTensorMode), or "eager", the loop over the experts
  hit (checked on the emulated device at small widths).
- Offload (policy ``hidden_states``/``sac``): what backward holds stays on the device for the layer in backward,
  ``prefetch_depth`` restored ahead, one being copied in forward, and the last ``keep_last_layers``. Policy ``all``
  (no checkpointing): every layer's saved tensors, with the same window; the head's stay on the device.

Not counted: the CUDA context and allocator fragmentation (reserved - allocated: budget ~5-10 % more), NCCL
buffers, framework workspaces (cuBLAS, flash attention's), the input ids and labels.
"""

from __future__ import annotations

import dataclasses

# The terms by their home (model states, a layer's activations), re-exported: the peak model is where callers read them
from .activations import (  # noqa: F401
    _local_heads, attention_backward_transient_bytes, attention_forward_transient_bytes, attention_mask_bytes,
    attention_quadratic_bytes, attention_saved_bytes, embedding_bytes, grouped_mm_backward_transient_bytes,
    head_backward_transient_bytes, head_forward_transient_bytes, head_parts, head_saved_bytes, held_per_layer_bytes,
    hidden_bytes, layer_backward_bytes, layer_forward_transient_bytes, layer_saved_bytes, liger_norm_saved_bytes,
    logits_bytes, loss_chunk_tokens, mlp_backward_transient_bytes, mlp_chunk_bytes, mlp_forward_live_bytes,
    mlp_saved_bytes, moe_routing_bytes, norm_bytes, norm_saved_bytes, ring_buffer_bytes, routing_weight_bytes,
    sac_copied_elements_per_token, sac_elements_per_token, sequence_parallel_buffer_bytes, ulysses_buffer_bytes,
    unshared_save_bytes, unshared_save_parts)
from .model import (  # noqa: F401
    F32, ModelShape, OPTIMIZERS, ROUTER_INPUT_FLOAT32, ROUTING_IN_MODEL_DTYPE, STEP_SETTINGS, Setup, _SetupRules,
    _int, _moe_flags, _optimizer_states, _state_bytes_per_parameter, _trainable, base_weights_bytes,
    fsdp_gathered_bytes, fsdp_unsharded_gradient_bytes, gradients_bytes, head_gradient_bytes,
    host_state_bytes_per_parameter, is_moe_layer, layer_gradient_bytes, model_states_device_bytes,
    model_states_host_bytes, optimizer_state_bytes, optimizer_step_bytes, root_parameters, setup_from,
    shape_from_config, weights_bytes)

# ---------------------------------------------------------------------------------------------------------------
# Phases


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    total: int
    parts: dict[str, int]


def _device_layers(s: Setup, layers: int, upto: int, in_backward: bool) -> list[int]:
    """Indices of layers < `upto` (forward) or <= `upto` (backward) whose held bytes are on the device."""
    idx = range(upto + 1) if in_backward else range(upto)
    if s.policy is None:
        return list(idx)
    kept = set(range(layers - s.keep_last_layers, layers))
    # Backward: the layer in backward and `prefetch_depth` restored ahead. Forward: none (copies keep up with
    # compute: see copies_hide_behind_compute).
    window = set(range(upto - s.prefetch_depth, upto + 1)) if in_backward else set()
    return [i for i in idx if i in window or i in kept]


def phases(shape: ModelShape, s: Setup) -> list[Phase]:
    """Every phase of one step with its terms (bytes), in order."""
    moe_flags = [is_moe_layer(shape, i) for i in range(shape.layers)]
    offloaded = [i < shape.layers - s.keep_last_layers for i in range(shape.layers)]  # kept layers copy nothing
    held = [held_per_layer_bytes(shape, s, m, o) for m, o in zip(moe_flags, offloaded)]
    weights = weights_bytes(shape, s)
    opt = optimizer_state_bytes(shape, s)
    fsdp = fsdp_gathered_bytes(shape, s)
    persistent_mask = attention_mask_bytes(shape, s) if s.attn == "eager" and s.checkpointing else 0
    out: list[Phase] = []

    def add(name: str, **parts: int) -> None:
        parts = {k: v for k, v in parts.items() if v}
        out.append(Phase(name, sum(parts.values()), parts))

    base = dict(weights=weights, optimizer_states=opt, fsdp_gathered_layers=fsdp)
    step_mask = attention_mask_bytes(shape, s) if s.attn == "eager" else 0
    for i in range(shape.layers):
        held_now = sum(held[j] for j in _device_layers(s, shape.layers, i, False))
        if s.checkpointing:
            work = layer_forward_transient_bytes(shape, s, moe_flags[i])
        else:
            work = layer_saved_bytes(shape, s, moe_flags[i]) + layer_forward_transient_bytes(shape, s, moe_flags[i])
        add(f"forward layer {i}", **base, held_for_backward=held_now + hidden_bytes(shape, s),
            attention_mask=step_mask + (attention_mask_bytes(shape, s) if s.attn == "math" else 0),
            layer_working_set=work)
    all_held = sum(held[j] for j in _device_layers(s, shape.layers, shape.layers, False))
    head = head_parts(shape, s)
    add("head forward", **base, held_for_backward=all_held, attention_mask=persistent_mask, **head["forward"])
    head_grads = head_gradient_bytes(shape, s)
    add("head backward", **base, gradients=head_grads, held_for_backward=all_held, attention_mask=persistent_mask,
        **head["backward"])
    grads = 0 if s.params_on_host else head_grads  # with the weights on the host the head's leave after its backward
    for i in reversed(range(shape.layers)):
        grads += layer_gradient_bytes(shape, s, moe_flags[i])
        held_now = sum(held[j] for j in _device_layers(s, shape.layers, i, True) if j < i or s.checkpointing)
        add(f"backward layer {i}", **base, gradients=grads + fsdp_unsharded_gradient_bytes(shape, s),
            held_for_backward=held_now, attention_mask=persistent_mask,
            layer_working_set=layer_backward_bytes(shape, s, moe_flags[i], offloaded[i]))
    add("optimizer step", weights=weights, optimizer_states=opt, gradients=gradients_bytes(shape, s),
        optimizer_update=optimizer_step_bytes(shape, s))
    return out




def peak(shape: ModelShape, s: Setup) -> Phase:
    """The phase with the most bytes on the device."""
    return max(phases(shape, s), key=lambda p: p.total)
