"""`hsoffload plan` from the user's own files (hsoffload.planning.user_files, hsoffload.planning.emit): a published
Axolotl config, `TrainingArguments` as JSON and a DeepSpeed config each give the plan of the equivalent flags; the keys
not read are named; a model that is not local gives an error naming the file and what to pass; `--emit axolotl`
writes the fastest combination as keys that read back to the same plan. Shapes from configs/llama-8b-shape.json (no
download)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsoffload.planning import emit, plan, settings
from hsoffload.tools.cli import main

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B = str(REPO / "configs" / "llama-8b-shape.json")
DATA = Path(__file__).resolve().parent / "data" / "axolotl"
ALST_DEEPSPEED = str(DATA / "llama3-8b-deepspeed-alst.yaml")  # vendored: URL and commit in its header
ALST_FSDP2 = str(DATA / "llama3-8b-fsdp2-alst.yaml")
ZERO3_OFFLOAD_ALL = str(DATA / "deepspeed_configs" / "zero3_bf16_cpuoffload_all.json")
ROOMY = ["--device-gib", "80", "--host-ram-gib", "1024", "--torch", "2.11.0"]
# What both ALST examples set, as flags (Axolotl's sequence parallelism is ring attention over the degree's ranks;
# tiled_mlp: true is ALST's ceil(62,500 tokens per rank / 4,096) = 16 shards; cut cross-entropy's plugin: the
# chunked loss; torchao's adamw_torch_8bit: 8-bit moments; activation_offloading: legacy is Axolotl's own offload)
ALST_FLAGS = ["--seq-len", "500000", "--sample-packing", "--tiled-mlp", "16", "--sequence-parallel", "8",
              "--sequence-parallel-kind", "ring", "--world-size", "8", "--chunked-loss", "--grad-accum", "1",
              "--micro-batch", "1", "--optimizer", "adamw_8bit", "--dtype", "bfloat16", "--checkpointing",
              "--attn", "flash", "--fsdp", "--unmodelled",
              "activation_offloading=legacy (Axolotl's own offloader; hidden_states runs hsoffload)"]


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, *ROOMY, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _same_plan(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["input"] == b["input"]
    for key in ("verdict", "unmodelled", "device_peak_bytes", "device_reserved_bytes", "step_time_s"):
        assert a[key] == b[key], key


@pytest.mark.parametrize("yml,extra", [(ALST_DEEPSPEED, ["--deepspeed-config", ZERO3_OFFLOAD_ALL,
                                                          "--cpu-offload", "params"]),
                                       (ALST_FSDP2, ["--cpu-offload", "none"])], ids=["deepspeed", "fsdp2"])
def test_a_published_axolotl_config_plans_as_its_flags(yml: str, extra: list[str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Axolotl's ALST examples (vendored) through --axolotl: the plan of the same settings given as flags; the
    keys the planner does not read are named in the JSON."""
    read = _run(capsys, LLAMA_8B, "--axolotl", yml)
    flags = _run(capsys, LLAMA_8B, *ALST_FLAGS, *extra)
    _same_plan(read, flags)
    assert read["verdict"] == "cannot judge"  # Axolotl's own offload (activation_offloading: legacy) is named
    assert {"datasets", "learning_rate", "special_tokens"} <= set(read["not_read"][yml])
    assert "sequence_len" not in read["not_read"][yml]


def test_a_deepspeed_config_gives_its_stage_and_offload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--deepspeed-config: ZeRO-3 shards, offload_optimizer cpu is --cpu-offload optimizer, the buckets counted;
    ZeRO-2 cannot be judged (the planner shards all or nothing), naming the key."""
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 1e6},
          "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    common = [LLAMA_8B, "--seq-len", "16384", "--world-size", "8"]
    read = _run(capsys, *common, "--deepspeed-config", str(path))
    flags = _run(capsys, *common, "--deepspeed-config", str(path), "--cpu-offload", "optimizer", "--fsdp",
                 "--micro-batch", "2")
    _same_plan(read, flags)
    assert read["input"]["cpu_offload"] == "optimizer" and read["overhead"]["zero3_buckets"] > 0
    assert read["not_read"][str(path)] == ["steps_per_print"]
    published = ["--deepspeed-config", ZERO3_OFFLOAD_ALL]  # Axolotl's, vendored: ZeRO-3, all offloaded to the CPU
    _same_plan(_run(capsys, *common, *published),
               _run(capsys, *common, *published, "--fsdp", "--cpu-offload", "params", "--dtype", "bfloat16"))
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    zero2 = _run(capsys, *common, "--deepspeed-config", str(path))
    assert zero2["unmodelled"] == [
        "zero_optimization.stage=2 (optimizer states and gradients sharded with the weights replicated)"]
    assert zero2["input"]["fsdp"] is False and zero2["verdict"] == "cannot judge"


def test_trainer_arguments_plan_as_their_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`TrainingArguments(...).to_json_string()` of a real transformers through --trainer-args: the plan of the
    equivalent flags (its other fields named as not read)."""
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=4,
        gradient_checkpointing=True, optim="paged_adamw_8bit", use_liger_kernel=True, report_to=[])
    path = tmp_path / "training_args.json"
    path.write_text(args.to_json_string())
    read = _run(capsys, LLAMA_8B, "--seq-len", "32768", "--trainer-args", str(path))
    flags = _run(capsys, LLAMA_8B, "--seq-len", "32768", "--micro-batch", "2", "--grad-accum", "4",
                 "--checkpointing", "--optimizer", "paged_adamw_8bit", "--fused-kernels", "liger", "--no-fsdp",
                 "--dtype", "bfloat16" if args.bf16 else "float32")
    _same_plan(read, flags)
    assert "learning_rate" in read["not_read"][str(path)]


