"""Shared pieces of the composition suite (tests/integrations/test_composition.py, tests/support/composition_worker.py).

The long-context knobs users stack with hidden-state offload, applied to a tiny Llama from a local config:
DeepSpeed's `TiledMLP` on every decoder layer's MLP, TRL's chunked fused LM head with tiles shrunk so that several
run at tiny sizes, and a probe on an offload scope's hooks that records what each offloaded save looked like when it
was packed and restored, and whether it was packed in forward or in backward.

Importing this module imports neither DeepSpeed nor TRL.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Optional

import torch

from hsoffload.targets import enable_checkpointing

# Sizes: every case trains STEPS optimizer steps of BATCH x SEQ tokens through LAYERS decoder layers of width HIDDEN.
LAYERS = 2
SEQ = 16
BATCH = 2
HIDDEN = 32  # hf_tiny's width
STEPS = 2
MLP_SHARDS = 4  # TiledMLP tiles per layer call
VOCAB_TILE = 32  # TRL fused head: vocabulary columns per tile (hf_tiny's vocabulary is 128: 4 tiles)
TOKEN_TILE = 8  # TRL fused head: tokens per tile


def tiny_config(attn: str = "sdpa") -> Any:
    from support.hf_tiny import tiny_config as base

    config = base("llama", LAYERS)
    config._attn_implementation = attn
    return config


def tiny_model(attn: str = "sdpa", seed: int = 0, reentrant: bool = False) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(attn))
    enable_checkpointing(model, {"use_reentrant": reentrant})
    model.train()
    return model


def tiny_tokenizer() -> Any:
    """A word-level tokenizer over hf_tiny's vocabulary (no hub), for TRL's SFTTrainer."""
    import tokenizers
    import transformers

    from support.hf_tiny import VOCAB

    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab.update({"<pad>": 0, "<s>": 1, "</s>": 2})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")


# --------------------------------------------------------------------------- DeepSpeed's TiledMLP


MLP_CALLS = {"shards": 0}  # how many MLP shards ran (forward, checkpoint recompute, TiledMLP's backward)


def _tiled_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """LlamaMLP.forward through DeepSpeed's `TiledMLP` (its docstring's recipe; a fixed shard count, the same on every
    rank). Under ZeRO-3 the weights go in `compute_params` so that their gradients are reduced once, after the last
    shard."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp_forward(mlp: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        MLP_CALLS["shards"] += 1
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))

    params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
    return TiledMLP.apply(mlp_forward, self, x, MLP_SHARDS, params)


def tile_mlps(model: torch.nn.Module) -> int:
    """Route every decoder layer's MLP through DeepSpeed's TiledMLP (per instance; the class is untouched)."""
    count = 0
    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(_tiled_mlp_forward, layer.mlp)
        count += 1
    return count


# --------------------------------------------------------------------------- TRL's chunked fused LM head


def shrink_fused_head_tiles() -> dict[str, int]:
    """TRL's fused head tiles the vocabulary by `_CHUNKED_LOGPROB_CHUNK_SIZE` (32768) and the tokens by
    `TOKEN_CHUNK_SIZE` (4096): one tile at tiny sizes. Shrink both (module constants read at call time) so that
    forward and backward run several tiles. Returns the previous values."""
    import trl.kernels.chunked_logprob as kernel
    import trl.trainer.utils as utils

    old = {"vocab": utils._CHUNKED_LOGPROB_CHUNK_SIZE, "tokens": kernel.TOKEN_CHUNK_SIZE}
    utils._CHUNKED_LOGPROB_CHUNK_SIZE = VOCAB_TILE
    kernel.TOKEN_CHUNK_SIZE = TOKEN_TILE
    return old


