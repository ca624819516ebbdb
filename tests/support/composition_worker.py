"""One rank of the composition suite (run under torchrun by tests/integrations/test_composition.py).

Hidden-state offload composed with the long-context knobs on 2 CPU ranks (gloo): FSDP2 with
`CPUOffloadPolicy(pin_memory=False)`, DeepSpeed Ulysses sequence parallelism with ZeRO-3 (plain loop, and HF Trainer
through accelerate's `ParallelismConfig(sp_backend="deepspeed")`), DeepSpeed's `TiledMLP`, TRL's chunked fused LM
head, and stacks of them. Every case trains a tiny Llama (tests/support/composition.py) twice, offload off and on
(`offload_cpu_tensors=True`: the bytes really move on a CPU), and compares losses, full gradients before each step and
full parameters after it with `torch.equal`; the offload run also records the scope's counters after every forward
and backward and a probe of every offloaded save (tests/support/composition.Probe). Each rank writes
rank<r>.json; the test asserts on them.

All cases run in one launch: process start, imports and DeepSpeed's setup are most of the cost. Cases that need
DeepSpeed are left out (and the test skips them) where it is not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: `support.*` as in the test process

from support import composition as C  # noqa: E402
from support.ds_recording import full_grads, full_params, recording_engine_steps  # noqa: E402  (no DeepSpeed import)
from support.hf_tiny import VOCAB  # noqa: E402

FSDP_CASES = ["fsdp2_cpu_offload", "fsdp2_stack"]
DS_CASES = ["tiled_mlp", "tiled_mlp_reentrant", "ulysses_zero3", "ulysses_stack", "trainer_ulysses"]
NEEDS_TRL = {"fsdp2_stack", "ulysses_stack"}
NEEDS_DS = set(DS_CASES) | {"fsdp2_stack"}


def _batches(seed: int, n: int = C.STEPS) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (C.BATCH, C.SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _scope(model: torch.nn.Module, offload: bool) -> tuple[Any, Optional[C.Probe]]:
    if not offload:
        return None, None
    import hsoffload

    scope = hsoffload.offload_hidden_states(model, offload_cpu_tensors=True, min_offload_size=0)
    return scope, C.Probe(scope)


def _run(
    steps: int,
    forward: Callable[[int], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    step: Callable[[], None],
    grads: Callable[[], dict[str, torch.Tensor]],
    params: Callable[[], dict[str, torch.Tensor]],
    scope: Any,
    count_tiles: bool = False,
) -> dict[str, Any]:
    """`steps` optimizer steps, each one forward and backward (inside `scope` when given); what the runs are compared
    on, and per step: the scope's counters after forward and after backward, how many TiledMLP shards ran and (with
    `count_tiles`, in both runs alike) how many tiles TRL's fused head projected in forward."""
    out: dict[str, Any] = {"losses": [], "grads": [], "params": [], "after_forward": [], "after_backward": [],
                           "mlp_shards": [], "head_tiles": []}
    for i in range(steps):
        shards = C.MLP_CALLS["shards"]
        tiles = C.TileCounter() if count_tiles else contextlib.nullcontext()
        with scope if scope is not None else contextlib.nullcontext(), tiles:
            loss = forward(i)
            if scope is not None:
                out["after_forward"].append(C.stats_dict(scope))
            backward(loss)
            if scope is not None:
                out["after_backward"].append(C.stats_dict(scope))
        out["mlp_shards"].append(C.MLP_CALLS["shards"] - shards)
        out["head_tiles"].append(tiles.tiles if count_tiles else 0)
        out["losses"].append(loss.detach().clone())
        out["grads"].append(grads())
        step()
        out["params"].append(params())
    return out


# --------------------------------------------------------------------------- FSDP2 + CPUOffloadPolicy


