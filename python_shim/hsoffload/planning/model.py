"""The planner's model of a run: its shape (ModelShape, from a config.json), how the step runs on each rank
(Setup, from the planner's table), and the model states (weights, gradients, optimizer states, adapters). The
peak model (hsoffload.planning.memory) builds on it."""

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


def is_moe_layer(shape: ModelShape, index: int) -> bool:
    """Which layers are MoE: the last `moe_layers` (dense ones come first in the configs the planner reads)."""
    return index >= shape.layers - shape.moe_layers