def fused_head_tiles(tokens: int) -> int:
    """Tiles one fused-head forward projects over `tokens` positions with the shrunk tile sizes (on a CPU TRL scores
    every position, ignored labels included)."""
    from support.hf_tiny import VOCAB

    return -(-tokens // TOKEN_TILE) * -(-VOCAB // VOCAB_TILE)


def restore_fused_head_tiles(old: dict[str, int]) -> None:
    import trl.kernels.chunked_logprob as kernel
    import trl.trainer.utils as utils

    utils._CHUNKED_LOGPROB_CHUNK_SIZE = old["vocab"]
    kernel.TOKEN_CHUNK_SIZE = old["tokens"]


class TileCounter(torch.overrides.TorchFunctionMode):
    """Counts the tiles TRL's chunked log-prob kernel projects in forward: its `torch.mm(..., out=tile)` calls (nothing
    else in a Llama step calls `torch.mm` with `out=`). Its backward recomputes the tiles inside the autograd engine,
    where this Python mode does not see them. A pass-through mode: every call runs as it would."""

    def __init__(self) -> None:
        super().__init__()
        self.tiles = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.mm and "out" in kwargs:
            self.tiles += 1
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- a probe on the scope's hooks


@dataclasses.dataclass
class _Tagged:
    """What the probe's pack hook hands autograd: the scope's own packed value and, for a save the engine offloaded,
    the tensor's metadata at pack time."""

    packed: Any
    meta: Optional[tuple]


class Probe:
    """Wraps an offload scope's pack/unpack hooks (before the scope is entered): for every save the engine offloaded,
    its shape, stride and dtype at pack time and whether autograd was running a backward then; at unpack, the
    restored tensor's metadata against the packed one. The scope's hooks run unchanged inside."""

    def __init__(self, scope: Any) -> None:
        from hsoffload.stats import OffloadStats, from_engine

        self.packed: list[dict[str, Any]] = []  # one per offloaded save
        self.restored = 0
        self.mismatches: list[str] = []
        engine = scope._scope
        pack, unpack = scope.pack_hook, scope.unpack_hook

        def offloaded() -> int:
            return from_engine(OffloadStats, engine.stats()).offloaded_tensors

        def pack_hook(x: torch.Tensor) -> Any:
            before = offloaded()
            packed = pack(x)
            if offloaded() == before:
                return _Tagged(packed, None)
            meta = (tuple(x.shape), tuple(x.stride()), x.dtype)
            self.packed.append(
                {"shape": list(meta[0]), "stride": list(meta[1]), "dtype": str(x.dtype),
                 "in_backward": torch._C._current_graph_task_id() != -1}
            )
            return _Tagged(packed, meta)

        def unpack_hook(tagged: _Tagged) -> torch.Tensor:
            out = unpack(tagged.packed)
            if tagged.meta is not None:
                self.restored += 1
                got = (tuple(out.shape), tuple(out.stride()), out.dtype)
                if got != tagged.meta:
                    self.mismatches.append(f"packed {tagged.meta}, restored {got}")
            return out

        scope.pack_hook = pack_hook
        scope.unpack_hook = unpack_hook

    def report(self) -> dict[str, Any]:
        return {"packed": self.packed, "restored": self.restored, "mismatches": self.mismatches}


def stats_dict(scope: Any) -> dict[str, int]:
    """The scope's engine counters and its pass-through counters (saves during backward, ZeRO-3 parameters), so far."""
    out = dataclasses.asdict(scope.stats)
    out.update(dataclasses.asdict(scope.passthrough_stats))
    return out


def per_entry(stats: list[dict[str, int]], key: str) -> list[int]:
    """How much `key` grew over each entry of a list of cumulative counters."""
    values = [s.get(key, 0) for s in stats]
    return [v - p for v, p in zip(values, [0] + values[:-1])]


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Every difference between two runs (losses, gradients before each step, parameters after it), bit for bit."""
    diffs = []
    if len(a["losses"]) != len(b["losses"]) or not a["losses"]:
        diffs.append(f"losses: {len(a['losses'])} against {len(b['losses'])}")
    for i, (x, y) in enumerate(zip(a["losses"], b["losses"])):
        if not torch.equal(x, y):
            diffs.append(f"loss {i}: {x.item()!r} != {y.item()!r}")
    for kind in ("grads", "params"):
        if len(a[kind]) != len(b[kind]) or not a[kind]:
            diffs.append(f"{kind}: {len(a[kind])} steps against {len(b[kind])}")
        for step, (ga, gb) in enumerate(zip(a[kind], b[kind])):
            if ga.keys() != gb.keys() or not ga:
                diffs.append(f"{kind} step {step}: names differ or none")
            for name in ga:
                if name in gb and not torch.equal(ga[name], gb[name]):
                    diffs.append(f"{kind} step {step}: {name} differs")
    return diffs


def summary(off: dict[str, Any], on: dict[str, Any], seconds: float, **extra: Any) -> dict[str, Any]:
    """What a case reports: the differences, how much was compared, that training did something, the offload
    counters after every forward and backward, and the probe."""
    first = off["grads"][0] if off["grads"] else {}
    return {
        "diffs": compare(off, on),
        "compared": {"losses": len(off["losses"]), "grads": sum(len(g) for g in off["grads"]),
                     "params": sum(len(p) for p in off["params"])},
        "nonzero_grads": bool(first) and all(bool(g.abs().sum() > 0) for g in first.values()),
        "params_moved": len(off["params"]) > 1 and any(
            not torch.equal(off["params"][0][n], off["params"][-1][n]) for n in off["params"][0]
        ),
        "after_forward": on.get("after_forward", []),
        "after_backward": on.get("after_backward", []),
        "probe": on["probe"],
        "losses": [float(x) for x in on["losses"]],
        "seconds": seconds,
        **extra,
    }