def _fsdp2(offload: bool, stack: bool) -> dict[str, Any]:
    """fully_shard per decoder layer and at the root with CPUOffloadPolicy(pin_memory=False); each rank its own data
    (the gradients are averaged across ranks). `stack`: DeepSpeed's TiledMLP in every layer and TRL's chunked fused LM
    head with small tiles as well."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    model = C.tiny_model("sdpa")
    if stack:
        from trl.trainer.utils import add_fused_lm_head

        C.tile_mlps(model)
        add_fused_lm_head(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=False)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = _batches(seed=100 + dist.get_rank())
    scope, probe = _scope(model, offload)

    def forward(i: int) -> torch.Tensor:
        if stack:
            return model(input_ids=data[i]["input_ids"], labels=data[i]["labels"], fused_lm_head=True).loss
        return model(**data[i]).loss

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = _run(
        C.STEPS, forward, lambda loss: loss.backward(), step,
        lambda: {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()},
        lambda: {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
        scope, count_tiles=stack,
    )
    out["probe"] = probe.report() if probe else {}
    out["offload_policies"] = sorted(
        {type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__ for m in [model, *model.model.layers]}
    )
    return out


# --------------------------------------------------------------------------- DeepSpeed: TiledMLP, Ulysses


def _ds_config(offload_states: bool = False) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": 3,
        # Gather every parameter at its module (no prefetch, no persistence): the ZeRO-3 path at its plainest.
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 0,
        "stage3_max_live_parameters": 0,
    }
    if offload_states:  # ZeRO-Offload: parameters and optimizer states on the host
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": C.BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # torch's AdamW on the host (DeepSpeedCPUAdam would JIT-build an op)
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _tiled_mlp(offload: bool, tiled: bool = True, reentrant: bool = False) -> dict[str, Any]:
    """One process, no collectives: DeepSpeed's TiledMLP (MLP_SHARDS tiles) inside checkpointed decoder layers, micro
    batch 2. Its backward recomputes each tile and runs a backward per tile inside the layer's backward: those saves
    happen during backward. `tiled=False`: the stock MLP, the reference TiledMLP must match within rounding.
    `reentrant`: reentrant checkpointing, whose recompute runs the whole layer again during backward, inside the
    offload scope (its saves, the layer input's among them, reach hsoffload's hooks then)."""
    model = C.tiny_model("sdpa", reentrant=reentrant)
    if tiled:
        C.tile_mlps(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = _batches(seed=200 + dist.get_rank())
    scope, probe = _scope(model, offload)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = _run(
        C.STEPS, lambda i: model(**data[i]).loss, lambda loss: loss.backward(), step,
        lambda: {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        lambda: {n: p.detach().clone() for n, p in model.named_parameters()},
        scope,
    )
    out["probe"] = probe.report() if probe else {}
    return out


_MPU: Any = None
_SDPA: Any = None  # transformers' sdpa attention before Ulysses wraps it


def _ulysses_mpu(model: torch.nn.Module) -> Any:
    """Register Ulysses with transformers once per process (it wraps the `sdpa` entry of ALL_ATTENTION_FUNCTIONS and
    creates DeepSpeed's sequence-parallel groups, which may be created only once): every manual run shares it."""
    global _MPU, _SDPA
    if _MPU is None:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        _SDPA = ALL_ATTENTION_FUNCTIONS["sdpa"]
        _MPU = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation="sdpa",
            sequence_parallel_size=dist.get_world_size(),
            micro_batch_size=C.BATCH,
            seq_length=C.SEQ,
            seq_length_is_variable=True,
        )
    return _MPU


def _unregister_ulysses() -> None:
    """Undo `_ulysses_mpu` (before accelerate registers Ulysses again for the Trainer route): transformers' sdpa back
    in ALL_ATTENTION_FUNCTIONS, DeepSpeed's sequence-parallel groups released (its own teardown helper)."""
    global _MPU
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _SDPA is not None:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _SDPA
    mpu._release_sequence_parallel_groups()
    _MPU = None


def _sp_loss(loss: torch.Tensor, shift_labels: torch.Tensor, group: Any) -> torch.Tensor:
    """The loss over the whole sequence from each rank's shard loss: weighted by its valid tokens, differentiable
    (as transformers' `deepspeed_sp_compute_loss` and DeepSpeed's ALST tutorial do it)."""
    from torch.distributed.nn.functional import all_gather

    losses = torch.stack(all_gather(loss, group=group))
    tokens = torch.stack(all_gather((shift_labels != -100).view(-1).sum(), group=group))
    return (losses * tokens).sum() / tokens.sum().clamp(min=1)


