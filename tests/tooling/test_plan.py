"""`hsoffload plan`: its byte figures against the counters of a small real run, its device-peak terms and knobs,
verdicts, --max-seq, and its refusals. The device peak against a real allocator:
tests/device/emu/test_device_peak.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support import hf_tiny as H
import hsoffload
from hsoffload import plan
from hsoffload.cli import main

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


def _plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_one_million_tokens_does_not_fit_without_sequence_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    args = [LLAMA_8B, "--seq-len", "1048576", "--world-size", "8", "--device-gib", "80", "--host-ram-gib", "4096"]
    p = _plan_json(capsys, *args)
    assert p["offloaded_bytes_per_rank"] == 32 * 1048576 * 4096 * 2  # 256 GiB per rank of hidden states
    assert p["verdict"] == "does not fit" and p["dominant_term"] == "logits"
    # The logits alone, in bf16, are 1M x 128256 x 2 B; the loss adds float32 log-probabilities and gradients.
    assert p["term_logits_bytes"] == 1048576 * 128256 * 2
    assert p["dominant_term_bytes"] > 5 * p["term_logits_bytes"]
    assert p["device_peak_bytes"] > 15 * 80 * GIB
    assert p["device_peak_bytes_checkpointing"] > p["device_peak_bytes"]
    assert p["device_peak_bytes_no_checkpointing"] > p["device_peak_bytes_checkpointing"]
    # One layer's recompute materialises the MLP's gate, up, act and product: 4 x 1M x 14336 x 2 B = 112 GiB.
    assert p["term_mlp_saved_bytes"] == 4 * 1048576 * 14336 * 2
    assert "logits" in p["advice"] and "--sequence-parallel 8" in p["advice"] and p["fixes"]
    assert main(["plan", *args]) == 0
    text = capsys.readouterr().out
    assert "verdict: does not fit; the logits and their float32 loss need" in text
    assert "peak, checkpointing only" in text


def test_one_million_tokens_with_ulysses_tiling_and_a_chunked_loss(capsys: pytest.CaptureFixture[str]) -> None:
    args = [LLAMA_8B, "--seq-len", "1048576", "--world-size", "8", "--device-gib", "80", "--sequence-parallel", "8",
            "--chunked-loss", "--tiled-mlp", "16"]
    roomy = _plan_json(capsys, *args, "--host-ram-gib", "4096")
    assert roomy["tokens_per_rank"] == 131072 and roomy["term_logits_bytes"] == 0
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
    assert p["fsdp"] and p["term_weights_bytes"] == p["parameters"] * 2 // 8
    unsharded = _plan_json(capsys, *base, "--no-fsdp")
    assert unsharded["term_weights_bytes"] == p["parameters"] * 2 and unsharded["term_fsdp_gathered_layers_bytes"] == 0
    single = _plan_json(capsys, LLAMA_8B, "--seq-len", "65536", "--host-ram-gib", "4096")
    assert single["term_optimizer_states_bytes"] == single["parameters"] * 8 and not single["fsdp"]
    assert _plan_json(capsys, *base, "--optimizer", "sgd")["term_optimizer_states_bytes"] == 0
    chunked = _plan_json(capsys, *base, "--chunked-loss")
    assert chunked["term_logits_bytes"] == 0 and chunked["device_peak_bytes"] < p["device_peak_bytes"]
    tiled = _plan_json(capsys, *base, "--tiled-mlp", "16")
    assert tiled["term_mlp_saved_bytes"] == 65536 * 4096 * 2  # only the MLP's input
    sp = _plan_json(capsys, *base, "--sequence-parallel", "4")
    assert sp["tokens_per_rank"] == 16384 and sp["device_peak_bytes"] < p["device_peak_bytes"] / 3
    eager = _plan_json(capsys, *base, "--attn", "eager")
    # transformers' eager attention: float32 probabilities per head, S x S
    assert eager["term_attention_saved_bytes"] > 32 * 65536 * 65536 * 4
    assert eager["verdict"] == "does not fit"
    flash = _plan_json(capsys, *base, "--attn", "flash")
    assert flash["term_attention_saved_bytes"] < 65536 * 4096 * 2 * 4
    none = _plan_json(capsys, *base, "--no-checkpointing")
    assert none["policy"] == "all" and not none["checkpointing"]
    assert none["device_peak_bytes"] < none["device_peak_bytes_no_checkpointing"]
    sac = _plan_json(capsys, *base, "--policy", "sac")
    assert sac["device_bytes_checkpointing"] > p["device_bytes_checkpointing"]
    micro = _plan_json(capsys, *base, "--micro-batch", "2")
    assert micro["tokens_per_rank"] == 2 * 65536 and micro["device_peak_bytes"] > p["device_peak_bytes"]


def test_max_seq_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", LLAMA_8B, "--max-seq", "--world-size", "8", "--device-gib", "80", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    rows = {row["knobs"]: row for row in r["rows"]}
    assert list(rows)[0] == "as given" and len(rows) == 4
    for row in r["rows"]:
        assert row["hsoffload"] >= row["checkpointing"] > 0
        assert row["hsoffload_peak_bytes"] <= 80 * GIB
    lengths = [row["hsoffload"] for row in r["rows"]]
    assert lengths == sorted(lengths) and lengths[-1] > 1_000_000
    # The longest length that fits does fit, and 1024 tokens more does not.
    best = rows["+ chunked loss"]["hsoffload"]
    common = [LLAMA_8B, "--world-size", "8", "--device-gib", "80", "--chunked-loss", "--host-ram-gib", "4096"]
    assert _plan_json(capsys, *common, "--seq-len", str(best))["verdict"] == "fits"
    assert _plan_json(capsys, *common, "--seq-len", str(best + 1024))["verdict"] == "does not fit"
    assert main(["plan", LLAMA_8B, "--max-seq", "--world-size", "8", "--device-gib", "141"]) == 0
    text = capsys.readouterr().out
    assert "checkpointing only" in text and "+ chunked loss + tiled MLP + sequence parallel 8" in text
    sp = _plan_json(capsys, LLAMA_8B, "--max-seq", "--world-size", "8", "--sequence-parallel", "8",
                    "--device-gib", "80")
    assert all(row["hsoffload"] % 8 == 0 for row in sp["rows"]) and sp["rows"][-1]["hsoffload"] > 1_000_000
    assert sp["rows"][0]["hsoffload"] > 4 * rows["as given"]["hsoffload"]
    assert main(["plan", LLAMA_8B, "--max-seq", "--device-gib", "80"]) == 0  # one rank: AdamW's states alone
    assert "none fits" in (text := capsys.readouterr().out) and "leave no room" in text


def test_multimodal_and_moe_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import transformers

    from hsoffload import plan_memory as pm

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
    (["--seq-len", "1024", "--world-size", "64", "--sequence-parallel", "64"], "does not divide them"),
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
    assert main(["plan", str(tmp_path), "--seq-len", "8", "--policy", "everything"]) == 2
    assert "--policy must be one of hidden_states, sac, all" in capsys.readouterr().err
