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
import math
from typing import Any, Optional

from ..options import PolicyName
from .settings import SETTINGS, PlanError  # noqa: F401  (PlanError: its old home; the table's allowed values)
from .settings import OPTIMIZERS as OPTIMIZER_NAMES
from . import adapters

F32 = 4
# Optimizer state per trainable parameter, by the table's optimizer names (hsoffload.planning.settings): bytes, or
# None for "two moments in the parameter's dtype" (torch.optim.AdamW on bf16 parameters without float32 master
# weights). "adamw_master": DeepSpeed's bf16/fp16 mixed precision on the device: float32 master weights beside the two
# moments. bitsandbytes' 8-bit AdamW: two uint8 moments and, per block of BNB_OPTIMIZER_BLOCK, one float32 absmax per
# moment (`optimizer_state_bytes`); its paged variants keep their states in CUDA unified memory (`paged`).
OPTIMIZERS: dict[str, Optional[int]] = {"adamw": 8, "adam": 8, "adamw_master": 12, "adamw_param_dtype": None,
                                        "adamw_8bit": 2, "paged_adamw_8bit": 2, "paged_adamw_32bit": 8, "sgd": 0,
                                        "sgd_momentum": 4}
assert set(OPTIMIZERS) == set(OPTIMIZER_NAMES), "memory.OPTIMIZERS must cover settings.OPTIMIZERS"
# The allowed values of the settings below live in the planner's table (hsoffload.planning.settings).
# cpu_offload: "optimizer" (optimizer states, float32 master weights and float32 gradients on the host,
# the step on the CPU: ZeRO-Offload's offload_optimizer), "params" (also the weights: FSDP2 CPUOffloadPolicy, ZeRO-3
# offload_param; the device holds only the layers gathered for compute). fused_kernels "liger": Liger's RMSNorm,
# SwiGLU and fused linear cross-entropy, as TRL's use_liger_kernel or Axolotl's liger_* keys turn them on.
# sequence_parallel_kind: "ulysses" (DeepSpeed Ulysses / ALST: all-to-all to whole sequences for heads / D heads),
# "ring" (ring attention, torch's context parallel: each rank keeps its queries and passes key/value chunks round).
# experts_implementation (transformers'): "grouped_mm" (5.x's default: tokens sorted by expert, one grouped GEMM per
# projection) or "eager" (a loop over the experts hit, as in transformers 4.x and 5.x's "eager").


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that memory depends on, read from its config.json."""

    model_type: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    qk_norm: bool = False  # RMSNorm on q and k (Qwen3, Gemma3: per head; OLMo2: over all heads)
    qk_norm_params: int = 0
    norms_per_layer: int = 2  # Gemma2/3: four (pre and post of attention and MLP)
    attention_bias: bool = False
    experts: int = 0  # routed experts per MoE layer; 0: a dense model
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    moe_layers: int = 0
    text_model_type: str = ""  # the decoder's own model_type (the text part's for multimodal configs)
    routing_weights_float32: bool = True  # the router hands the experts float32 weights (see ROUTING_IN_MODEL_DTYPE)
    router_input_float32: bool = False  # the router saves a float32 copy of its input (ROUTER_INPUT_FLOAT32)
    # Carried for building the model (hsoffload.tools): memory depends on neither.
    max_positions: int = 4096
    rope_theta: float = 10000.0

    @classmethod
    def llama(cls, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int, layers: int,
              max_positions: int = 4096, rope_theta: float = 10000.0) -> "ModelShape":
        """A Llama decoder's shape (untied head, head_dim = hidden / heads)."""
        return cls(model_type="llama", layers=layers, hidden=hidden, intermediate=intermediate, heads=heads,
                   kv_heads=kv_heads, head_dim=hidden // heads, vocab=vocab, tied_embeddings=False,
                   text_model_type="llama", max_positions=max_positions, rope_theta=rope_theta)

    def to_config(self) -> dict[str, Any]:
        """The transformers config.json fields of this shape (`shape_from_config`'s inverse for the dense and MoE
        decoders it reads: the MoE layers last, Qwen3-MoE's keys)."""
        cfg: dict[str, Any] = {
            "model_type": self.text_model_type or self.model_type, "hidden_size": self.hidden,
            "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab, "tie_word_embeddings": self.tied_embeddings,
            "max_position_embeddings": self.max_positions, "rope_theta": self.rope_theta,
        }
        if self.attention_bias:
            cfg["attention_bias"] = True
        if self.experts:
            cfg.update(num_experts=self.experts, num_experts_per_tok=self.experts_per_token,
                       moe_intermediate_size=self.expert_intermediate,
                       mlp_only_layers=list(range(self.layers - self.moe_layers)))
            if self.shared_expert_intermediate:
                cfg["shared_expert_intermediate_size"] = self.shared_expert_intermediate
        return cfg

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    def attention_parameters(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.attention_bias else 0
        return self.hidden * (q + 2 * kv) + q * self.hidden + bias + self.qk_norm_params

    def dense_mlp_parameters(self) -> int:
        return 3 * self.hidden * self.intermediate

    def moe_parameters(self) -> int:
        """Router, routed experts and shared expert (with its gate) of one MoE layer."""
        shared_inter = self.shared_expert_intermediate
        shared = 3 * self.hidden * shared_inter + self.hidden if shared_inter else 0
        return self.hidden * self.experts + self.experts * 3 * self.hidden * self.expert_intermediate + shared

    def layer_parameters(self, moe: bool) -> int:
        mlp = self.moe_parameters() if moe else self.dense_mlp_parameters()
        return self.attention_parameters() + self.norms_per_layer * self.hidden + mlp

    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return (embeddings + self.hidden + self.dense_layers * self.layer_parameters(False)
                + self.moe_layers * self.layer_parameters(True))

    def largest_layer_parameters(self) -> int:
        return max(self.layer_parameters(True) if self.moe_layers else 0,
                   self.layer_parameters(False) if self.dense_layers else 0)


def _int(cfg: dict[str, Any], *names: str, default: Optional[int] = None) -> Optional[int]:
    for name in names:
        value = cfg.get(name)
        if value is not None:
            return int(value)
    return default


# MoE routers whose top-k weights come back in the model's dtype (transformers 5.x: they cast them back, or type_as
# the hidden states). Every other MoE family hands the experts float32 weights (Mixtral, MiniMax, GLM-4-MoE, ...):
# the weighted routed outputs, their copy in token order and the gradients through them are then float32. Unknown
# families count as float32 (more memory, never less).
ROUTING_IN_MODEL_DTYPE = frozenset({
    "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_vl_moe", "qwen3_5_moe", "qwen3_omni_moe", "olmoe", "flex_olmo",
    "ernie4_5_moe", "granitemoe", "gpt_oss",
})
# Routers that run on a float32 copy of their input (and save it, with float32 scores): F.linear(hidden.float(), ...).
ROUTER_INPUT_FLOAT32 = frozenset({"glm4_moe", "glm4_moe_lite", "dots1", "ernie4_5_moe", "hunyuan_v1_moe"})


def shape_from_config(data: dict[str, Any], source: str = "config") -> ModelShape:
    """The ModelShape of a transformers config.json's dict; multimodal configs are read through `text_config`.
    Raises PlanError (one line) for what cannot be a decoder-only causal LM or is not modelled."""
    model_type = data.get("model_type")
    if not model_type:
        raise PlanError(f"hsoffload plan: {source} has no model_type; it must be a transformers config.json")
    cfg = data
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(data.get(key), dict):
            cfg = dict(data[key])
            break
    kind = f"model_type {model_type!r}" + (f" (text part {cfg.get('model_type')!r})" if cfg is not data else "")
    if str(cfg.get("model_type", model_type)).startswith("llama4") and (cfg.get("num_local_experts") or 0) > 0:
        raise PlanError(f"hsoffload plan: {source}: {kind}: Llama 4's experts run every routed token through a "
                        "batched matmul over all experts, which the planner does not model")
    if cfg.get("kv_lora_rank") or cfg.get("q_lora_rank"):
        raise PlanError(f"hsoffload plan: {source}: {kind} uses multi-head latent attention (kv_lora_rank), which the "
                        "planner does not model")
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(cfg, "num_attention_heads", "n_head")
    vocab = _int(cfg, "vocab_size", default=_int(data, "vocab_size"))
    missing = [n for n, v in (("hidden_size", hidden), ("num_hidden_layers", layers), ("num_attention_heads", heads),
                              ("vocab_size", vocab)) if not v]
    if missing:
        raise PlanError(f"hsoffload plan: {source}: {kind} is not a decoder-only language model the planner knows "
                        f"(no {', '.join(missing)})")
    assert hidden and layers and heads and vocab
    kv_heads = _int(cfg, "num_key_value_heads", "num_kv_heads", default=heads) or heads
    head_dim = _int(cfg, "head_dim", default=hidden // heads) or hidden // heads
    for name, value in (("hidden_size", hidden), ("num_hidden_layers", layers), ("num_attention_heads", heads),
                        ("vocab_size", vocab), ("num_key_value_heads", kv_heads), ("head_dim", head_dim)):
        if value < 1:
            raise PlanError(f"hsoffload plan: {source}: {name} must be >= 1, got {value}")
    if heads % kv_heads:
        raise PlanError(f"hsoffload plan: {source}: num_attention_heads {heads} is not a multiple of "
                        f"num_key_value_heads {kv_heads}")
    experts = _int(cfg, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", default=0) or 0
    intermediate = _int(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden) or 4 * hidden
    moe_layers = 0
    per_token = expert_inter = shared_inter = 0
    if experts:
        per_token = _int(cfg, "num_experts_per_tok", "moe_topk", "top_k", default=0) or 0
        if per_token <= 0:
            raise PlanError(f"hsoffload plan: {source}: {kind} has {experts} experts but no num_experts_per_tok")
        expert_inter = _int(cfg, "moe_intermediate_size", default=intermediate) or intermediate
        shared_inter = _int(cfg, "shared_expert_intermediate_size", default=0) or 0
        if not shared_inter and cfg.get("n_shared_experts"):
            shared_inter = int(cfg["n_shared_experts"]) * expert_inter
        dense = set(cfg.get("mlp_only_layers") or [])
        step = _int(cfg, "decoder_sparse_step", default=1) or 1
        first_dense = _int(cfg, "first_k_dense_replace", default=0) or 0
        moe_layers = sum(1 for i in range(layers)
                         if i not in dense and i >= first_dense and (i + 1) % step == 0)
    tied = bool(cfg.get("tie_word_embeddings", data.get("tie_word_embeddings", True)))
    text_type = str(cfg.get("model_type", model_type))
    qk_norm = text_type.startswith(("qwen3", "olmo2", "olmo3", "gemma3"))
    qk_norm_params = 0
    if qk_norm:
        per_head = not text_type.startswith(("olmo2", "olmo3"))
        qk_norm_params = 2 * head_dim if per_head else (heads + kv_heads) * head_dim
    norms = 4 if text_type.startswith(("gemma2", "gemma3")) else 2
    label = str(model_type) if cfg is data else f"{model_type} (text model {text_type}; other towers not counted)"
    return ModelShape(
        model_type=label, layers=layers, hidden=hidden, intermediate=intermediate, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, vocab=vocab, tied_embeddings=tied, qk_norm=qk_norm,
        qk_norm_params=qk_norm_params, norms_per_layer=norms,
        attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") in ("qwen2", "qwen2_moe"))),
        experts=experts, experts_per_token=per_token, expert_intermediate=expert_inter,
        shared_expert_intermediate=shared_inter, moe_layers=moe_layers, text_model_type=text_type,
        routing_weights_float32=text_type.removesuffix("_text") not in ROUTING_IN_MODEL_DTYPE,
        router_input_float32=text_type.removesuffix("_text") in ROUTER_INPUT_FLOAT32,
        max_positions=_int(cfg, "max_position_embeddings", default=4096) or 4096,
        rope_theta=float(cfg.get("rope_theta") or 10000.0),
    )


class _SetupRules:
    """What the planner's `Setup` knows beyond its fields: derived quantities and the checks that need the model or
    several settings at once (each value alone was checked when its PlanInput was made)."""

    def __post_init__(self) -> None:
        policy = getattr(self, "policy")
        if policy is not None and not isinstance(policy, PolicyName):
            object.__setattr__(self, "policy", PolicyName.parse(policy))

    @property
    def liger(self) -> bool:
        return self.fused_kernels == "liger"

    @property
    def states_on_host(self) -> bool:
        """Optimizer states (and with "params" the weights and gradients) live on the host; the step runs there."""
        return self.cpu_offload != "none"

    @property
    def params_on_host(self) -> bool:
        return self.cpu_offload == "params"

    @property
    def tokens(self) -> int:
        """Tokens per rank after sequence parallelism."""
        return self.micro_batch * self.seq_len // self.sequence_parallel

    @property
    def shards(self) -> int:
        return self.world_size if self.fsdp and self.world_size > 1 else 1

    @property
    def frozen_base(self) -> bool:
        """An adapter run (LoRA, QLoRA): the base weights train not, only the adapters."""
        return self.adapter != "none"

    @property
    def paged(self) -> bool:
        """bitsandbytes' paged optimizer: its states in CUDA unified memory, paged in for the step."""
        return self.optimizer.startswith("paged_")

    def check(self, shape: ModelShape) -> None:
        """What several settings or the model decide together (PlanError naming the flags and the fix)."""
        if self.seq_len % self.sequence_parallel:
            raise PlanError(f"hsoffload plan: --seq-len {self.seq_len} is not divisible by --sequence-parallel "
                            f"{self.sequence_parallel}")
        if self.sequence_parallel > self.world_size:
            raise PlanError(f"hsoffload plan: --sequence-parallel {self.sequence_parallel} needs at least that many "
                            f"ranks, got --world-size {self.world_size}")
        self.check_sequence_parallel(shape)
        if self.liger and not self.chunked_loss:
            raise PlanError("hsoffload plan: --fused-kernels liger includes Liger's fused linear cross-entropy: "
                            "it needs chunked_loss (set by the CLI)")
        if self.policy is not None and self.policy.chooses_per_layer:
            raise PlanError("hsoffload plan: the memory model takes a policy per step, not auto (plan.setup_of "
                            "resolves it)")
        if self.policy is not None and self.policy.marks_layer_inputs and not self.checkpointing:
            raise PlanError(f"hsoffload plan: policy {self.policy.value!r} offloads what checkpointing keeps; with "
                            "--no-checkpointing use --policy all")
        if self.tiled_mlp > self.tokens:
            raise PlanError(f"hsoffload plan: --tiled-mlp {self.tiled_mlp} exceeds the {self.tokens} tokens per rank")

    def check_sequence_parallel(self, shape: ModelShape) -> None:
        """Ulysses gives each rank heads / D whole heads: D must divide the attention heads, and the key/value heads
        must divide by D or D by them (DeepSpeed replicates key/value heads when there are fewer than D). Ring
        attention splits no heads, but needs SDPA's fused kernels."""
        d = self.sequence_parallel
        if d == 1:
            return
        if self.sequence_parallel_kind == "ring":
            if self.attn not in ("sdpa", "flash"):
                raise PlanError(f"hsoffload plan: ring attention (--sequence-parallel-kind ring) runs SDPA's fused "
                                f"kernels chunk by chunk; --attn {self.attn} is not one: use --attn sdpa or flash")
            if self.seq_len % (2 * d):
                raise PlanError(f"hsoffload plan: ring attention splits the sequence into 2 x {d} chunks (load "
                                f"balance of the causal mask); --seq-len {self.seq_len} is not a multiple of {2 * d}")
            return
        if shape.heads % d:
            raise PlanError(f"hsoffload plan: Ulysses sequence parallelism gives each rank heads / D whole attention "
                            f"heads; --sequence-parallel {d} does not divide the {shape.heads} heads: pick a "
                            f"divisor of {shape.heads}, or --sequence-parallel-kind ring")
        if shape.kv_heads % d and d % shape.kv_heads:
            raise PlanError(f"hsoffload plan: Ulysses sequence parallelism needs the {shape.kv_heads} key/value heads "
                            f"divisible by --sequence-parallel {d} or {d} divisible by them (DeepSpeed replicates "
                            f"key/value heads only by a whole factor): pick another degree, or "
                            f"--sequence-parallel-kind ring")


# The planner's Setup: how the step runs on each rank. Its fields are the table's settings that the step's model reads
# (hsoffload.planning.settings, `step=True`), under their names, plus what the planner derives from the others:
# `policy` is resolved (None: no hsoffload; never "auto", whose figures are its leanest choice's), `dtype_bytes` is
# the dtype's, and `selective_checkpointing` says a SAC policy keeps the projections' outputs.
STEP_SETTINGS = tuple(s for s in SETTINGS if s.step)
Setup = dataclasses.make_dataclass(
    "Setup",
    [s.field() for s in STEP_SETTINGS if s.default is dataclasses.MISSING]
    + [s.field() for s in STEP_SETTINGS if s.default is not dataclasses.MISSING]
    + [("dtype_bytes", int, dataclasses.field(default=2)),
       ("selective_checkpointing", bool, dataclasses.field(default=False))],
    bases=(_SetupRules,), frozen=True,
    namespace={"__doc__": "How the step runs on each rank: the step's settings of a PlanInput, resolved (`setup_of`)."},
)
Setup.__module__ = __name__


def setup_from(inp: Any, **derived: Any) -> Any:
    """The Setup of a (resolved) PlanInput: its step settings by name, and the derived fields given (over those)."""
    return Setup(**{**{s.name: getattr(inp, s.name) for s in STEP_SETTINGS}, **derived})


# ---------------------------------------------------------------------------------------------------------------
# Model states


def root_parameters(shape: ModelShape) -> int:
    """Parameters outside the decoder layers: the embedding, the head (when untied) and the final norm."""
    return shape.vocab * shape.hidden * (1 if shape.tied_embeddings else 2) + shape.hidden


def _moe_flags(shape: ModelShape) -> list[bool]:
    return [is_moe_layer(shape, i) for i in range(shape.layers)]


def _trainable(shape: ModelShape, s: Setup) -> int:
    """Parameters the optimizer updates: all of them, or an adapter run's adapters (hsoffload.planning.adapters)."""
    return adapters.trainable_parameters(shape, s, _moe_flags(shape))


def base_weights_bytes(shape: ModelShape, s: Setup) -> int:
    """Every weight, unsharded: in the dtype; an adapter run's frozen base (QLoRA: its decoder linears in nf4) and
    its float32 adapters."""
    if not s.frozen_base:
        return shape.parameters() * s.dtype_bytes
    return (root_parameters(shape) * s.dtype_bytes
            + sum(adapters.layer_weight_bytes(shape, s, moe) for moe in _moe_flags(shape)))


def weights_bytes(shape: ModelShape, s: Setup) -> int:
    """The parameters on the device, in the training dtype: this rank's shard; with the weights on the host
    (cpu_offload "params") only the root module's (embedding, head, final norm), which FSDP2 keeps gathered from the
    root's forward to its backward (the decoder layers' are counted in `fsdp_gathered_bytes`). An adapter run:
    the frozen base (QLoRA's in nf4) and the float32 adapters."""
    if s.params_on_host:
        return root_parameters(shape) * s.dtype_bytes
    return base_weights_bytes(shape, s) // s.shards


def gradients_bytes(shape: ModelShape, s: Setup) -> int:
    """Every trainable parameter's gradient on the device (this rank's shard), as at the optimizer step: all of
    them, or an adapter run's adapters' (float32; the frozen base has none). With the optimizer on the host the
    gradients are still made on the device and copied out from there (counted, an upper bound: ZeRO-Offload streams
    them out in buckets during backward); with the weights on the host each layer's gradient leaves right after its
    reduce-scatter (0 here; `fsdp_unsharded_gradient_bytes` counts the one in flight)."""
    if s.params_on_host:
        return 0
    return _trainable(shape, s) * adapters.trainable_bytes_per_parameter(s) // s.shards


def optimizer_state_bytes(shape: ModelShape, s: Setup) -> int:
    """Optimizer states on the device (AdamW: two float32 moments per trainable parameter), this rank's shard; 0
    when they live on the host, or in a paged optimizer's unified memory (`model_states_host_bytes`)."""
    if s.states_on_host or s.paged:
        return 0
    return _optimizer_states(shape, s, _trainable(shape, s)) // s.shards


def _state_bytes_per_parameter(s: Setup) -> int:
    per = OPTIMIZERS[s.optimizer]
    return 2 * adapters.trainable_bytes_per_parameter(s) if per is None else per


def _optimizer_states(shape: ModelShape, s: Setup, parameters: int) -> int:
    return adapters.optimizer_states_of(parameters, _state_bytes_per_parameter(s), s)


def optimizer_step_bytes(shape: ModelShape, s: Setup) -> int:
    """Temporaries of the update: torch's foreach AdamW allocates one moment-sized tensor list (sqrt(v) + eps);
    none on the device when the step runs on the host (the updated weights are copied back in place), none for
    bitsandbytes' fused 8-bit update; a paged optimizer's step pages in the states of the tensor it updates (the
    largest counted)."""
    if s.states_on_host:
        return 0
    if s.paged:
        return _optimizer_states(shape, s, adapters.largest_trainable_tensor(shape, s))
    if s.optimizer.endswith("_8bit"):
        return 0
    moment = F32 if s.optimizer == "adamw_master" else _state_bytes_per_parameter(s) // 2
    return _trainable(shape, s) * moment // s.shards


def host_state_bytes_per_parameter(s: Setup) -> int:
    """Pinned host bytes per trainable parameter with model states on the host (DeepSpeed's accounting): the
    optimizer states, float32 gradients and float32 master weights (the weights themselves in a float32 run); with
    cpu_offload "params" also the weights in a narrower training dtype (ZeRO-3 offload_param keeps them; FSDP2's
    CPUOffloadPolicy casts the float32 shard at the all-gather instead: 2 B less per parameter in bf16)."""
    if not s.states_on_host:
        return 0
    master = 0 if s.optimizer == "adamw_master" else F32  # counted in its states already
    per = _state_bytes_per_parameter(s) + F32 + master
    if s.params_on_host and s.dtype_bytes < F32:
        per += s.dtype_bytes
    return per


def model_states_host_bytes(shape: ModelShape, s: Setup) -> int:
    """This rank's model states in host memory: its shard of every trainable parameter's host bytes (pinned), an
    adapter run's frozen base too with cpu_offload "params", and a paged optimizer's states (unified memory, which
    the driver evicts to the host)."""
    trainable = _trainable(shape, s)
    out = trainable * host_state_bytes_per_parameter(s)
    if s.frozen_base and s.params_on_host:
        out += base_weights_bytes(shape, s)
    if s.paged and not s.states_on_host:
        out += _optimizer_states(shape, s, trainable)
    return out // s.shards


def model_states_device_bytes(shape: ModelShape, s: Setup) -> int:
    """This rank's model states on the device at the optimizer step: weights, gradients and optimizer states."""
    return weights_bytes(shape, s) + gradients_bytes(shape, s) + optimizer_state_bytes(shape, s)


def fsdp_gathered_bytes(shape: ModelShape, s: Setup) -> int:
    """Under FSDP, or with the weights on the host: the layer being computed and one prefetched, gathered whole
    (weights in the training dtype)."""
    if s.shards == 1 and not s.params_on_host:
        return 0
    if s.frozen_base:
        return 2 * max(adapters.layer_weight_bytes(shape, s, moe) for moe in set(_moe_flags(shape)))
    return 2 * shape.largest_layer_parameters() * s.dtype_bytes


def fsdp_unsharded_gradient_bytes(shape: ModelShape, s: Setup) -> int:
    """Under FSDP, or with the weights on the host: one layer's full gradients before their reduce-scatter (and,
    with the weights on the host, before their copy out)."""
    if s.shards == 1 and not s.params_on_host:
        return 0
    if s.frozen_base:
        return max(adapters.lora_layer_parameters(shape, s, moe) for moe in set(_moe_flags(shape))) * \
            adapters.ADAPTER_BYTES
    return shape.largest_layer_parameters() * s.dtype_bytes


def layer_gradient_bytes(shape: ModelShape, s: Setup, moe: bool) -> int:
    """One layer's gradients kept on the device until the optimizer step (0 with the weights on the host)."""
    if s.params_on_host:
        return 0
    if s.frozen_base:
        return adapters.lora_layer_parameters(shape, s, moe) * adapters.ADAPTER_BYTES // s.shards
    return shape.layer_parameters(moe) * s.dtype_bytes // s.shards


def head_gradient_bytes(shape: ModelShape, s: Setup) -> int:
    """Gradients of the output head and final norm (made in head backward; the embedding's come last); with the
    weights on the host the root's are whole (its parameters are gathered) until they are copied out. An adapter
    run's head is frozen: none."""
    if s.frozen_base:
        return 0
    if s.params_on_host:
        return (shape.vocab * shape.hidden + shape.hidden) * s.dtype_bytes
    return (shape.vocab * shape.hidden + shape.hidden) * s.dtype_bytes // s.shards


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


def is_moe_layer(shape: ModelShape, index: int) -> bool:
    """Which layers are MoE: the last `moe_layers` (dense ones come first in the configs the planner reads)."""
    return index >= shape.layers - shape.moe_layers


def peak(shape: ModelShape, s: Setup) -> Phase:
    """The phase with the most bytes on the device."""
    return max(phases(shape, s), key=lambda p: p.total)

