"""The planner's table (hsoffload.planning.settings): a setting added to it reaches its flag, PlanInput, its checks and
the JSON with no other edit; the runs users make beside a full fine-tune (LoRA, QLoRA, 8-bit and paged optimizers,
sample packing) against counts made here by hand from the model's config.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from hsoffload import plan
from hsoffload.planning import settings, shapes
from hsoffload.planning.settings import PlanError
from hsoffload.tools.cli import main

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B = str(REPO / "configs" / "llama-8b-shape.json")
GIB = 1 << 30
ROOMY = ["--device-gib", "80", "--host-ram-gib", "1024", "--torch", "2.11.0"]


def _plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_a_setting_added_to_the_table_reaches_its_flag_input_checks_and_json(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """One row more in the table, nothing else: `hsoffload plan --warmup-steps 5` parses, PlanInput has the field and
    its default, a bad value is refused naming the flag, and the JSON's input carries it."""
    extra = settings.Setting("warmup_steps", settings.INT, 3, "a setting only this test has", minimum=1,
                             step=False, axolotl="warmup_steps", trainer_args="warmup_steps")
    table = settings.SETTINGS + (extra,)
    monkeypatch.setattr(settings, "SETTINGS", table)
    monkeypatch.setattr(shapes, "PlanInput", shapes.input_class(table))
    p = _plan_json(capsys, LLAMA_8B, "--seq-len", "4096", "--warmup-steps", "5", *ROOMY)
    assert p["input"]["warmup_steps"] == 5  # the flag, PlanInput's field, the JSON
    assert shapes.PlanInput(config=LLAMA_8B, seq_len=1).warmup_steps == 3  # its default
    with pytest.raises(PlanError, match="--warmup-steps must be >= 1, got 0"):
        shapes.PlanInput(config=LLAMA_8B, seq_len=1, warmup_steps=0)  # its check, when a PlanInput is made
    assert main(["plan", LLAMA_8B, "--seq-len", "4096", "--warmup-steps", "0"]) == 2
    assert "--warmup-steps must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "--warmup-steps" in capsys.readouterr().out and "`--warmup-steps`" in settings.markdown_table(table)
    again = shapes.PlanInput.from_mapping(p["input"])  # the JSON's input is an input again
    assert again.warmup_steps == 5


def test_every_value_is_checked_once_naming_its_flag() -> None:
    """Each kind's check: a choice, a bound, a GiB size (shown in GiB), a list of names."""
    cases = [({"optimizer": "lion"}, "--optimizer must be one of adamw,"),
             ({"fragmentation": 1.0}, "--fragmentation must be in [0, 1), got 1.0"),
             ({"device_bytes": 0}, "--device-gib must be > 0, got 0"),
             ({"lora_target_modules": ("q_proj", "lm_head")}, "--lora-target-modules: 'lm_head' not one of"),
             ({"policy": "most"}, "--policy must be one of hidden_states, sac, all, auto, got 'most'"),
             ({"checkpointing": "yes"}, "--checkpointing must be true or false")]
    for change, message in cases:
        with pytest.raises(PlanError) as caught:
            plan.PlanInput(config=LLAMA_8B, seq_len=1024, **change)
        assert message in str(caught.value), (change, str(caught.value))


def _llama_counts() -> dict[str, int]:
    """Parameters of configs/llama-8b-shape.json counted here: all of them, the decoder linears', the adapters' at
    rank 16 on every linear, the rest (embedding, head, norms)."""
    cfg = json.loads(Path(LLAMA_8B).read_text())
    h, inter, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    linears = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    per_layer_linear = sum(i * o for i, o in linears)
    root = vocab * h * 2 + h  # untied embedding and head, final norm
    return {"all": root + layers * (per_layer_linear + 2 * h), "layers": layers, "root": root,
            "norms": layers * 2 * h, "adapters": layers * sum(16 * (i + o) for i, o in linears),
            "linears": per_layer_linear, "linear_shapes": linears}  # type: ignore[dict-item]


def _nf4(n: int) -> int:
    """One bitsandbytes nf4 weight of n elements with double quantisation: packed 4-bit data, a uint8 absmax per 64,
    a float32 absmax per 256 of those and a float32 offset, the 16-entry float32 code."""
    blocks = math.ceil(n / 64)
    return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / 256) + 4 + 16 * 4


