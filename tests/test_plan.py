"""`hsoffload plan`: its byte figures against the counters of a small real run, and its verdicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hf_tiny as H
import hsoffload
from hsoffload import plan
from hsoffload.cli import main

REPO = Path(__file__).resolve().parent.parent


def _write_config(tmp_path: Path, layers: int) -> Path:
    H.tiny_config("llama", layers).save_pretrained(tmp_path)
    return tmp_path / "config.json"


def test_plan_bytes_match_a_real_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layers, batch, seq = 4, 2, 24
    config = _write_config(tmp_path, layers)
    assert main(["plan", str(tmp_path), "--seq-len", str(seq), "--micro-batch", str(batch), "--dtype", "float32",
                 "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    for key in ("device_bytes_checkpointing", "device_bytes_offload", "host_bytes_per_node", "spill_bytes_per_node",
                "verdict"):
        assert key in p
    model = H.tiny_model("llama", layers=layers)
    H.enable_checkpointing(model, reentrant=False)
    ids = torch.randint(3, H.VOCAB, (batch, seq))
    with hsoffload.offload_hidden_states(model, offload_cpu_tensors=True, min_offload_size=0) as scope:
        model(input_ids=ids, labels=ids).loss.backward()
    measured = scope.stats.offloaded_bytes
    assert scope.stats.offloaded_tensors == layers
    # What checkpointing alone keeps for backward is what we offloaded; the plan predicts both within 5 %.
    assert abs(p["offloaded_bytes_per_rank"] - measured) <= 0.05 * measured
    assert abs(p["device_bytes_checkpointing"] - measured) <= 0.05 * measured
    assert abs(p["host_bytes_per_node"] - measured) <= 0.05 * measured  # one rank, far below this node's RAM
    assert p["spill_bytes_per_node"] == 0 and p["verdict"] == "fits"
    assert p["device_bytes_offload"] == 2 * measured // layers  # the layer in backward plus one prefetched
    assert p["parameters"] == sum(t.numel() for t in model.parameters())


def test_plan_verdicts_for_one_million_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = str(REPO / "configs" / "llama-8b-shape.json")
    args = ["plan", cfg, "--seq-len", "1048576", "--world-size", "8", "--json"]
    assert main(args + ["--host-ram-gib", "4096"]) == 0  # 80 % of 4 TiB holds 8 x 256 GiB
    roomy = json.loads(capsys.readouterr().out)
    assert roomy["offloaded_bytes_per_rank"] == 32 * 1048576 * 4096 * 2  # 256 GiB per rank
    assert roomy["host_bytes_per_node"] == 8 * roomy["offloaded_bytes_per_rank"]
    assert roomy["verdict"] == "fits" and roomy["spill_bytes_per_node"] == 0
    assert main(args + ["--host-ram-gib", "1024"]) == 0
    tight = json.loads(capsys.readouterr().out)
    assert tight["verdict"] == "fits with spill"
    assert tight["spill_bytes_per_node"] == 8 * tight["offloaded_bytes_per_rank"] - int(1024 * 2**30 * 0.8)
    assert main(args + ["--host-ram-gib", "4096", "--device-gib", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "does not fit"
    assert main(["plan", cfg, "--seq-len", "1048576", "--world-size", "8", "--host-ram-gib", "1024"]) == 0
    text = capsys.readouterr().out
    assert "verdict: fits with spill (set spill_dir)" in text and "per layer" in text


def test_plan_refuses_what_is_not_a_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(tmp_path), "--seq-len", "8"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["plan", str(tmp_path), "--seq-len", "0"]) == 2
    assert "--seq-len" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--dtype"):
        plan.plan(plan.PlanInput(config=str(REPO / "configs" / "llama-8b-shape.json"), seq_len=8, dtype="int3"))


def test_plan_sac_and_layer_budget_match_a_real_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Policy "sac" keeping the projections' matmul outputs, and keep_last_layers: the plan's offloaded bytes
    against the counters of the same run."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    layers, batch, seq = 4, 2, 24
    _write_config(tmp_path, layers)
    assert main(["plan", str(tmp_path), "--seq-len", str(seq), "--micro-batch", str(batch), "--dtype", "float32",
                 "--policy", "sac", "--keep-last-layers", "1", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}  # the projections (attention's bmm is not)

    def sac(ctx, op, *args, **kwargs):  # noqa: ANN001
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    model = H.tiny_model("llama", layers=layers)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, sac)})
    model.train()
    ids = torch.randint(3, H.VOCAB, (batch, seq))
    with hsoffload.offload_hidden_states(model, policy="sac", keep_last_layers=1, offload_cpu_tensors=True,
                                         min_offload_size=0) as scope:
        model(input_ids=ids, labels=ids).loss.backward()
    measured = scope.stats.offloaded_bytes
    assert abs(p["offloaded_bytes_per_rank"] - measured) <= 0.05 * measured, (p["offloaded_bytes_per_rank"], measured)
    assert p["device_bytes_offload"] == 3 * p["layer_input_bytes"]  # the kept layer, the one in backward, a prefetch
    assert main(["plan", str(tmp_path), "--seq-len", "8", "--policy", "all"]) == 2
    assert "--policy must be one of hidden_states, sac" in capsys.readouterr().err
