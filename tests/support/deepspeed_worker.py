"""One rank of the DeepSpeed suite (run under torchrun by tests/integrations/test_deepspeed.py).

Every case trains the same tiny Llama (tests/support/hf_tiny.py, 4 decoder layers, local config) twice through a
DeepSpeed engine on the CPU accelerator (gloo): once without hidden-state offload, once inside an offload scope
(`offload_cpu_tensors=True`, so bytes really move on a CPU). Per run it keeps the losses, the full gradients before
each optimizer step (`deepspeed.utils.safe_get_full_grad`) and the full fp32 parameters after it
(`safe_get_full_fp32_param`), and the scope's counters after every forward and every backward. Rank 0 compares the
two runs bit for bit (`torch.equal`) and writes one JSON per case; the test asserts on those.

All cases run in one launch: starting the processes and initialising DeepSpeed's communication is most of the cost.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import faulthandler
import logging
import os
import sys
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

LAYERS = 4
STEPS = 2


def _ds_config(stage: int, accumulation: int = 1, offload: bool = False) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        # Gather every parameter at its module (no prefetch, no persistence): the ZeRO-3 path at its plainest.
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0, stage3_max_live_parameters=0)
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # torch's AdamW on the host (DeepSpeedCPUAdam would JIT-build an op)
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


@dataclasses.dataclass
class Case:
    name: str
    stage: int
    reentrant: Optional[bool]  # None: no gradient checkpointing
    accumulation: int = 1
    zero_init: bool = False
    zero_offload: bool = False
    policy: str = "hidden_states"
    detached_weight_alias: bool = False  # each MLP also saves a detached alias of its gathered down_proj weight


CASES = [
    Case("zero2_reentrant", 2, True),
    Case("zero2_nonreentrant", 2, False),
    Case("zero3_reentrant", 3, True),
    Case("zero3_nonreentrant", 3, False),
    Case("zero3_init", 3, False, zero_init=True),
    Case("zero3_accumulation2", 3, True, accumulation=2),
    Case("zero3_offload", 3, False, zero_offload=True),
    Case("zero3_policy_all", 3, None, policy="all"),
    Case("zero3_policy_all_weight_alias", 3, None, policy="all", detached_weight_alias=True),
]


def _save_detached_weight_alias(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook on a Linear: adds 0 * (x @ W.detach().t()), so autograd saves a view of a detached alias of the
    gathered ZeRO-3 weight (no ds_id on it, and no Parameter as its base: only its storage tells). Registered before
    deepspeed.initialize, so it runs before ZeRO-3's hook frees the gathered weight."""
    return output + 0.0 * torch.matmul(args[0], module.weight.detach().t())


def _build_model(case: Case, ds_config: dict[str, Any]) -> torch.nn.Module:
    import deepspeed
    import transformers
    from hf_tiny import tiny_config

    config = tiny_config("llama", LAYERS)
    torch.manual_seed(0)
    if case.zero_init:
        # As transformers users get it: with an HfDeepSpeedConfig alive, from_config builds the model under
        # deepspeed.zero.Init (partitioned as each module is built) and initialises it gathered.
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(ds_config)
        model = transformers.AutoModelForCausalLM.from_config(config)
        assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters()), "zero.Init did not partition"
        del keep
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    if case.reentrant is not None:
        from hsoffload.targets import enable_checkpointing

        enable_checkpointing(model, {"use_reentrant": case.reentrant})
    if case.detached_weight_alias:
        for layer in model.model.layers:
            layer.mlp.down_proj.register_forward_hook(_save_detached_weight_alias)
    model.train()
    return model


def _engine(model: torch.nn.Module, ds_config: dict[str, Any]) -> Any:
    import deepspeed

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    from hf_tiny import batches

    return batches(n, seed=1 + dist.get_rank())  # each rank its own data: the reductions matter


def _stats(scope: Any) -> dict[str, int]:
    return dataclasses.asdict(scope.stats) if scope is not None else {}


