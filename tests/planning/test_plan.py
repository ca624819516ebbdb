"""`hsoffload plan`: its byte figures against the counters of a small real run, its device-peak terms and knobs,
verdicts, --max-seq, and its refusals. The device peak against a real allocator:
tests/device/emu/test_device_peak.py."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from support import hf_tiny as H
import hsoffload
from hsoffload import plan
from hsoffload.tools.cli import main
from hsoffload.targets import enable_checkpointing

REPO = Path(__file__).resolve().parents[2]


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


LLAMA_8B = str(REPO / "configs" / "llama-8b-shape.json")
GIB = 1 << 30


def _sharded(p: dict[str, Any]) -> bool:
    """The plan's model states are FSDP-sharded (FSDP over more than one rank)."""
    return p["input"]["fsdp"] and p["input"]["world_size"] > 1


def _same_plan(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two plans' JSON alike but for where their input read the config.json from."""
    return {**a, "input": {**a["input"], "config": None}} == {**b, "input": {**b["input"], "config": None}}


def _plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_one_million_tokens_does_not_fit_without_sequence_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    args = [LLAMA_8B, "--seq-len", "1048576", "--world-size", "8", "--device-gib", "80", "--host-ram-gib", "4096"]
    p = _plan_json(capsys, *args)
    assert p["offloaded_bytes_per_rank"] == 32 * 1048576 * 4096 * 2  # 256 GiB per rank of hidden states
    assert p["verdict"] == "does not fit" and p["dominant_term"] == "logits"
    # The logits alone, in bf16, are 1M x 128256 x 2 B; the loss adds float32 log-probabilities and gradients.
    assert p["terms"]["logits"] == 1048576 * 128256 * 2
    assert p["dominant_term_bytes"] > 5 * p["terms"]["logits"]
    assert p["device_peak_bytes"] > 15 * 80 * GIB
    assert p["device_peak_bytes_checkpointing"] > p["device_peak_bytes"]
    assert p["device_peak_bytes_no_checkpointing"] > p["device_peak_bytes_checkpointing"]
    # One layer's recompute materialises the MLP's gate, up, act and product: 4 x 1M x 14336 x 2 B = 112 GiB.
    assert p["terms"]["mlp_saved"] == 4 * 1048576 * 14336 * 2
    assert "logits" in p["advice"] and "--sequence-parallel 8" in p["advice"] and p["fixes"]
    assert main(["plan", *args]) == 0
    text = capsys.readouterr().out
    assert "verdict: does not fit; the logits and their float32 loss need" in text
    assert "peak, checkpointing only" in text


def test_one_million_tokens_with_ulysses_tiling_and_a_chunked_loss(capsys: pytest.CaptureFixture[str]) -> None:
    args = [LLAMA_8B, "--seq-len", "1048576", "--world-size", "8", "--device-gib", "80", "--sequence-parallel", "8",
            "--chunked-loss", "--tiled-mlp", "16"]
    roomy = _plan_json(capsys, *args, "--host-ram-gib", "4096")
    assert roomy["tokens_per_rank"] == 131072 and roomy["terms"]["logits"] == 0
    assert roomy["offloaded_bytes_per_rank"] == 32 * 131072 * 4096 * 2
    assert roomy["verdict"] == "fits" and roomy["device_peak_bytes"] <= 80 * GIB
    assert roomy["device_peak_bytes_checkpointing"] > roomy["device_peak_bytes"] + 25 * GIB  # 31 of 32 inputs moved
    assert main(["plan", *args, "--host-ram-gib", "128", "--json"]) == 0
    tight = json.loads(capsys.readouterr().out)
    assert tight["verdict"] == "fits with spill"
    assert tight["spill_bytes_per_node"] == 8 * tight["offloaded_bytes_per_rank"] - int(128 * GIB * 0.8)
    assert _plan_json(capsys, *args, "--host-ram-gib", "4096", "--device-gib", "4")["verdict"] == "does not fit"
    assert main(["plan", *args, "--host-ram-gib", "128"]) == 0
    assert "verdict: fits with spill (set spill_dir)" in capsys.readouterr().out


def test_each_knob_moves_its_term(capsys: pytest.CaptureFixture[str]) -> None:
    base = [LLAMA_8B, "--seq-len", "65536", "--world-size", "8", "--device-gib", "80", "--host-ram-gib", "4096"]
    p = _plan_json(capsys, *base)
    assert _sharded(p) and p["terms"]["weights"] == p["parameters"] * 2 // 8
    unsharded = _plan_json(capsys, *base, "--no-fsdp")
    assert unsharded["terms"]["weights"] == p["parameters"] * 2 and unsharded["terms"]["fsdp_gathered_layers"] == 0
    single = _plan_json(capsys, LLAMA_8B, "--seq-len", "65536", "--host-ram-gib", "4096")
    assert single["terms"]["optimizer_states"] == single["parameters"] * 8 and not _sharded(single)
    assert _plan_json(capsys, *base, "--optimizer", "sgd")["terms"]["optimizer_states"] == 0
    chunked = _plan_json(capsys, *base, "--chunked-loss")
    assert chunked["terms"]["logits"] == 0 and chunked["device_peak_bytes"] < p["device_peak_bytes"]
    tiled = _plan_json(capsys, *base, "--tiled-mlp", "16")
    assert tiled["terms"]["mlp_saved"] == 65536 * 4096 * 2  # only the MLP's input
    sp = _plan_json(capsys, *base, "--sequence-parallel", "4")
    assert sp["tokens_per_rank"] == 16384 and sp["device_peak_bytes"] < p["device_peak_bytes"] / 3
    eager = _plan_json(capsys, *base, "--attn", "eager")
    # transformers' eager attention: float32 probabilities per head, S x S
    assert eager["terms"]["attention_saved"] > 32 * 65536 * 65536 * 4
    assert eager["verdict"] == "does not fit"
    flash = _plan_json(capsys, *base, "--attn", "flash")
    assert flash["terms"]["attention_saved"] < 65536 * 4096 * 2 * 4
    none = _plan_json(capsys, *base, "--no-checkpointing")
    assert none["input"]["policy"] == "all" and not none["input"]["checkpointing"]
    assert none["device_peak_bytes"] < none["device_peak_bytes_no_checkpointing"]
    sac = _plan_json(capsys, *base, "--policy", "sac")
    assert sac["device_bytes_checkpointing"] > p["device_bytes_checkpointing"]
    micro = _plan_json(capsys, *base, "--micro-batch", "2")
    assert micro["tokens_per_rank"] == 2 * 65536 and micro["device_peak_bytes"] > p["device_peak_bytes"]


def test_max_seq_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", LLAMA_8B, "--max-seq", "--world-size", "8", "--device-gib", "80", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    rows = {row["knobs"]: row for row in r["rows"]}
    assert list(rows)[0] == "as given" and len(rows) == 5
    for row in r["rows"]:
        assert row["hsoffload"]["seq_len"] >= row["checkpointing"]["seq_len"] > 0
        assert row["hsoffload"]["peak_bytes"] <= 80 * GIB
    lengths = [row["hsoffload"]["seq_len"] for row in r["rows"]]
    assert lengths == sorted(lengths) and lengths[-1] > 1_000_000
    # Model states on the host free the 11.2 GiB of sharded states per rank (less the root's gathered weights).
    on_host = rows["+ chunked loss + tiled MLP + sequence parallel 8 + model states on host"]
    assert on_host["hsoffload"]["seq_len"] > 1.1 * rows["+ chunked loss + tiled MLP + sequence parallel 8"]["hsoffload"]["seq_len"]
    # The longest length that fits does fit, and 1024 tokens more does not.
    best = rows["+ chunked loss"]["hsoffload"]["seq_len"]
    common = [LLAMA_8B, "--world-size", "8", "--device-gib", "80", "--chunked-loss", "--host-ram-gib", "4096"]
    assert _plan_json(capsys, *common, "--seq-len", str(best))["verdict"] == "fits"
    assert _plan_json(capsys, *common, "--seq-len", str(best + 1024))["verdict"] == "does not fit"
    assert main(["plan", LLAMA_8B, "--max-seq", "--world-size", "8", "--device-gib", "141"]) == 0
    text = capsys.readouterr().out
    assert "checkpointing only" in text and "+ chunked loss + tiled MLP + sequence parallel 8" in text
    sp = _plan_json(capsys, LLAMA_8B, "--max-seq", "--world-size", "8", "--sequence-parallel", "8",
                    "--device-gib", "80")
    assert all(row["hsoffload"]["seq_len"] % 8 == 0 for row in sp["rows"]) and sp["rows"][-1]["hsoffload"]["seq_len"] > 1_000_000
    assert sp["rows"][0]["hsoffload"]["seq_len"] > 4 * rows["as given"]["hsoffload"]["seq_len"]
    # One 80 GiB rank: AdamW's states alone (89.7 GiB) leave no room, until they move to the host.
    one = _plan_json(capsys, LLAMA_8B, "--max-seq", "--device-gib", "80")
    assert [row["hsoffload"]["seq_len"] for row in one["rows"][:-1]] == [0, 0, 0]
    assert one["rows"][-1]["knobs"] == "+ chunked loss + tiled MLP + model states on host"
    assert one["rows"][-1]["hsoffload"]["seq_len"] > 500_000 and one["rows"][-1]["checkpointing"]["seq_len"] > 100_000
    assert one["model_states_host_bytes_per_node"] == 8030261248 * 18  # bf16 weights, fp32 masters/grads, 2 moments
    assert main(["plan", LLAMA_8B, "--max-seq", "--device-gib", "40", "--optimizer", "adamw", "--world-size",
                 "1", "--micro-batch", "64"]) == 0
    assert "none fits" in (text := capsys.readouterr().out) and "--cpu-offload" in text


def test_multimodal_and_moe_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import transformers

    from hsoffload.planning import memory as pm

    moe = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=16)
    mixtral = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2)
    for cfg in (moe, mixtral, *(H.tiny_config(f) for f in H.FAMILIES)):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        assert pm.shape_from_config(cfg.to_dict()).parameters() == sum(t.numel() for t in model.parameters()), cfg
    assert pm.shape_from_config(moe.to_dict()).moe_layers == 3
    # A vision-language config: the text part under text_config.
    text = H.tiny_config("llama").to_dict()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": text,
                                                      "vision_config": {"model_type": "clip_vision_model"}}))
    p = _plan_json(capsys, str(tmp_path), "--seq-len", "64")
    assert p["model_type"].startswith("llava (text model llama") and p["layers"] == text["num_hidden_layers"]
    bad = dict(moe.to_dict())
    bad.pop("num_experts_per_tok")
    (tmp_path / "config.json").write_text(json.dumps(bad))
    assert main(["plan", str(tmp_path), "--seq-len", "64"]) == 2
    assert "num_experts_per_tok" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--seq-len", "0"], "--seq-len must be >= 1"),
    (["--seq-len", "1001", "--world-size", "8", "--sequence-parallel", "8"], "not divisible by --sequence-parallel"),
    (["--seq-len", "1024", "--sequence-parallel", "0"], "--sequence-parallel must be >= 1"),
    (["--seq-len", "1024", "--sequence-parallel", "8"], "needs at least that many ranks"),
    (["--seq-len", "1024", "--world-size", "64", "--sequence-parallel", "64"], "does not divide the 32 heads"),
    (["--seq-len", "1024", "--world-size", "8", "--sequence-parallel", "8", "--sequence-parallel-kind", "ring",
      "--attn", "eager"], "ring attention (--sequence-parallel-kind ring) runs SDPA's fused kernels"),
    (["--seq-len", "1032", "--world-size", "8", "--sequence-parallel", "8", "--sequence-parallel-kind", "ring"],
     "--seq-len 1032 is not a multiple of 16"),
    (["--seq-len", "1024", "--sequence-parallel-kind", "star"], "--sequence-parallel-kind must be one of ulysses, ring"),
    (["--seq-len", "1024", "--cpu-offload", "disk"], "--cpu-offload must be one of none, optimizer, params"),
    (["--seq-len", "1024", "--fused-kernels", "unsloth"], "--fused-kernels must be one of none, liger"),
    (["--seq-len", "1024", "--world-size", "-2"], "--world-size must be >= 1"),
    (["--seq-len", "1024", "--tiled-mlp", "0"], "--tiled-mlp must be >= 1"),
    (["--seq-len", "1024", "--attn", "fast"], "--attn must be one of"),
    (["--seq-len", "1024", "--policy", "some"], "--policy must be one of"),
    (["--seq-len", "1024", "--optimizer", "lion"], "--optimizer must be one of"),
    (["--seq-len", "1024", "--no-checkpointing", "--policy", "hidden_states"], "use --policy all"),
    (["--seq-len", "1024", "--device-gib", "0"], "--device-gib must be > 0"),
    ([], "--seq-len is required"),
])
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", LLAMA_8B, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("content, message", [
    ({"hidden_size": 8}, "has no model_type"),
    ({"model_type": "not_a_model"}, "unknown model_type 'not_a_model'"),
    ({"model_type": "llama"}, "no hidden_size, num_hidden_layers, num_attention_heads, vocab_size"),
    ({"model_type": "deepseek_v3", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
      "vocab_size": 8, "kv_lora_rank": 4}, "multi-head latent attention"),
    ({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": -1, "num_attention_heads": 4,
      "vocab_size": 128}, "num_hidden_layers must be >= 1, got -1"),
    ([1, 2], "holds one JSON object"),
    ("{not json", "not a JSON file"),
])
def test_bad_configs_are_one_line_and_exit_2(tmp_path: Path, content: object, message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    assert main(["plan", str(tmp_path), "--seq-len", "64"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_plan_refuses_what_is_not_a_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(tmp_path), "--seq-len", "8"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["plan", str(tmp_path), "--seq-len", "0"]) == 2
    assert "--seq-len" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--dtype"):
        plan.plan(plan.PlanInput(config=LLAMA_8B, seq_len=8, dtype="int3"))


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
    enable_checkpointing(model, {
        "use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, sac)})
    model.train()
    ids = torch.randint(3, H.VOCAB, (batch, seq))
    with hsoffload.offload_hidden_states(model, policy="sac", keep_last_layers=1, offload_cpu_tensors=True,
                                         min_offload_size=0) as scope:
        model(input_ids=ids, labels=ids).loss.backward()
    measured = scope.stats.offloaded_bytes
    assert abs(p["offloaded_bytes_per_rank"] - measured) <= 0.05 * measured, (p["offloaded_bytes_per_rank"], measured)
    assert p["device_bytes_offload"] == 3 * p["layer_input_bytes"]  # the kept layer, the one in backward, a prefetch
    assert main(["plan", str(tmp_path), "--seq-len", "8", "--policy", "everything"]) == 2
    assert "--policy must be one of hidden_states, sac, all" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Model states on the host, fused kernels, the kinds of sequence parallelism, MoE routing (issue 27)

LLAMA_8B_PARAMETERS = 8030261248
LLAMA_8B_ROOT = 2 * 128256 * 4096 + 4096  # embedding, untied head, final norm


def test_model_states_on_the_host(capsys: pytest.CaptureFixture[str]) -> None:
    """--cpu-offload moves the model states' bytes from the device to the node's pinned host memory, byte for byte,
    lowers the device peak, and the host side (budget, spill, verdict) counts them."""
    args = [LLAMA_8B, "--seq-len", "131072", "--device-gib", "80", "--chunked-loss", "--tiled-mlp", "32",
            "--host-ram-gib", "1024"]
    none = _plan_json(capsys, *args)
    opt = _plan_json(capsys, *args, "--cpu-offload", "optimizer")
    params = _plan_json(capsys, *args, "--cpu-offload", "params")
    p = LLAMA_8B_PARAMETERS
    assert none["model_states_device_bytes"] == p * (2 + 2 + 8) and none["model_states_host_bytes_per_node"] == 0
    # optimizer: bf16 weights and gradients stay; two float32 moments, float32 masters and gradients on the host
    assert opt["model_states_device_bytes"] == p * (2 + 2) and opt["terms"]["optimizer_states"] == 0
    assert opt["terms"]["optimizer_update"] == 0 and opt["model_states_host_bytes_per_node"] == p * (8 + 4 + 4)
    # params: only the root module's weights (gathered) on the device; the bf16 weights join the host side
    assert params["model_states_device_bytes"] == LLAMA_8B_ROOT * 2
    assert params["model_states_host_bytes_per_node"] == p * (8 + 4 + 4 + 2)
    assert params["terms"]["fsdp_gathered_layers"] == 2 * 218112000 * 2  # two whole layers, even on one rank
    assert none["verdict"] == "does not fit" and "optimizer states" in none["advice"] and "--cpu-offload" in none["advice"]
    assert params["device_peak_bytes"] < opt["device_peak_bytes"] < none["device_peak_bytes"]
    assert opt["verdict"] == params["verdict"] == "fits"
    # The host budget (max_host_bytes=auto) is 80 % of what the pinned model states leave.
    assert params["host_budget_bytes_per_node"] == int((1024 * GIB - params["model_states_host_bytes_per_node"]) * 0.8)
    # A node whose RAM the states overflow: the verdict says so, whatever the device says.
    small = _plan_json(capsys, *args[:-1], "160", "--cpu-offload", "params")
    assert small["verdict"] == "does not fit" and not small["host_model_states_fit"]
    assert "model states on the host need 134.6 GiB per node" in small["advice"]
    # With just enough RAM for the states, what the offload needs beyond 80 % of the rest spills.
    tight = _plan_json(capsys, LLAMA_8B, "--seq-len", "262144", "--device-gib", "80", "--chunked-loss",
                       "--tiled-mlp", "64", "--host-ram-gib", "200", "--cpu-offload", "params")
    states = tight["model_states_host_bytes_per_node"]
    assert tight["host_budget_bytes_per_node"] == int((200 * GIB - states) * 0.8)  # 52.3 GiB for 64 GiB offloaded
    assert tight["spill_bytes_per_node"] == 32 * 262144 * 4096 * 2 - tight["host_budget_bytes_per_node"] > 0
    assert tight["verdict"] == "fits with spill"
    # DeepSpeed's bf16 mixed precision keeps float32 masters beside the moments: on the device, 12 B per parameter;
    # on the host the same 16 B as AdamW (the masters are not counted twice).
    master = _plan_json(capsys, *args, "--optimizer", "adamw_master")
    assert master["terms"]["optimizer_states"] == p * 12 and master["terms"]["optimizer_update"] == p * 4
    assert _plan_json(capsys, *args, "--optimizer", "adamw_master", "--cpu-offload",
                      "optimizer")["model_states_host_bytes_per_node"] == p * 16
    # Sharded over 8 ranks on one node: each rank holds its eighth; the node holds them all.
    eight = _plan_json(capsys, *args, "--world-size", "8", "--cpu-offload", "optimizer")
    assert eight["model_states_host_bytes_per_node"] == p * 16 // 8 * 8
    assert eight["model_states_device_bytes"] == 2 * (p * 2 // 8)
    assert main(["plan", *args, "--cpu-offload", "params"]) == 0
    text = capsys.readouterr().out
    assert "model states on the host" in text and "model states, all ranks (pinned)" in text


def _tiny(tmp_path: Path, **over: object) -> str:
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
           "tie_word_embeddings": False, **over}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_liger_kernels_save_what_their_autograd_functions_save(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Exact bytes, tiny Llama, bf16, 1024 tokens: LigerSiLUMulFunction saves gate and up (down_proj the product),
    three intermediates where the eager MLP keeps four; LigerRMSNormFunction saves its input and a float32 inverse
    RMS per row, where transformers' keeps a float32 copy of the input and the normalised tensor."""
    config = _tiny(tmp_path)
    t, h, i, b = 1024, 64, 256, 2
    eager = _plan_json(capsys, config, "--seq-len", str(t))
    liger = _plan_json(capsys, config, "--seq-len", str(t), "--fused-kernels", "liger")
    assert liger["input"]["chunked_loss"] and liger["input"]["fused_kernels"] == "liger"
    assert eager["terms"]["mlp_saved"] == 4 * t * i * b and liger["terms"]["mlp_saved"] == 3 * t * i * b
    attention = t * (64 + 2 * 32 + 64) * b + t * 4 * 4  # q, k, v, output, float32 logsumexp per head
    assert eager["terms"]["attention_saved"] == liger["terms"]["attention_saved"] == attention
    eager_norms = 2 * t * h * (2 * b + 4)  # per norm: normalised + output in bf16, float32 copy of the input
    liger_norms = 2 * (t * h * b + t * 4) + t * h * b  # per norm: output + inverse RMS; the mid residual (its input)
    assert eager["terms"]["layer_saved"] == eager_norms + attention + 4 * t * i * b
    assert liger["terms"]["layer_saved"] == liger_norms + attention + 3 * t * i * b
    assert liger["device_peak_bytes"] < _plan_json(capsys, config, "--seq-len", str(t),
                                                   "--chunked-loss")["device_peak_bytes"]
    assert main(["plan", config, "--seq-len", str(t), "--fused-kernels", "liger"]) == 0
    assert "liger kernels" in capsys.readouterr().out


def test_sequence_parallel_kinds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Ulysses: all-to-all buffers of q, k, v and the output, with key/value heads replicated up to D (2 KV heads,
    D 4); ring: key/value chunks in flight and a float32 merge; the plan says which it models."""
    config = _tiny(tmp_path)
    t_rank, hd, b = 4096 // 4, 16, 2
    common = [config, "--seq-len", "4096", "--world-size", "4", "--sequence-parallel", "4"]
    ulysses = _plan_json(capsys, *common)
    assert ulysses["input"]["sequence_parallel_kind"] == "ulysses" and ulysses["tokens_per_rank"] == t_rank
    assert ulysses["terms"]["ulysses_buffers"] == t_rank * (2 * 4 + 2 * 4) * hd * b  # 2 KV heads replicated to 4
    assert ulysses["terms"]["ring_buffers"] == 0
    ring = _plan_json(capsys, *common, "--sequence-parallel-kind", "ring")
    kv_chunk = t_rank * 2 * 2 * hd * b
    assert ring["terms"]["ring_buffers"] == 4 * kv_chunk + t_rank * 4 * (hd + 1) * 4
    assert ring["terms"]["ulysses_buffers"] == 0
    assert main(["plan", *common]) == 0
    assert "sequence parallel 4 (Ulysses all-to-all)" in capsys.readouterr().out
    assert main(["plan", *common, "--sequence-parallel-kind", "ring"]) == 0
    assert "sequence parallel 4 (ring key/value chunks)" in capsys.readouterr().out


def test_ulysses_refuses_a_degree_the_heads_do_not_allow(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """12 heads, 4 KV heads: D 6 divides the heads but neither divides nor is divided by the KV heads (DeepSpeed
    replicates KV heads only by a whole factor); D 8 does not divide the heads. Ring attention takes both."""
    config = _tiny(tmp_path, num_attention_heads=12, num_key_value_heads=4, hidden_size=96, head_dim=8)
    base = ["plan", config, "--seq-len", "4800", "--world-size", "8"]
    assert main([*base, "--sequence-parallel", "6"]) == 2
    err = capsys.readouterr().err
    assert "the 4 key/value heads divisible by --sequence-parallel 6" in err and "ring" in err, err
    assert main([*base, "--sequence-parallel", "8"]) == 2
    assert "does not divide the 12 heads" in capsys.readouterr().err
    assert main([*base, "--sequence-parallel", "6", "--sequence-parallel-kind", "ring", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens_per_rank"] == 800
    assert main([*base, "--sequence-parallel", "2", "--json"]) == 0  # 12 % 2 == 0, 4 % 2 == 0
    capsys.readouterr()
    # --max-seq picks the largest degree Ulysses allows: 4 (8 does not divide 12 heads)
    r = _plan_json(capsys, config, "--max-seq", "--world-size", "8", "--device-gib", "80")
    assert "sequence parallel 4" in r["rows"][3]["knobs"]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe", "jetmoe", "granitemoe"])
def test_default_experts_implementation_is_what_transformers_picks(model_type: str) -> None:
    """The planner decides without importing transformers; transformers decides per model class (grouped_mm where the
    modeling file uses its experts interface, the loop elsewhere): both must agree."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    ok = int(transformers.__version__.split(".")[0]) >= 5 and cls._can_set_experts_implementation()
    assert plan.default_experts_implementation(model_type) == ("grouped_mm" if ok else "eager")


def test_llama4_experts_are_refused_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {"model_type": "llama4_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "num_local_experts": 4,
           "num_experts_per_tok": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", str(tmp_path), "--seq-len", "1024"]) == 2
    assert "Llama 4's experts run every routed token through a batched matmul" in capsys.readouterr().err


def test_moe_routing_buffers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """transformers' expert loop keeps an int64 one-hot expert mask (tokens x top-k x experts + 1), the top-k
    indices and weights and an output accumulator alive while its experts run; grouped_mm the routed outputs twice
    (weighted, then in token order) and the sort's bookkeeping; dense models have none. The default is what the
    installed transformers runs (grouped_mm from 5.0), named in the JSON and the table."""
    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
           "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t = 2048
    p = _plan_json(capsys, str(tmp_path), "--seq-len", str(t), "--experts-implementation", "eager")
    assert p["terms"]["moe_routing"] == t * 4 * 17 * 8 + t * 4 * (8 + 2) + t * 64 * 2
    grouped = _plan_json(capsys, str(tmp_path), "--seq-len", str(t), "--experts-implementation", "grouped_mm")
    assert grouped["terms"]["moe_routing"] == 2 * t * 4 * 64 * 2 + t * 4 * (3 * 8 + 4)
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    assert _plan_json(capsys, str(tmp_path), "--seq-len", str(t))["input"]["experts_implementation"] == \
        model.config._experts_implementation  # what transformers itself picked for this model
    assert main(["plan", str(tmp_path), "--seq-len", str(t), "--experts-implementation", "grouped_mm"]) == 0
    assert "experts grouped_mm" in capsys.readouterr().out
    assert main(["plan", str(tmp_path), "--seq-len", str(t), "--experts-implementation", "loop"]) == 2
    assert "--experts-implementation must be one of grouped_mm, eager, got 'loop'" in capsys.readouterr().err
    dense_dir = tmp_path / "dense"
    dense_dir.mkdir()
    dense = _plan_json(capsys, _tiny(dense_dir), "--seq-len", str(t))
    assert dense["terms"]["moe_routing"] == 0 and dense["input"]["experts_implementation"] is None


# ---------------------------------------------------------------------------------------------------------------
# Real widths without a GPU: transformers' own model code run under FakeTensorMode (no compute, real shapes and
# lifetimes), its live bytes counted by torch's MemTracker, against the plan (issue 27 item 3).

_CAUSAL = "hsplan_causal"


def _causal_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: object, dropout: float = 0.0, scaling: object = None,
                      **kwargs: object) -> tuple[torch.Tensor, None]:
    """SDPA's flash kernel for CPU, causal, with no mask tensor: what SDPA runs on a GPU for an unpadded batch.
    Under FakeTensorMode transformers cannot prove a batch unpadded and would build an S x S mask a real run skips."""
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout, True,
                                                                       scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _real_width_config(name: str, vocab: Optional[int]) -> "transformers.PretrainedConfig":
    import transformers

    transformers.AttentionInterface.register(_CAUSAL, _causal_attention)
    transformers.masking_utils.AttentionMaskInterface.register(_CAUSAL, lambda *args, **kwargs: None)
    if name == "llama-3-8b":
        cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                       vocab_size=vocab or 128256, tie_word_embeddings=False,
                                       max_position_embeddings=65536)
    elif name == "dense-32b":  # Qwen3-32B's widths
        cfg = transformers.Qwen3Config(hidden_size=5120, intermediate_size=25600, num_hidden_layers=2,
                                       num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                                       vocab_size=vocab or 151936, tie_word_embeddings=False,
                                       max_position_embeddings=65536)
    elif name == "mixtral-8x7b":  # 8 experts, 2 per token, expert intermediate 3.5 x hidden, float32 routing weights
        cfg = transformers.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                         num_local_experts=8, num_experts_per_tok=2, vocab_size=vocab or 32000,
                                         tie_word_embeddings=False, max_position_embeddings=65536)
    else:  # "moe-30b-a3b": Qwen3-30B-A3B's widths, 128 experts, 8 per token
        cfg = transformers.Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, num_hidden_layers=2,
                                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                          norm_topk_prob=True, vocab_size=vocab or 151936,
                                          tie_word_embeddings=False, max_position_embeddings=65536)
    cfg._attn_implementation = _CAUSAL
    return cfg


def _fake_step_peak(cfg: "transformers.PretrainedConfig", seq: int, checkpointing: bool,
                    ran: Optional[dict[str, object]] = None) -> int:
    """Peak live bytes of the second of two training steps (forward, backward, AdamW step, zero_grad), bf16. `ran`,
    when given, receives the experts implementation the model ran and how many per-expert token lists the balanced
    router answered (the expert loop's)."""
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from support.balanced_routing import BalancedRouting

    experts = getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0)
    # transformers' expert loop asks the routing data-dependent questions: answered as a balanced router would
    eager = experts and getattr(cfg, "_experts_implementation", None) == "eager"
    balanced = BalancedRouting(experts) if eager else None
    routing = balanced if balanced is not None else contextlib.nullcontext()
    with FakeTensorMode():
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        finally:
            torch.set_default_dtype(default)
        model.train()
        if checkpointing:
            enable_checkpointing(model, {"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
        ids = torch.randint(0, cfg.vocab_size, (1, seq))
        # The measured step is a run's second: what the first leaves is the parameters and AdamW's moments (its
        # gradients set to None), made here by one optimizer step on zero gradients instead of a traced forward and
        # backward: half of each trace, the same peak (measured 2026-12-06 for dense and MoE cases: equal to the byte).
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with routing, tracker:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if ran is not None:
            ran["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
            ran["token_lists"] = balanced.token_lists if balanced is not None else 0
        return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch's MemTracker needs torch.distributed")
@pytest.mark.parametrize("name", ["llama-3-8b", "dense-32b"])
@pytest.mark.parametrize("vocab, seq", [(None, 4096), (None, 16384), (2048, 16384), (2048, 65536)])
@pytest.mark.parametrize("checkpointing", [True, False])
def test_real_width_peak_matches_fake_tensor_tracking(name: str, vocab: Optional[int], seq: int,
                                                      checkpointing: bool, tmp_path: Path) -> None:
    """Llama-3-8B and a 32B dense model at their real widths (2 layers, bf16, torch's AdamW: bf16 moments), 4K-64K
    tokens; with the real vocabulary the head's backward is the peak, with a 2048-token one a layer's backward is.
    The plan within 10 % of the tracked peak (measured 2026-12-04: -1.9 % .. +7.0 %, docs/benchmarks.md)."""
    cfg = _real_width_config(name, vocab)
    measured = _fake_step_peak(cfg, seq, checkpointing)
    cfg.save_pretrained(tmp_path)
    p = plan.plan(plan.PlanInput(config=str(tmp_path), seq_len=seq, attn="flash", optimizer="adamw_param_dtype",
                                 checkpointing=checkpointing, host_ram_bytes=1 << 40, device_bytes=1 << 40))
    predicted = p.device_peak_bytes_checkpointing if checkpointing else p.device_peak_bytes_no_checkpointing
    assert abs(predicted - measured) <= 0.10 * measured, (measured / GIB, predicted / GIB, p.peak_phase)


def test_balanced_routing_answers_only_the_routing() -> None:
    """A nonzero of a routing-shaped mask that does not come from a top-k's indices is not answered (FakeTensorMode
    refuses it as data-dependent); one that does is."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

    from support.balanced_routing import BalancedRouting

    with FakeTensorMode(), BalancedRouting(8) as routing:
        with pytest.raises(DynamicOutputShapeException):
            torch.nonzero(torch.rand(9) > 0.5)
        _, chosen = torch.topk(torch.rand(64, 8), 2)
        mask = torch.nn.functional.one_hot(chosen, num_classes=9).permute(2, 1, 0)
        assert tuple(torch.nonzero(mask.sum(dim=(-1, -2)) > 0).shape) == (8, 1)
        assert tuple(torch.nonzero(mask[3]).shape) == (64 * 2 // 8, 2) and routing.token_lists == 1


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch's MemTracker needs torch.distributed")
@pytest.mark.parametrize("name, experts, vocab, seq, checkpointing", [
    ("moe-30b-a3b", "grouped_mm", None, 4096, True), ("moe-30b-a3b", "grouped_mm", None, 4096, False),
    ("moe-30b-a3b", "grouped_mm", None, 16384, True), ("moe-30b-a3b", "grouped_mm", None, 16384, False),
    ("moe-30b-a3b", "grouped_mm", 2048, 16384, True), ("moe-30b-a3b", "grouped_mm", 2048, 16384, False),
    ("moe-30b-a3b", "grouped_mm", 2048, 65536, True), ("moe-30b-a3b", "grouped_mm", 2048, 65536, False),
    ("moe-30b-a3b", "eager", None, 4096, True), ("moe-30b-a3b", "eager", 2048, 16384, True),
    ("moe-30b-a3b", "eager", 2048, 16384, False),
    ("mixtral-8x7b", "grouped_mm", 2048, 16384, True), ("mixtral-8x7b", "grouped_mm", 2048, 65536, True),
    ("mixtral-8x7b", "grouped_mm", 2048, 65536, False), ("mixtral-8x7b", "grouped_mm", 2048, 262144, True),
    ("mixtral-8x7b", "grouped_mm", 2048, 262144, False), ("mixtral-8x7b", "eager", 2048, 65536, True),
])
def test_real_width_moe_peak_matches_fake_tensor_tracking(name: str, experts: str, vocab: Optional[int], seq: int,
                                                          checkpointing: bool, tmp_path: Path) -> None:
    """MoE at real widths (2 MoE layers, bf16): Qwen3-30B-A3B (128 experts, 8 per token, expert intermediate 0.375 x
    hidden, bf16 routing weights) and Mixtral-8x7B (8 experts, 2 per token, 3.5 x hidden, float32 routing weights),
    both ways transformers runs the experts: grouped_mm (5.x's default) and the expert loop, the loop's routing
    answered as a balanced router would (support/balanced_routing.py). The plan within 10 % above and 3 % below
    the tracked peak: planning low is what runs out of memory (measured 2026-12-05: -2.2 % .. +5.6 %,
    docs/benchmarks.md; before the gated-product stage and float32 routing weights were counted, Mixtral at 262,144
    tokens was -8.2 % and -4.7 %)."""
    cfg = _real_width_config(name, vocab)
    cfg._experts_implementation = experts
    ran: dict[str, object] = {}
    measured = _fake_step_peak(cfg, seq, checkpointing, ran)
    # what was asked is what ran: transformers kept the implementation, and only the loop asked for routing
    assert ran["experts_implementation"] == experts, ran
    assert (ran["token_lists"] > 0) == (experts == "eager"), ran  # type: ignore[operator]
    cfg.save_pretrained(tmp_path)
    p = plan.plan(plan.PlanInput(config=str(tmp_path), seq_len=seq, attn="flash", optimizer="adamw_param_dtype",
                                 checkpointing=checkpointing, experts_implementation=experts,
                                 host_ram_bytes=1 << 40, device_bytes=1 << 40))
    predicted = p.device_peak_bytes_checkpointing if checkpointing else p.device_peak_bytes_no_checkpointing
    assert -0.03 * measured <= predicted - measured <= 0.10 * measured, (measured / GIB, predicted / GIB,
                                                                        p.peak_phase)


def test_max_seq_host_column(capsys: pytest.CaptureFixture[str]) -> None:
    """With --host-ram-gib, --max-seq adds the host wall: the longest sequence whose offloaded hidden states fit
    hsoffload's budget without spilling, the pinned model states counted first; --seq-len at that length agrees."""
    r = _plan_json(capsys, LLAMA_8B, "--max-seq", "--device-gib", "80", "--host-ram-gib", "256")
    on_host = r["rows"][-1]
    states = LLAMA_8B_PARAMETERS * 18
    budget = int((256 * GIB - states) * 0.8)
    per_1024 = 32 * 1024 * 4096 * 2  # every layer's input, bf16, per 1,024 tokens
    assert on_host["hsoffload_host_limit"] == budget // per_1024 * 1024 == 397_312
    assert r["rows"][0]["hsoffload_host_limit"] == int(256 * GIB * 0.8) // per_1024 * 1024  # nothing pinned
    common = [LLAMA_8B, "--device-gib", "80", "--host-ram-gib", "256", "--cpu-offload", "params", "--chunked-loss",
              "--tiled-mlp", "400"]
    at = _plan_json(capsys, *common, "--seq-len", str(on_host["hsoffload_host_limit"]))
    assert at["verdict"] == "fits" and at["spill_bytes_per_node"] == 0
    past = _plan_json(capsys, *common, "--seq-len", str(on_host["hsoffload_host_limit"] + 1024))
    assert past["verdict"] == "fits with spill" and past["spill_bytes_per_node"] > 0
    assert main(["plan", LLAMA_8B, "--max-seq", "--device-gib", "80", "--host-ram-gib", "256"]) == 0
    assert "host RAM, no spill (256 GiB per node)" in capsys.readouterr().out
    assert _plan_json(capsys, LLAMA_8B, "--max-seq", "--device-gib", "80")["rows"][0]["hsoffload_host_limit"] is None


def test_one_plan_shape_from_flags_a_call_and_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same PlanInput from CLI flags, a Python call and a JSON or YAML file gives the same PlanResult; --json is
    the dataclass's own fields with the format version; flags beside --input override the file."""
    flags = _plan_json(capsys, LLAMA_8B, "--seq-len", "65536", "--world-size", "8", "--device-gib", "80",
                       "--host-ram-gib", "512", "--policy", "sac", "--no-fsdp")
    inp = plan.PlanInput(config=LLAMA_8B, seq_len=65536, world_size=8, device_bytes=80 * GIB,
                         host_ram_bytes=512 * GIB, policy="sac", fsdp=False)
    called = plan.plan(inp)
    assert isinstance(called, plan.PlanResult)
    assert flags == json.loads(json.dumps(called.to_json()))
    assert flags["format_version"] == plan.PLAN_FORMAT_VERSION
    assert set(flags) == {"format_version"} | {f for f in plan.PlanResult.__dataclass_fields__}
    (tmp_path / "config.json").write_text(Path(LLAMA_8B).read_text())
    fields = {**inp.__dict__, "config": "config.json"}
    (tmp_path / "run.json").write_text(json.dumps(fields))
    assert _same_plan(_plan_json(capsys, "--input", str(tmp_path / "run.json")), flags)
    yaml = pytest.importorskip("yaml")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(fields))
    assert _same_plan(_plan_json(capsys, "--input", str(tmp_path / "run.yaml")), flags)
    longer = _plan_json(capsys, "--input", str(tmp_path / "run.json"), "--seq-len", "131072")
    assert longer["input"]["seq_len"] == 131072 and longer["input"]["policy"] == "sac" and not longer["input"]["fsdp"]
    # A flag written beside --input overrides the file even when it repeats the flag's default.
    (tmp_path / "deep.json").write_text(json.dumps({**fields, "prefetch_depth": 2}))
    assert _plan_json(capsys, "--input", str(tmp_path / "deep.json"), "--prefetch-depth", "1",
                      "--policy", "hidden_states")["input"]["policy"] == "hidden_states"
    assert plan.plan(plan.PlanInput.from_file(str(tmp_path / "deep.json"))).input.policy == "sac"
    # to_json's output is an input again; --max-seq needs no seq_len in the file.
    (tmp_path / "again.json").write_text(json.dumps({**inp.to_json(), "config": LLAMA_8B}))
    assert plan.PlanInput.from_file(str(tmp_path / "again.json")) == inp
    (tmp_path / "no_len.json").write_text(json.dumps({"config": "config.json", "world_size": 8,
                                                      "device_bytes": 80 * GIB}))
    assert _plan_json(capsys, "--input", str(tmp_path / "no_len.json"), "--max-seq")["rows"]
    (tmp_path / "bad.json").write_text(json.dumps({**fields, "seq_lenght": 8}))
    assert main(["plan", "--input", str(tmp_path / "bad.json")]) == 2
    assert "unknown key 'seq_lenght'; did you mean seq_len?" in capsys.readouterr().err


def test_max_seq_result_is_typed() -> None:
    r = plan.max_seq(plan.PlanInput(config=LLAMA_8B, seq_len=1, world_size=8, device_bytes=80 * GIB))
    assert isinstance(r, plan.MaxSeqResult) and all(isinstance(row, plan.MaxSeqRow) for row in r.rows)
    first = r.rows[0]
    assert first.hsoffload.seq_len >= first.checkpointing.seq_len > 0 and first.hsoffload.peak_bytes <= 80 * GIB
    assert r.to_json()["format_version"] == plan.PLAN_FORMAT_VERSION
