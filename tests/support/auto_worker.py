"""One rank of the 2-rank policy-auto tests (run under torchrun by tests/offload/auto/test_auto_ranks.py).

A tiny Llama, built alike on every rank (same seed), sharded with FSDP2 (`fully_shard` per decoder layer and at the
root, CPU mesh, gloo), or wrapped by DeepSpeed ZeRO-3; non-reentrant checkpointing. The ranks train on batches of
different lengths and give policy auto different budgets, which change mid-run. Each step records what auto runs
(per layer) and how many decisions it made; the same training without hsoffload is the reference, bit for bit.
Writes a JSON per rank.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import logging
from typing import Any

import torch
import torch.distributed as dist

STEPS = 8
LAYERS = 4


def _model() -> torch.nn.Module:
    import transformers

    from hsoffload.targets import enable_checkpointing

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    enable_checkpointing(model, {"use_reentrant": False})
    return model


def _fsdp2(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _zero3(model: torch.nn.Module) -> tuple[Any, Any]:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, opt, _, _ = deepspeed.initialize(model=model, config=config)
    return engine, opt


def _budgets(rank: int, step: int) -> int:
    """Rank 1's budget is under anything (steps 0-3: every layer must offload on both ranks; rank 0 alone would
    keep them all), then both are generous (steps 4-7: every layer keeps its input, from the same step)."""
    if rank == 1 and step < 4:
        return 64 << 10
    return 1 << 30


def _train(wrap: str, auto: bool, two_from: int = -1) -> dict[str, Any]:
    import hsoffload
    from hsoffload.offload import auto as auto_mod

    rank = dist.get_rank()
    model = _model()
    inner = model
    engine, opt = _fsdp2(model) if wrap == "fsdp2" else _zero3(model)
    seq = 32 if rank == 0 else 48  # the ranks' batches differ in length (packing, sequence shards)
    g = torch.Generator().manual_seed(100 + rank)
    losses, runs, decisions, forwards = [], [], [], []
    agree_ms: list[float] = []
    for step in range(STEPS):
        ids = torch.randint(3, 256, (1, seq), generator=g)
        extra = ids.flip(1) if 0 <= two_from <= step else None  # a second forward before the one backward
        if auto:
            with hsoffload.offload_hidden_states(inner, policy="auto", device_budget=_budgets(rank, step),
                                                 offload_cpu_tensors=True, min_offload_size=0,
                                                 auto_calibration_steps=2):
                loss = engine(input_ids=ids, labels=ids).loss
                if extra is not None:
                    loss = loss + engine(input_ids=extra, labels=extra).loss
                engine.backward(loss) if wrap == "zero3" else loss.backward()
            ctl = auto_mod.controller(inner)
            runs.append([c.value for c in ctl.choices()])
            decisions.append(ctl.decisions)
            forwards.append(ctl.forwards)
            agree_ms = [t * 1e3 for t in ctl.agree_s]
        else:
            loss = engine(input_ids=ids, labels=ids).loss
            if extra is not None:
                loss = loss + engine(input_ids=extra, labels=extra).loss
            engine.backward(loss) if wrap == "zero3" else loss.backward()
        if wrap == "zero3":
            engine.step()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    if wrap == "fsdp2":
        params = [p.full_tensor() for p in inner.parameters()]
    else:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(inner.parameters())):
            params = [p.detach().clone() for p in inner.parameters()]
    return {"losses": losses, "runs": runs, "decisions": decisions, "forwards": forwards, "agree_ms": agree_ms,
            "param_digest": [float(p.double().sum()) for p in params], "params": params}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wrap", choices=("fsdp2", "zero3"), required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--two-forwards-from", type=int, default=-1, help="from this step on, two forwards per backward")
    a = ap.parse_args()
    faulthandler.enable()
    logging.basicConfig(level=logging.INFO)
    # The collectives' timeout far above the test's: a hang shows as the test's timeout, never as a gloo error.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
    rank = dist.get_rank()
    import hsoffload  # noqa: F401  (loads the op library)

    auto = _train(a.wrap, auto=True, two_from=a.two_forwards_from)
    plain = _train(a.wrap, auto=False, two_from=a.two_forwards_from)
    same = all(torch.equal(x, y) for x, y in zip(auto.pop("params"), plain.pop("params")))
    result = {"rank": rank, "auto": auto, "plain": plain, "bitwise": same and auto["losses"] == plain["losses"]}

    from worker_exit import finish  # a sibling module: torchrun puts this folder first on sys.path

    finish(a.out_dir, rank, result)
    return 0


if __name__ == "__main__":
    from worker_exit import leave  # a sibling module: torchrun puts this folder first on sys.path
    leave(main())