def test_lora_and_qlora_plan_below_the_full_fine_tune_by_the_frozen_weights_states(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Byte for byte: an adapter run's gradients and optimizer states are the full fine-tune's less every base
    weight's (bf16 gradient, two float32 moments) plus the float32 adapters' own; its weights are the base's (QLoRA:
    the decoder linears in nf4) plus the adapters'. And the 8B model that does not fit one 80 GiB device fully
    fine-tuned fits it with LoRA."""
    c = _llama_counts()
    common = [LLAMA_8B, "--seq-len", "8192", *ROOMY]
    full = _plan_json(capsys, *common)
    lora = _plan_json(capsys, *common, "--adapter", "lora", "--lora-r", "16")
    qlora = _plan_json(capsys, *common, "--adapter", "qlora", "--lora-r", "16")
    p, a = c["all"], c["adapters"]
    assert full["parameters"] == p and lora["trainable_parameters"] == a == qlora["trainable_parameters"]
    frozen_states = p * 2 + p * 8  # bf16 gradients, AdamW's two float32 moments
    adapter_states = a * 4 + a * 8  # float32 gradients, two float32 moments
    for run in (lora, qlora):
        states = run["terms"]["gradients"] + run["terms"]["optimizer_states"]
        assert full["terms"]["gradients"] + full["terms"]["optimizer_states"] - states == frozen_states - adapter_states
    assert lora["terms"]["weights"] == p * 2 + a * 4
    nf4_layers = c["layers"] * sum(_nf4(i * o) for i, o in c["linear_shapes"])  # type: ignore[union-attr]
    assert qlora["terms"]["weights"] == c["root"] * 2 + c["norms"] * 2 + nf4_layers + a * 4
    assert full["model_states_device_bytes"] - lora["model_states_device_bytes"] == frozen_states - adapter_states - a * 4
    assert full["verdict"] == "does not fit" and lora["verdict"] == "fits" and qlora["verdict"] == "fits"
    assert qlora["device_peak_bytes"] < lora["device_peak_bytes"] < full["device_peak_bytes"]
    single = _plan_json(capsys, *common, "--adapter", "qlora", "--lora-r", "16", "--no-double-quant")
    blocks = sum(math.ceil(i * o / 64) for i, o in c["linear_shapes"])  # type: ignore[union-attr]
    double = sum(math.ceil(i * o / 64) + 4 * math.ceil(math.ceil(i * o / 64) / 256) + 4
                 for i, o in c["linear_shapes"])  # type: ignore[union-attr]
    assert single["terms"]["weights"] - qlora["terms"]["weights"] == c["layers"] * (4 * blocks - double)


def test_adapters_on_chosen_modules_only(capsys: pytest.CaptureFixture[str]) -> None:
    c = _llama_counts()
    attn = _plan_json(capsys, LLAMA_8B, "--seq-len", "8192", *ROOMY, "--adapter", "lora", "--lora-r", "8",
                      "--lora-target-modules", "q_proj,v_proj")
    h, q, kv = 4096, 32 * 128, 8 * 128
    assert attn["trainable_parameters"] == c["layers"] * 8 * ((h + q) + (h + kv))
    assert attn["input"]["lora_target_modules"] == ["q_proj", "v_proj"]


def test_8bit_and_paged_optimizers(capsys: pytest.CaptureFixture[str]) -> None:
    """bitsandbytes' adamw_8bit: two uint8 moments and a float32 absmax per moment and 256 parameters, no update
    temporaries; paged: the states out of the device's allocator, in the node's host memory, and at the step the
    largest tensor's (the untied head or embedding: vocab x hidden) paged in."""
    p = _llama_counts()["all"]
    common = [LLAMA_8B, "--seq-len", "8192", *ROOMY]
    eight = _plan_json(capsys, *common, "--optimizer", "adamw_8bit")
    assert eight["terms"]["optimizer_states"] == p * 2 + math.ceil(p / 256) * 2 * 4
    assert eight["terms"]["optimizer_update"] == 0
    paged = _plan_json(capsys, *common, "--optimizer", "paged_adamw_8bit")
    assert paged["terms"]["optimizer_states"] == 0
    assert paged["model_states_host_bytes_per_node"] == eight["terms"]["optimizer_states"]
    largest = 128256 * 4096
    assert paged["terms"]["optimizer_update"] == largest * 2 + math.ceil(largest / 256) * 2 * 4