def _train(case: Case, offload: bool, scope_kwargs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One run: STEPS optimizer steps of `case.accumulation` micro-batches; what both runs are compared on."""
    from ds_recording import full_grads, full_params

    import hsoffload

    ds_config = _ds_config(case.stage, case.accumulation, case.zero_offload)
    model = _build_model(case, ds_config)
    engine = _engine(model, ds_config)
    kwargs = {"offload_cpu_tensors": True, "min_offload_size": 0, "policy": case.policy}
    kwargs.update(scope_kwargs or {})
    scope = hsoffload.offload_hidden_states(engine.module, **kwargs) if offload else None
    data = _batches(STEPS * case.accumulation)
    out: dict[str, Any] = {"losses": [], "grads": [], "params": [], "after_forward": [], "after_backward": []}
    for step in range(STEPS):
        for micro in range(case.accumulation):
            batch = data[step * case.accumulation + micro]
            with scope if scope is not None else contextlib.nullcontext():
                loss = engine(**batch).loss
                out["after_forward"].append(_stats(scope))
                engine.backward(loss)
                out["after_backward"].append(_stats(scope))
            out["losses"].append(loss.detach().clone())
        out["grads"].append(full_grads(engine))
        engine.step()
        out["params"].append(full_params(engine))
    if scope is not None:
        out["passthrough"] = dataclasses.asdict(scope.passthrough_stats)
    out["engine"] = engine
    return out


def _compare(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Every difference between two runs, bit for bit."""
    diffs = []
    for i, (x, y) in enumerate(zip(a["losses"], b["losses"])):
        if not torch.equal(x, y):
            diffs.append(f"loss {i}: {x.item()!r} != {y.item()!r}")
    for kind in ("grads", "params"):
        for step, (ga, gb) in enumerate(zip(a[kind], b[kind])):
            if ga.keys() != gb.keys():
                diffs.append(f"{kind} step {step}: names differ")
            for name in ga:
                if not torch.equal(ga[name], gb[name]):
                    diffs.append(f"{kind} step {step}: {name} differs")
    return diffs


def run_case(case: Case) -> dict[str, Any]:
    t0 = time.perf_counter()
    off = _train(case, offload=False)
    on = _train(case, offload=True)
    res: dict[str, Any] = {
        "diffs": _compare(off, on),
        "compared": {"losses": len(off["losses"]), "grads": sum(len(g) for g in off["grads"]),
                     "params": sum(len(p) for p in off["params"])},
        "nonzero_grads": all(bool(g.abs().sum() > 0) for g in off["grads"][0].values()),
        "params_moved": any(not torch.equal(off["params"][0][n], off["params"][1][n]) for n in off["params"][0]),
        "after_forward": on["after_forward"],
        "after_backward": on["after_backward"],
        "passthrough": on.get("passthrough", {}),
        "seconds": time.perf_counter() - t0,
    }
    if case.stage == 3 and not case.zero_offload:
        res["saved_keys"] = _saved_16bit_keys(on["engine"], on["params"][-1], os.path.join(_OUT_DIR, case.name))
    return res


def _saved_16bit_keys(engine: Any, params: dict[str, torch.Tensor], out_dir: str) -> dict[str, Any]:
    """ZeRO-3's consolidated 16-bit save (`save_16bit_model`, every rank takes part, rank 0 writes): its keys against
    the model's own state_dict keys, and its values against the full fp32 parameters after the last step."""
    path = os.path.join(out_dir, "zero3_16bit")
    engine.save_16bit_model(path)
    dist.barrier()
    if dist.get_rank() != 0:
        return {}
    state = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    own = list(engine.module.state_dict().keys())
    shared = [k for k in state if k in params]
    return {"saved": sorted(state), "own": sorted(own),
            "values_equal": bool(shared) and all(torch.equal(state[k], params[k]) for k in shared)}


def skipped_marks_case() -> dict[str, Any]:
    """Item 1 of issue 28: ZeRO-3, reentrant checkpointing, no CPU copies (offload_cpu_tensors=False): every marked
    save is skipped, so skipped_marked_tensors counts exactly the marked saves: one per layer in forward, none in
    the recompute during backward."""
    case = Case("zero3_reentrant_marks", 3, True)
    run = _train(case, offload=True, scope_kwargs={"offload_cpu_tensors": False})
    return {"after_forward": run["after_forward"], "after_backward": run["after_backward"],
            "passthrough": run.get("passthrough", {})}


def _trainer_run(offload: bool, out_dir: str) -> dict[str, Any]:
    """HF `Trainer` with a ZeRO-3 config dict with ZeRO-Offload of parameters and optimizer (accelerate drives
    DeepSpeed), non-reentrant checkpointing; with `offload`, hsoffload's Trainer integration
    (`enable_hidden_state_offload`), which also leaves ZeRO-Offload's host bytes out of the auto budget."""
    import transformers
    from ds_recording import recording_engine_steps
    from hf_tiny import tiny_config

    import hsoffload.offload.host
    import hsoffload.integrations
    from hsoffload.targets import current_training_args

    ds_config = _ds_config(3, offload=True)
    ds_config["train_micro_batch_size_per_gpu"] = "auto"
    ds_config["gradient_accumulation_steps"] = "auto"
    args = transformers.TrainingArguments(**current_training_args(dict(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,  # the DeepSpeed config's gradient_clipping
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        deepspeed=ds_config,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", LAYERS))  # under zero.Init here
    zero_init = all(hasattr(p, "ds_id") for p in model.parameters())
    data = [{k: v[i] for k, v in b.items()} for b in _batches(STEPS) for i in range(2)]
    record: dict[str, Any] = {"losses": [], "grads": [], "params": []}

    class Recording(transformers.Trainer):
        def compute_loss(self, model: Any, inputs: Any, *a: Any, **k: Any) -> Any:
            loss = super().compute_loss(model, inputs, *a, **k)
            record["losses"].append((loss[0] if isinstance(loss, tuple) else loss).detach().clone())
            return loss

    with recording_engine_steps(record):  # accelerate runs the engine's step inside its backward
        trainer = Recording(model=model, args=args, train_dataset=data)
        if offload:
            hsoffload.integrations.enable_hidden_state_offload(trainer, offload_cpu_tensors=True, min_offload_size=0)
        trainer.train()
    record["zero_init"] = zero_init
    record["host_room"] = hsoffload.offload.host.host_room()
    # fp32 run: 16 B per parameter (Adam's moments, fp32 gradient and master), each rank its 1 / world size
    record["expected_room"] = -(-sum(int(p.ds_numel) for p in model.parameters()) * 16 // dist.get_world_size())
    hsoffload.set_host_room(0)
    if offload:
        record["stats"] = dataclasses.asdict(trainer.hsoffload_scope.stats)
        record["logged"] = [
            {k: v for k, v in entry.items() if k.startswith("hsoffload/")} for entry in trainer.state.log_history
        ]
    return record


def trainer_case(out_dir: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    off = _trainer_run(False, os.path.join(out_dir, "trainer_off"))
    on = _trainer_run(True, os.path.join(out_dir, "trainer_on"))
    return {
        "diffs": _compare(off, on),
        "compared": {"losses": len(off["losses"]), "grads": sum(len(g) for g in off["grads"]),
                     "params": sum(len(p) for p in off["params"])},
        "zero_init": off["zero_init"] and on["zero_init"],
        "host_room": [off["host_room"], on["host_room"]],
        "expected_room": on["expected_room"],
        "stats": on["stats"],
        "logged": on["logged"],
        "seconds": time.perf_counter() - t0,
    }


CASE_FUNCS: dict[str, Callable[[], dict[str, Any]]] = {c.name: (lambda c=c: run_case(c)) for c in CASES}
CASE_FUNCS["zero3_reentrant_marks"] = skipped_marks_case
_OUT_DIR = ""
CASE_FUNCS["trainer_zero3"] = lambda: trainer_case(_OUT_DIR)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True)
    p.add_argument("--cases", default=",".join(CASE_FUNCS))
    a = p.parse_args()
    global _OUT_DIR
    _OUT_DIR = a.out_dir
    faulthandler.enable()  # a native abort prints every thread's Python stack (see dtensor_worker.py)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    logging.basicConfig(level=logging.WARNING)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for name in a.cases.split(","):
        try:
            results[name] = CASE_FUNCS[name]()
        except Exception:  # one case's failure is reported; the others still run (both ranks run the same code)
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    from worker_exit import finish  # a sibling module: torchrun puts this folder first on sys.path

    finish(a.out_dir, rank, results, default=str)
    return 0


if __name__ == "__main__":
    from worker_exit import leave  # a sibling module: torchrun puts this folder first on sys.path
    leave(main())  # no interpreter finalization (worker_exit.py)