def _ulysses(offload: bool, stack: bool) -> dict[str, Any]:
    """A plain loop over a DeepSpeed engine: Ulysses SP over both ranks (register_with_transformers, sdpa), ZeRO-3,
    batches sharded along the sequence by UlyssesSPDataLoaderAdapter (each rank holds (batch, SEQ / 2, hidden) hidden
    states). `stack`: ZeRO-Offload of parameters and optimizer states, DeepSpeed's TiledMLP and TRL's chunked fused LM
    head (on the pre-shifted labels) as well."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    model = C.tiny_model("sdpa")
    if stack:
        from trl.trainer.utils import add_fused_lm_head

        C.tile_mlps(model)
        add_fused_lm_head(model)
    mpu = _ulysses_mpu(model)
    group = mpu.get_sequence_parallel_group()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=_ds_config(stack), mpu=mpu
    )
    rows = []
    for b in _batches(seed=300 + dist.get_rank(), n=1):  # one batch per rank: the adapter serves rank 0's, then 1's
        for j in range(C.BATCH):
            rows.append({"input_ids": b["input_ids"][j], "labels": b["labels"][j],
                         "position_ids": torch.arange(C.SEQ)})
    loader = torch.utils.data.DataLoader(rows, batch_size=C.BATCH)
    loader = UlyssesSPDataLoaderAdapter(
        loader, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=group,
        sp_world_size=mpu.get_sequence_parallel_world_size(), device=engine.device,
    )
    # The adapter's shards are `[:, a:b]` slices: non-contiguous views with batch > 1, which transformers' loss
    # cannot `.view(-1)`. Contiguous here, as a user's collate would do.
    shards = [{k: v.contiguous() if torch.is_tensor(v) else v for k, v in b.items()} for b in loader]
    assert len(shards) == C.STEPS and shards[0]["input_ids"].shape == (C.BATCH, C.SEQ // dist.get_world_size())
    scope, probe = _scope(engine.module, offload)

    def forward(i: int) -> torch.Tensor:
        b = shards[i]
        if stack:
            out = engine(input_ids=b["input_ids"], position_ids=b["position_ids"], shift_labels=b["shift_labels"],
                         fused_lm_head=True)
        else:
            out = engine(input_ids=b["input_ids"], position_ids=b["position_ids"], labels=b["shift_labels"],
                         shift_labels=b["shift_labels"])
        return _sp_loss(out.loss, b["shift_labels"], group)

    out = _run(
        C.STEPS, forward, engine.backward, engine.step,
        lambda: full_grads(engine), lambda: full_params(engine),
        scope, count_tiles=stack,
    )
    out["probe"] = probe.report() if probe else {}
    out["local_seq"] = int(shards[0]["input_ids"].shape[1])
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    out["sdpa_entry"] = ALL_ATTENTION_FUNCTIONS["sdpa"].__name__  # DeepSpeed's `uattn_wrapper` while registered
    return out


def _unsharded_loss() -> float:
    """The first loss the Ulysses runs must reproduce: step 0 trains on rank 0's batch (the adapter serves the ranks'
    batches in rank order), here through the same initial model in one process without sequence parallelism (eager
    attention: the sdpa entry is DeepSpeed's wrapper while Ulysses is registered)."""
    model = C.tiny_model("eager")
    with torch.no_grad():
        return float(model(**_batches(seed=300, n=1)[0]).loss)


def _trainer_ulysses(offload: bool, out_dir: str) -> dict[str, Any]:
    """HF Trainer with `ParallelismConfig(sp_backend="deepspeed", sp_size=2)` and a ZeRO-3 config: accelerate
    registers Ulysses and wraps the Trainer's data loader in UlyssesSPDataLoaderAdapter itself, transformers
    aggregates the shard losses (`deepspeed_sp_compute_loss`). With `offload`, hsoffload's Trainer integration."""
    import transformers
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    import hsoffload.integrations
    from hsoffload.targets import current_training_args

    _unregister_ulysses()  # accelerate registers it again (DeepSpeed's groups may be created once)
    ds_config = _ds_config()
    ds_config["train_micro_batch_size_per_gpu"] = "auto"
    ds_config["gradient_accumulation_steps"] = "auto"
    pc = ParallelismConfig(
        sp_backend="deepspeed", sp_size=dist.get_world_size(),
        sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"),
    )
    args = transformers.TrainingArguments(**current_training_args(dict(
        output_dir=out_dir, per_device_train_batch_size=C.BATCH, max_steps=C.STEPS, learning_rate=1e-2,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
        save_strategy="no", report_to=[], deepspeed=ds_config, parallelism_config=pc, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True,
    )))
    model = C.tiny_model("sdpa")  # under zero.Init: args hold a DeepSpeed config
    rows = [{"input_ids": b["input_ids"][j], "labels": b["labels"][j], "position_ids": torch.arange(C.SEQ)}
            for b in _batches(seed=400, n=C.STEPS) for j in range(C.BATCH)]
    record: dict[str, Any] = {"losses": [], "grads": [], "params": [], "shapes": []}

    class Recording(transformers.Trainer):
        def compute_loss(self, model: Any, inputs: Any, *a: Any, **k: Any) -> Any:
            # The adapter's shards are non-contiguous `[:, a:b]` views: contiguous, as a collate would make them.
            inputs = {key: v.contiguous() if torch.is_tensor(v) else v for key, v in inputs.items()}
            record["shapes"].append(list(inputs["input_ids"].shape))
            loss = super().compute_loss(model, inputs, *a, **k)
            record["losses"].append((loss[0] if isinstance(loss, tuple) else loss).detach().clone())
            return loss

    try:
        with recording_engine_steps(record):  # accelerate runs the engine's step inside its backward
            trainer = Recording(model=model, args=args, train_dataset=rows)
            probe = None
            if offload:
                hsoffload.integrations.enable_hidden_state_offload(trainer, offload_cpu_tensors=True,
                                                                   min_offload_size=0)
                probe = C.Probe(trainer.hsoffload_scope)
            trainer.train()
    finally:
        _unregister_ulysses()
    record["probe"] = probe.report() if probe else {}
    if offload:
        record["stats"] = C.stats_dict(trainer.hsoffload_scope)
        record["logged"] = [{k: v for k, v in e.items() if k.startswith("hsoffload/")}
                            for e in trainer.state.log_history if "loss" in e]
    return record


# --------------------------------------------------------------------------- context parallelism (2 GPUs)

_CP: dict[str, Any] = {}


def _cp_accelerator() -> Any:
    """One Accelerator for both runs (accelerate's state is per process): `ParallelismConfig(cp_size=2)`, FSDP2 over
    the same 2 ranks, decoder layers wrapped."""
    if "accelerator" not in _CP:
        from accelerate import Accelerator
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import FullyShardedDataParallelPlugin

        fsdp = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True,
            activation_checkpointing=False, state_dict_type="SHARDED_STATE_DICT",
        )
        _CP["accelerator"] = Accelerator(
            parallelism_config=ParallelismConfig(dp_shard_size=1, cp_size=dist.get_world_size()), fsdp_plugin=fsdp
        )
    return _CP["accelerator"]