def test_what_the_planner_cannot_model_makes_the_verdict_cannot_judge(capsys: pytest.CaptureFixture[str]) -> None:
    """Never a refusal: sample packing without flash-attention's varlen kernel (each packed row's block-diagonal
    mask), or a key of the user's run named as unmodelled; the figures are still there. Packing with flash: the
    memory of full rows (no padding assumed either way), attention per packed sequence in the step time."""
    common = [LLAMA_8B, "--seq-len", "16384", "--adapter", "lora", *ROOMY]
    plain = _plan_json(capsys, *common, "--attn", "flash")
    sdpa = _plan_json(capsys, *common, "--sample-packing")
    assert sdpa["verdict"] == "cannot judge" and sdpa["unmodelled"][0].startswith("sample_packing")
    assert "sample_packing" in sdpa["advice"] and sdpa["device_peak_bytes"] > 0
    named = _plan_json(capsys, *common, "--unmodelled", "lora_dropout_fused,rope_scaling")
    assert named["verdict"] == "cannot judge" and named["unmodelled"] == ["lora_dropout_fused", "rope_scaling"]
    packed = _plan_json(capsys, *common, "--attn", "flash", "--sample-packing", "--packed-sequence-len", "2048")
    assert packed["verdict"] == plain["verdict"] == "fits" and packed["unmodelled"] == []
    assert packed["device_peak_bytes"] == plain["device_peak_bytes"]
    assert packed["step_time_s"] < plain["step_time_s"]
    assert main(["plan", *common, "--sample-packing"]) == 0
    assert "verdict: cannot judge; the planner cannot model sample_packing" in capsys.readouterr().out


def test_one_model_shape_type_writes_the_config_it_reads() -> None:
    """ModelShape is the one model-shape type (the planner's, the demo's and the benchmarks'): its config.json fields
    read back give it again, for a dense and an MoE model, and the tools' Llama builds from it."""
    from hsoffload.planning.memory import shape_from_config
    from hsoffload.tools import workloads

    for path in (LLAMA_8B, str(REPO / "configs" / "qwen3-30b-a3b-shape.json")):
        shape = shape_from_config(json.loads(Path(path).read_text()))
        assert shape_from_config(shape.to_config()) == shape, path
    tiny = workloads.tiny_llama(layers=2, max_positions=8192)
    assert shape_from_config(tiny.to_config()) == tiny and tiny.to_config()["max_position_embeddings"] == 8192


def test_the_banded_verdict_follows_the_measured_error() -> None:
    """Issue 55's rules, against what the process reserves R and the device C: fits when R x (1 + under) <= C, does
    not fit when R / (1 + over) > C, may not fit in between; the band is the device class's."""
    inp = plan.PlanInput(config=LLAMA_8B, seq_len=8192, adapter="lora", device_bytes=80 * GIB,
                         host_ram_bytes=1024 * GIB, torch_version="2.11.0")
    reserved = plan.plan(inp).device_reserved_bytes
    gpu = plan.plan(inp).error_band
    assert (gpu.device_class, gpu.over, gpu.under) == ("gpu", 0.20, 0.06)
    cases = [(math.ceil(reserved * 1.06), "fits", "fits"), (math.ceil(reserved * 1.06) - 1, "fits", "may not fit"),
             (reserved, "fits", "may not fit"), (math.floor(reserved / 1.2), "does not fit", "may not fit"),
             (math.floor(reserved / 1.2) - 1, "does not fit", "does not fit")]
    for capacity, verdict, banded in cases:
        p = plan.plan(plan.PlanInput(**{**inp.__dict__, "device_bytes": capacity}))
        assert (p.verdict, p.banded_verdict) == (verdict, banded), capacity
    emulated = plan.plan(plan.PlanInput(**{**inp.__dict__, "device_bytes": reserved, "device_class": "emulated"}))
    assert emulated.error_band.under == 0.055 and emulated.banded_verdict == "may not fit"
    walled = plan.plan(plan.PlanInput(**{**inp.__dict__, "unmodelled": ("rope_scaling",)}))
    assert walled.verdict == "cannot judge" and walled.banded_verdict is None
