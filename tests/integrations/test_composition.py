"""Hidden-state offload composed with the long-context knobs (issue 27, item 1).

Every case trains a tiny Llama twice in the same run, offload off and on, and asserts bit for bit (`torch.equal`)
equal losses, full gradients before each optimizer step and full parameters after it; that the offload run offloaded
exactly one hidden state per decoder layer per step, all in forward (none during backward, where TiledMLP and the
checkpoint recompute save again), and restored each once with the shape, stride and dtype it was packed with
(tests/support/composition.Probe); and that the knob itself was engaged (the policy, the shard shapes, the tiles).

- 2 CPU ranks under torchrun (gloo; tests/support/composition_worker.py, every case in one launch):
  FSDP2 `fully_shard` with `CPUOffloadPolicy(pin_memory=False)`; DeepSpeed Ulysses sequence parallelism
  (`UlyssesSPAttentionHF.register_with_transformers`, sdpa, `UlyssesSPDataLoaderAdapter`) with ZeRO-3 in a plain
  loop and through HF Trainer with accelerate's `ParallelismConfig(sp_backend="deepspeed")`; DeepSpeed's `TiledMLP`
  inside checkpointed layers (per rank, no collectives); two stacks: FSDP2 + CPUOffloadPolicy + TiledMLP + TRL's
  chunked fused LM head, and Ulysses + ZeRO-3 + ZeRO-Offload + TiledMLP + TRL's chunked head.
- In this process: TRL's `SFTTrainer` (its chunked fused LM head, tiles shrunk so that several run) with hsoffload's
  Trainer integration.
- Context parallelism (accelerate `cp_size`, FSDP2, torch's ring attention) needs 2 CUDA devices: it skips elsewhere
  with its reason (`make gpu-check` runs it on a machine with 2 or more).

The DeepSpeed cases skip with their reason where DeepSpeed is not installed; TRL's where TRL is not.
Not run on a CPU: TRL's `SFTTrainer` under accelerate's Ulysses (accelerate 1.15 on a CPU-only machine runs its
DeepSpeed path with no backend and `num_processes == 1`, so the metric gather in `SFTTrainer.compute_loss` hands a
1-element list to a 2-rank `all_gather` and gloo refuses it; the plain HF Trainer route never gathers).
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from support import launch
from support import composition as C
from support import composition_worker as W  # the case lists (importing it imports neither DeepSpeed nor TRL)

# Every test here launches processes (tests/durations.json: the measured seconds).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "composition_worker.py"


def _missing(module: str, pin: str) -> str:
    """Why the tests that need `module` cannot run here ("" when they can). Found without importing it (as
    test_deepspeed.py does): an installed one that fails to import fails its tests instead of skipping them."""
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed in this environment ({pin})"
    return ""


NO_DEEPSPEED = _missing("deepspeed", "`make install` pins it: requirements/deepspeed.txt")
NO_TRL = _missing("trl", "requirements/dev.txt pins it")
needs_deepspeed = pytest.mark.skipif(bool(NO_DEEPSPEED), reason=NO_DEEPSPEED or "-")
needs_trl = pytest.mark.skipif(bool(NO_TRL), reason=NO_TRL or "-")


def _cases() -> list[str]:
    cases = list(W.FSDP_CASES) + ([] if NO_DEEPSPEED else list(W.DS_CASES))
    return [c for c in cases if not (NO_TRL and c in W.NEEDS_TRL) and not (NO_DEEPSPEED and c in W.NEEDS_DS)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every case that can run here, in one torchrun launch; rank 0's and rank 1's results."""
    out = tmp_path_factory.mktemp("composition")
    t0 = time.perf_counter()
    proc = launch.two_ranks(WORKER, ["--out-dir", str(out), "--cases", ",".join(_cases())], timeout=480)
    assert proc.returncode == 0, launch.tail(proc)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    results[0]["_wall_s"] = time.perf_counter() - t0
    return results