def _axolotl(tmp_path: Path, **keys: Any) -> Path:
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(keys))
    return path


def test_an_unknown_key_is_named_and_what_changes_memory_cannot_be_judged(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A key the planner does not read is listed in the text output ("not read: ..."); one it reads but cannot
    count (an int8 base) makes the verdict "cannot judge", naming it."""
    path = _axolotl(tmp_path, base_model=LLAMA_8B, sequence_len=8192, adapter="lora", load_in_8bit=True,
                    lora_target_linear=True, bf16=True, gradient_checkpointing=True, flex_attention=True,
                    my_unknown_key=3)
    assert main(["plan", "--axolotl", str(path), *ROOMY]) == 0
    out = capsys.readouterr().out
    assert f"{path}: not read: my_unknown_key" in out.splitlines()[0]
    assert "verdict: cannot judge" in out and "load_in_8bit (an int8 base)" in out and "flex_attention" in out


def test_a_model_that_is_not_local_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """base_model a hub id and no config.json given: exit 2, one line naming the file, the model and what to pass
    (no network); a local model folder as base_model plans."""
    path = _axolotl(tmp_path, base_model="meta-llama/Llama-3.1-8B", sequence_len=8192)
    assert main(["plan", "--axolotl", str(path), *ROOMY]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(path) in err and "'meta-llama/Llama-3.1-8B' is not a local config.json" in err
    assert "hsoffload plan CONFIG --axolotl" in err
    (tmp_path / "model").mkdir()
    shutil.copy(LLAMA_8B, tmp_path / "model" / "config.json")
    path = _axolotl(tmp_path, base_model="model", sequence_len=8192)  # relative to the YAML
    assert _run(capsys, "--axolotl", str(path))["input"]["config"] == str(tmp_path / "model")


def test_emitted_axolotl_keys_read_back_to_the_same_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--emit axolotl at a length only the later rows fit: YAML that, merged into the config and read back through
    --axolotl, plans as the pick (the table's fastest, planned from its input)."""
    original = {"base_model": LLAMA_8B, "sequence_len": 131072, "bf16": "auto", "gradient_checkpointing": True,
                "flash_attention": True, "micro_batch_size": 1, "learning_rate": 2e-5}
    path = _axolotl(tmp_path, **original)
    device = ["--device-gib", "40", "--host-ram-gib", "1024", "--torch", "2.11.0"]
    assert main(["plan", "--axolotl", str(path), *device, "--emit", "axolotl"]) == 0
    emitted = yaml.safe_load(capsys.readouterr().out)
    assert emitted["sequence_len"] == 131072 and emitted["chunked_cross_entropy"] is True
    merged = _axolotl(tmp_path, **{**original, **emitted})
    assert main(["plan", "--axolotl", str(merged), *device, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    inp = plan.PlanInput(config=LLAMA_8B, seq_len=131072, attn="flash", fsdp=False, device_bytes=40 << 30,
                         host_ram_bytes=1024 << 30, torch_version="2.11.0")
    chosen = emit.fastest_input(plan.max_seq(inp, target=131072))
    _same_plan(again, json.loads(json.dumps(plan.plan(chosen).to_json())))
    assert again["verdict"] == "fits" and emitted["tiled_mlp_num_shards"] == chosen.tiled_mlp
    from hsoffload.integrations import axolotl_plugin  # imports without Axolotl (a stand-in base class)

    assert emitted["activation_offloading"] == axolotl_plugin.HIDDEN_STATES_MODE  # the hsoffload column's pick
    assert main(["plan", "--axolotl", str(path), *device, "--emit", "axolotl", "--policy", "auto"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["hsoffload_policy"] == "auto"


def test_the_reference_table_is_the_planners(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/usage.md holds the table of settings as generated (flag, default, Axolotl key, TrainingArguments name):
    a row or column changed in hsoffload.planning.settings and not in the docs fails here."""
    for name in [n for n in os.environ if n.startswith("HSOFFLOAD_")]:
        monkeypatch.delenv(name)  # the shared knobs' defaults, not this environment's
    assert settings.markdown_table() in (REPO / "docs" / "usage.md").read_text()
