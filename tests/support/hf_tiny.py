"""Tiny transformers models built from local configs (no hub) and a reference training loop.

Shared by the transformers, patch, trainer and axolotl tests. Works with transformers 4.57 and 5.x.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Optional

import torch
import transformers
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

import hsoffload
from hsoffload.targets import enable_checkpointing as enable_model_checkpointing

VOCAB = 128
LAYERS = 3
SEQ = 12
BATCH = 2

# family -> config class name; every one exists in transformers 4.57 and 5.x and its decoder
# layers derive from GradientCheckpointingLayer.
FAMILIES = {
    "llama": "LlamaConfig",
    "qwen3": "Qwen3Config",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "olmo2": "Olmo2Config",
    "phi3": "Phi3Config",
    "granite": "GraniteConfig",
}


def tiny_config(family: str = "llama", layers: int = LAYERS) -> Any:
    cfg_cls = getattr(transformers, FAMILIES[family])
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if family == "qwen3":
        kwargs["head_dim"] = 8
    cfg = cfg_cls(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


class TinyLayer(GradientCheckpointingLayer):
    """A decoder-layer stand-in (a linear, then sin) for the patch's own tests: checkpointed as transformers does it."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, hidden_states: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.linear(hidden_states).sin() * scale


def tiny_layer(reentrant: bool = False, width: int = 8, cls: type = TinyLayer) -> torch.nn.Module:
    """A `cls` layer in training mode, checkpointed (torch's checkpoint, `use_reentrant=reentrant`), seed 0."""
    torch.manual_seed(0)
    layer = cls(width)
    layer.gradient_checkpointing = True
    layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=reentrant)
    return layer.train()


def tiny_model(family: str = "llama", seed: int = 0, layers: int = LAYERS) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, layers))
    model.train()
    return model


def enable_checkpointing(model: torch.nn.Module, reentrant: bool) -> None:
    enable_model_checkpointing(model, {"use_reentrant": reentrant})
    model.train()


def batches(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def twin(model: torch.nn.Module) -> torch.nn.Module:
    """An identical, independent copy (same parameters bit for bit)."""
    return copy.deepcopy(model)


StepResult = tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], list[hsoffload.OffloadStats]]


def train_steps(
    model: torch.nn.Module,
    data: list[dict[str, torch.Tensor]],
    *,
    offload: bool,
    steps: int = 3,
    accumulation: int = 1,
    forward: Optional[Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]] = None,
    scope_kwargs: Optional[dict[str, Any]] = None,
) -> StepResult:
    """AdamW steps; returns per-micro-batch losses, per-step gradients, per-micro-batch scope stats."""
    forward = forward or (lambda m, b: m(**b).loss)
    kwargs = scope_kwargs if scope_kwargs is not None else {"offload_cpu_tensors": True, "min_offload_size": 0}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses: list[torch.Tensor] = []
    grads: list[dict[str, torch.Tensor]] = []
    stats: list[hsoffload.OffloadStats] = []
    for step in range(steps):
        for micro in range(accumulation):
            batch = data[(step * accumulation + micro) % len(data)]
            if offload:
                with hsoffload.offload_hidden_states(model, **kwargs) as scope:
                    loss = forward(model, batch) / accumulation
                    loss.backward()
                stats.append(scope.stats)
            else:
                loss = forward(model, batch) / accumulation
                loss.backward()
            losses.append(loss.detach().clone())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, stats


def assert_bitwise_equal(a: StepResult, b: StepResult) -> None:
    losses_a, grads_a, _ = a
    losses_b, grads_b, _ = b
    assert len(losses_a) == len(losses_b)
    for i, (la, lb) in enumerate(zip(losses_a, losses_b)):
        assert torch.equal(la, lb), f"loss {i}: {la.item()} != {lb.item()}"
    for step, (ga, gb) in enumerate(zip(grads_a, grads_b)):
        assert ga.keys() == gb.keys(), f"step {step}: different parameters got gradients"
        assert ga, f"step {step}: no gradients at all"
        for name in ga:
            assert torch.equal(ga[name], gb[name]), f"step {step}: grad of {name} differs"


def decoder_layers(model: torch.nn.Module) -> int:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sum(1 for m in model.modules() if isinstance(m, GradientCheckpointingLayer))


def enable_sac(model: torch.nn.Module, ops: Optional[set] = None, counter: Optional[list] = None) -> None:
    """Non-reentrant checkpointing with a selective-checkpoint context_fn that keeps the outputs of `ops` (default:
    the matmuls mm, bmm, addmm) and recomputes the rest; `counter` collects one entry per tensor op SAC saves in
    forward."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    keep = ops if ops is not None else {aten.mm.default, aten.bmm.default, aten.addmm.default}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op in keep:
            if counter is not None and not ctx.is_recompute:
                counter.append(1)
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    enable_model_checkpointing(
        model, {"use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}
    )
    model.train()