def _case(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    out = []
    for r in ranks:
        res = r["cases"][name]
        assert "error" not in res, f"case {name} raised on rank {r['rank']}:\n{res['error']}"
        out.append(res)
    return out


def check_offload(res: dict[str, Any], hidden_shape: list[int]) -> None:
    """Bit for bit, and exactly one offload per decoder layer per step, all in forward, each restored once as packed."""
    assert res["diffs"] == [], res["diffs"]
    assert res["compared"]["losses"] == C.STEPS and res["compared"]["grads"] == res["compared"]["params"] > 0
    assert res["nonzero_grads"] and res["params_moved"]  # the comparison is not between two idle runs
    if res["after_forward"]:  # plain loops: the counters after every forward and every backward
        fwd, bwd = res["after_forward"], res["after_backward"]
        assert C.per_entry(fwd, "marked_tensors") == [C.LAYERS] * C.STEPS
        assert [f["offloaded_tensors"] for f in fwd] == [C.LAYERS * (i + 1) for i in range(C.STEPS)]
        assert [b["offloaded_tensors"] for b in bwd] == [f["offloaded_tensors"] for f in fwd]  # none in backward
        assert [b["restored_tensors"] for b in bwd] == [C.LAYERS * (i + 1) for i in range(C.STEPS)]
        assert bwd[-1]["skipped_marked_tensors"] == 0 and bwd[-1]["marked_tensors"] == fwd[-1]["marked_tensors"]
        assert C.per_entry(bwd, "offloaded_bytes") == [C.LAYERS * 4 * int(torch.tensor(hidden_shape).prod())] * C.STEPS
    probe = res["probe"]
    assert len(probe["packed"]) == C.LAYERS * C.STEPS, probe
    assert not any(p["in_backward"] for p in probe["packed"]), probe["packed"]
    for p in probe["packed"]:  # this rank's hidden states (its sequence shard), contiguous fp32
        assert p["shape"] == hidden_shape and p["dtype"] == "torch.float32", p
        assert p["stride"] == [hidden_shape[1] * hidden_shape[2], hidden_shape[2], 1], p
    assert probe["restored"] == len(probe["packed"]) and probe["mismatches"] == [], probe


FULL = [C.BATCH, C.SEQ, C.HIDDEN]
SHARD = [C.BATCH, C.SEQ // 2, C.HIDDEN]  # Ulysses over 2 ranks
MLP_SHARDS_PER_STEP = C.LAYERS * C.MLP_SHARDS * 3  # TiledMLP forward, checkpoint recompute, TiledMLP backward


# --------------------------------------------------------------------------- FSDP2


def test_fsdp2_cpu_offload_policy(ranks: list[dict[str, Any]]) -> None:
    """FSDP2 `fully_shard` per decoder layer and at the root with `CPUOffloadPolicy(pin_memory=False)` (the default
    pins and fails without an accelerator), each rank its own batch."""
    for res in _case(ranks, "fsdp2_cpu_offload"):
        assert res["offload_policies"] == ["CPUOffloadPolicy"]
        check_offload(res, FULL)
    a, b = _case(ranks, "fsdp2_cpu_offload")
    assert a["losses"] != b["losses"]  # each rank its own data: the gradient reduction mattered


# --------------------------------------------------------------------------- DeepSpeed


@needs_deepspeed
@pytest.mark.parametrize("case", ["tiled_mlp", "tiled_mlp_reentrant"])
def test_deepspeed_tiled_mlp_in_checkpointed_layers(ranks: list[dict[str, Any]], case: str) -> None:
    """DeepSpeed's TiledMLP (4 tiles) inside every checkpointed decoder layer (non-reentrant and reentrant
    checkpointing), micro-batch 2: its backward runs a forward and a backward per tile inside the layer's backward, and
    the reentrant recompute runs the whole layer there; nothing saved during backward is offloaded. TiledMLP itself
    is exact against the stock MLP (rounding only)."""
    for res in _case(ranks, case):
        check_offload(res, FULL)
        # Saves made during backward (TiledMLP's per-tile forward, the reentrant recompute) reached the scope and were
        # kept in place; forward made none.
        fwd, bwd = res["after_forward"], res["after_backward"]
        assert all(n > 0 for n in C.per_entry(bwd, "backward_saves")), bwd
        assert [f["backward_saves"] for f in fwd] == [0] + [b["backward_saves"] for b in bwd[:-1]]
        assert res["mlp_shards"] == [MLP_SHARDS_PER_STEP] * C.STEPS and res["stock_mlp_shards"] == [0] * C.STEPS
        assert res["tiled_loss"] == pytest.approx(res["stock_loss"], rel=1e-6)
        assert res["worst_grad_diff_vs_stock"] < 1e-5


@needs_deepspeed
def test_ulysses_zero3_plain_loop(ranks: list[dict[str, Any]]) -> None:
    """Ulysses SP over both ranks with ZeRO-3, sdpa: each rank holds and offloads its own (batch, seq / 2, hidden)
    shard; the sharded loss is the unsharded model's (so the sharding is real and right)."""
    results = _case(ranks, "ulysses_zero3")
    for res in results:
        assert res["local_seq"] == C.SEQ // 2 and res["sdpa_entry"] == "uattn_wrapper"
        assert res["losses"][0] == pytest.approx(res["unsharded_loss"], rel=1e-5)
        check_offload(res, SHARD)
    assert results[0]["losses"] == results[1]["losses"]  # the loss over the whole sequence, on every rank


@needs_deepspeed
def test_ulysses_hf_trainer_accelerate(ranks: list[dict[str, Any]]) -> None:
    """HF Trainer, `ParallelismConfig(sp_backend="deepspeed", sp_size=2)`, ZeRO-3 config: accelerate registers Ulysses
    and shards the Trainer's batches; hsoffload's Trainer integration offloads each rank's shard."""
    for res in _case(ranks, "trainer_ulysses"):
        assert res["shapes"] == [[C.BATCH, C.SEQ // 2]] * C.STEPS
        check_offload(res, SHARD)
        s = res["stats"]
        assert s["offloaded_tensors"] == s["restored_tensors"] == s["marked_tensors"] == C.LAYERS * C.STEPS
        assert s["skipped_marked_tensors"] == 0
        assert [e["hsoffload/offloaded_tensors"] for e in res["logged"]] == [C.LAYERS] * C.STEPS


# --------------------------------------------------------------------------- stacks


@needs_trl
@needs_deepspeed
def test_stack_fsdp2_cpu_offload_tiled_mlp_chunked_head(ranks: list[dict[str, Any]]) -> None:
    """FSDP2 + CPUOffloadPolicy + DeepSpeed's TiledMLP + TRL's chunked fused LM head (several tiles) + offload."""
    for res in _case(ranks, "fsdp2_stack"):
        assert res["offload_policies"] == ["CPUOffloadPolicy"]
        assert res["mlp_shards"] == [MLP_SHARDS_PER_STEP] * C.STEPS
        tiles = C.fused_head_tiles(C.BATCH * (C.SEQ - 1))  # 16: 4 token x 4 vocabulary tiles
        assert res["head_tiles"] == [[tiles] * C.STEPS] * 2, res["head_tiles"]
        check_offload(res, FULL)


@needs_trl
@needs_deepspeed
def test_stack_ulysses_zero3_offload_tiled_mlp_chunked_head(ranks: list[dict[str, Any]]) -> None:
    """Ulysses SP + ZeRO-3 with ZeRO-Offload (parameters and optimizer states on the host) + TiledMLP + TRL's chunked
    fused LM head on the pre-shifted shard labels + offload: every knob of the long-context recipe at once."""
    results = _case(ranks, "ulysses_stack")
    for res in results:
        assert res["local_seq"] == C.SEQ // 2 and res["sdpa_entry"] == "uattn_wrapper"
        assert res["mlp_shards"] == [MLP_SHARDS_PER_STEP] * C.STEPS
        tiles = C.fused_head_tiles(C.BATCH * C.SEQ // 2)  # 8: the shard's pre-shifted labels, 2 token x 4 vocabulary
        assert res["head_tiles"] == [[tiles] * C.STEPS] * 2, res["head_tiles"]
        check_offload(res, SHARD)
    assert results[0]["losses"] == results[1]["losses"]


def test_suite_wall_time(ranks: list[dict[str, Any]]) -> None:
    """The one launch stays small (issue 27: the composition tests add at most 2 minutes to CI on 2 cores)."""
    assert ranks[0]["_wall_s"] < 120, ranks[0]["_wall_s"]


# --------------------------------------------------------------------------- TRL SFTTrainer, in this process


def _sft_run(tmp_path: Path, offload: bool) -> dict[str, Any]:
    import datasets
    import transformers
    import trl

    from hsoffload.integrations import enable_hidden_state_offload
    from hsoffload.targets import current_training_args

    record: dict[str, Any] = {"losses": [], "grads": [], "params": [], "tiles": []}

    class Record(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            record["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})

        def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            record["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})

    class Recording(trl.SFTTrainer):
        def compute_loss(self, model: Any, inputs: Any, *a: Any, **k: Any) -> Any:
            loss = super().compute_loss(model, inputs, *a, **k)
            record["losses"].append((loss[0] if isinstance(loss, tuple) else loss).detach().clone())
            return loss

        def training_step(self, *a: Any, **k: Any) -> Any:
            with C.TileCounter() as tiles:  # forward and backward of one micro-batch, in both runs alike
                out = super().training_step(*a, **k)
            record["tiles"].append(tiles.tiles)
            return out

    rows = [{"input_ids": b["input_ids"][j].tolist()} for b in W._batches(seed=500, n=C.STEPS) for j in range(C.BATCH)]
    config = trl.SFTConfig(**current_training_args(dict(
        output_dir=str(tmp_path / ("on" if offload else "off")), max_steps=C.STEPS, per_device_train_batch_size=C.BATCH,
        learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, report_to=[], save_strategy="no", use_cpu=True,
        bf16=False, disable_tqdm=True, dataloader_num_workers=0, dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False, seed=0, data_seed=0,
    )))
    model = C.tiny_model("sdpa")
    trainer = Recording(model=model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                        processing_class=C.tiny_tokenizer(), callbacks=[Record()])
    probe = None
    if offload:
        enable_hidden_state_offload(trainer, offload_cpu_tensors=True, min_offload_size=0)
        probe = C.Probe(trainer.hsoffload_scope)
    trainer.train()
    record["probe"] = probe.report() if probe else {}
    record["logged"] = [e for e in trainer.state.log_history if "loss" in e]
    return record


@needs_trl
def test_sft_trainer_chunked_fused_head(tmp_path: Path) -> None:
    """TRL's SFTTrainer (which always installs its chunked fused LM head) with hsoffload's Trainer integration; the
    head's tiles shrunk so that several run (4 token x 4 vocabulary tiles per forward). (With DeepSpeed's TiledMLP too
    in the stacks above: DeepSpeed is kept out of this process.)"""
    old = C.shrink_fused_head_tiles()
    try:
        off = _sft_run(tmp_path, False)
        on = _sft_run(tmp_path, True)
    finally:
        C.restore_fused_head_tiles(old)
    res = C.summary(off, on, 0.0)
    check_offload(res, FULL)
    assert off["tiles"] == on["tiles"] == [C.fused_head_tiles(C.BATCH * (C.SEQ - 1))] * C.STEPS, on["tiles"]
    assert [e["hsoffload/offloaded_tensors"] for e in on["logged"]] == [C.LAYERS] * C.STEPS
    assert "mean_token_accuracy" in on["logged"][0]  # the fused head's outputs reached TRL's metrics


# --------------------------------------------------------------------------- context parallelism (2 GPUs)


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_devices() < 2, reason=f"context parallelism needs 2 CUDA devices, found {_cuda_devices()}")
def test_context_parallel_fsdp2_ring_attention(tmp_path: Path) -> None:
    """accelerate `ParallelismConfig(cp_size=2)` with FSDP2 and torch's ring attention (sdpa), 2 GPUs (nccl): each rank
    offloads its own sequence shard, bit for bit against the same run without offload."""
    proc = launch.two_ranks(WORKER, ["--out-dir", str(tmp_path), "--cases", "cp_fsdp2", "--backend", "nccl"],
                            timeout=480, deepspeed=False)
    assert proc.returncode == 0, launch.tail(proc)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    results = _case(ranks, "cp_fsdp2")
    for res in results:
        assert res["local_seq"] == C.SEQ // 2
        check_offload(res, SHARD)