def _cp_fsdp2(offload: bool) -> dict[str, Any]:
    """accelerate context parallelism (torch's `context_parallel`: ring attention over sdpa, the sequence sharded in
    load-balanced chunks) with FSDP2, transformers' non-reentrant checkpointing; both ranks train the same batches
    (one context-parallel group), each on its shard, with the labels pre-shifted before sharding."""
    accelerator = _cp_accelerator()
    device = accelerator.device
    model = C.tiny_model("sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    data = _batches(seed=600)
    scope, probe = _scope(model, offload)
    local_seq: list[int] = []
    cp = contextlib.ExitStack()  # the context-parallel region spans forward and backward, as accelerate documents

    def forward(i: int) -> torch.Tensor:
        ids = data[i]["input_ids"].to(device)
        shift_labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
        position_ids = torch.arange(C.SEQ, device=device).expand(C.BATCH, -1).contiguous()
        buffers = [ids, shift_labels, position_ids]
        cp.enter_context(accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                                            no_restore_buffers=set(buffers)))
        local_seq.append(int(ids.shape[1]))
        return model(input_ids=ids, position_ids=position_ids, labels=shift_labels, shift_labels=shift_labels).loss

    def backward(loss: torch.Tensor) -> None:
        try:
            accelerator.backward(loss)
        finally:
            cp.close()

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()

    out = _run(
        C.STEPS, forward, backward, step,
        lambda: {n: full(p.grad) for n, p in model.named_parameters()},
        lambda: {n: full(p) for n, p in model.named_parameters()},
        scope,
    )
    out["probe"] = probe.report() if probe else {}
    out["local_seq"] = local_seq[0]
    return out


