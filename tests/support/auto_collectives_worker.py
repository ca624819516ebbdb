"""One rank of the 2-rank test of policy auto's probe with collectives inside the layers (issue 52; run under
torchrun by tests/offload/auto/test_auto_ranks.py).

A tiny Llama whose attention exchanges its queries with the other rank, there and back (two all-to-alls in forward,
two in backward: the values unchanged, as sequence parallelism's layers issue collectives), under plain replicas
(no sharding: the layers are not sharded, as under DDP or ZeRO-1/2 with Ulysses). At the step where policy auto would
probe, rank 1's probe runs out of memory after the layer's first all-to-all (`--inject forward`), or in its
backward (`--inject backward`): injected whenever a layer runs without checkpointing in that step, which only a probe
does. Writes a JSON per rank: per step the choices run and the decisions made, whether the injection fired, the
losses with and without hsoffload.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

STEPS = 5
PROBE_STEP = 1  # on several ranks the first step watches the layers, the second probes
STATE: dict[str, Any] = {"inject": None, "fired": False, "step": -1, "layers": {}}


def _exchange(t: torch.Tensor) -> torch.Tensor:
    """An all-to-all and back: the same values, two collectives."""
    flat = t.contiguous().view(-1)
    there = torch.empty_like(flat)
    dist.all_to_all_single(there, flat)
    back = torch.empty_like(flat)
    dist.all_to_all_single(back, there)
    return back.view_as(t)


def _probing(module: torch.nn.Module) -> bool:
    layer = STATE["layers"].get(id(module))
    return STATE["step"] == PROBE_STEP and layer is not None and not layer.gradient_checkpointing


def _fire(where: str) -> None:
    STATE["inject"], STATE["fired"] = None, True
    raise torch.OutOfMemoryError(f"CUDA out of memory (injected on rank 1 after an all-to-all in the probe's {where})")


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        ctx.module = module
        return _exchange(q)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        out = _exchange(grad)
        if STATE["inject"] == "backward" and dist.get_rank() == 1 and _probing(ctx.module):
            _fire("backward")
        return out, None


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], **kwargs: Any) -> Any:
    from transformers.models.llama.modeling_llama import eager_attention_forward

    query = _Exchange.apply(query, module)
    if STATE["inject"] == "forward" and dist.get_rank() == 1 and _probing(module):
        _fire("forward")
    return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _model() -> torch.nn.Module:
    import transformers

    from hsoffload.targets import enable_checkpointing

    transformers.AttentionInterface.register("exchange_eager", _attention)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "exchange_eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    enable_checkpointing(model, {"use_reentrant": False})
    STATE["layers"] = {id(layer.self_attn): layer for layer in model.model.layers}
    return model


def _train(auto: bool, inject: Optional[str]) -> dict[str, Any]:
    import hsoffload
    from hsoffload.offload import auto as auto_mod

    STATE["inject"], STATE["fired"] = inject, False
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    losses, runs, decisions = [], [], []
    for step in range(STEPS):
        STATE["step"] = step
        ids = torch.randint(3, 256, (1, 32), generator=g)
        if auto:
            with hsoffload.offload_hidden_states(model, policy="auto", device_budget=1 << 30, min_offload_size=0,
                                                 offload_cpu_tensors=True):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            ctl = auto_mod.controller(model)
            runs.append([c.value for c in ctl.choices()])
            decisions.append(ctl.decisions)
        else:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"losses": losses, "runs": runs, "decisions": decisions, "fired": STATE["fired"],
            "params": [p.detach().clone() for p in model.parameters()]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inject", choices=("forward", "backward", "none"), required=True)
    ap.add_argument("--out-dir", required=True)
    a = ap.parse_args()
    faulthandler.enable()
    logging.basicConfig(level=logging.INFO)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))  # a hang is the test's timeout
    rank = dist.get_rank()
    import hsoffload  # noqa: F401  (loads the op library)

    auto = _train(True, None if a.inject == "none" else a.inject)
    plain = _train(False, None)
    same = all(torch.equal(x, y) for x, y in zip(auto.pop("params"), plain.pop("params")))
    result = {"rank": rank, "auto": auto, "bitwise": same and auto["losses"] == plain["losses"]}

    from worker_exit import finish  # a sibling module: torchrun puts this folder first on sys.path

    finish(a.out_dir, rank, result)
    return 0


if __name__ == "__main__":
    from worker_exit import leave  # a sibling module: torchrun puts this folder first on sys.path
    leave(main())