# --------------------------------------------------------------------------- cases


def run_case(name: str, out_dir: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    if name in ("fsdp2_cpu_offload", "fsdp2_stack"):
        stack = name == "fsdp2_stack"
        off, on = _fsdp2(False, stack), _fsdp2(True, stack)
        return C.summary(off, on, time.perf_counter() - t0, offload_policies=on["offload_policies"],
                         mlp_shards=on["mlp_shards"], head_tiles=[off["head_tiles"], on["head_tiles"]])
    if name in ("tiled_mlp", "tiled_mlp_reentrant"):
        reentrant = name == "tiled_mlp_reentrant"
        off, on = _tiled_mlp(False, reentrant=reentrant), _tiled_mlp(True, reentrant=reentrant)
        stock = _tiled_mlp(False, tiled=False, reentrant=reentrant)
        # TiledMLP against the stock MLP: the same maths in other matmul shapes, so within rounding.
        worst = max(float((a - b).abs().max()) for g, h in zip(off["grads"], stock["grads"]) for a, b in
                    ((g[n], h[n]) for n in g))
        return C.summary(off, on, time.perf_counter() - t0, stock_loss=[float(x) for x in stock["losses"]],
                         tiled_loss=[float(x) for x in off["losses"]], worst_grad_diff_vs_stock=worst,
                         mlp_shards=on["mlp_shards"], stock_mlp_shards=stock["mlp_shards"])
    if name in ("ulysses_zero3", "ulysses_stack"):
        stack = name == "ulysses_stack"
        off, on = _ulysses(False, stack), _ulysses(True, stack)
        return C.summary(off, on, time.perf_counter() - t0, local_seq=on["local_seq"], sdpa_entry=on["sdpa_entry"],
                         unsharded_loss=_unsharded_loss() if not stack else None,
                         mlp_shards=on["mlp_shards"], head_tiles=[off["head_tiles"], on["head_tiles"]])
    if name == "trainer_ulysses":
        off = _trainer_ulysses(False, os.path.join(out_dir, "trainer_off"))
        on = _trainer_ulysses(True, os.path.join(out_dir, "trainer_on"))
        return C.summary(off, on, time.perf_counter() - t0, stats=on["stats"], logged=on["logged"],
                         shapes=on["shapes"])
    if name == "cp_fsdp2":
        off, on = _cp_fsdp2(False), _cp_fsdp2(True)
        return C.summary(off, on, time.perf_counter() - t0, local_seq=on["local_seq"])
    raise ValueError(f"unknown case {name!r}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--cases", required=True, help="comma-separated case names")
    ap.add_argument("--backend", default="gloo", help="nccl: the GPU cases (one device per rank)")
    a = ap.parse_args()
    faulthandler.enable()  # a native abort prints every thread's Python stack (see dtensor_worker.py)
    if a.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(a.backend, timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    import hsoffload  # noqa: F401  (loads the op library)

    cases = [c for c in a.cases.split(",") if c]
    if any(c in NEEDS_DS for c in cases):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group above
    if any(c in NEEDS_TRL for c in cases):
        C.shrink_fused_head_tiles()
    result: dict[str, Any] = {"rank": rank, "world_size": dist.get_world_size(), "cases": {}}
    for name in cases:
        try:
            result["cases"][name] = run_case(name, a.out_dir)
        except Exception:  # reported per case; the other cases still run
            result["cases"][name] = {"error": traceback.format_exc()}
        dist.barrier()
    from worker_exit import finish  # a sibling module: torchrun puts this folder first on sys.path

    finish(a.out_dir, rank, result)
    return 0


if __name__ == "__main__":
    from worker_exit import leave

    leave(main())  # no interpreter finalization (worker_exit.py)
