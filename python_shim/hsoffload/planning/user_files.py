"""The plan from a user's own files: an Axolotl config (YAML), `TrainingArguments` as JSON (its `to_json_string()`),
a DeepSpeed config. Each is read into PlanInput's fields through the planner's table (its `axolotl` and
`trainer_args` columns, hsoffload.planning.settings); every key of a file the planner does not read is listed
(`Reading.not_read`), and a key it reads but cannot count that changes memory goes to `unmodelled` (the verdict is
then "cannot judge", naming it). No network: the model's shapes come from a local config.json or model folder.

Stdlib only (YAML needs PyYAML, imported when an Axolotl config is read).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Optional

from . import settings
from .settings import PlanError

# Optimizer names of Axolotl's `optimizer` and TrainingArguments' `optim` the planner counts, as its own.
OPTIMIZER_NAMES = {
    "adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw_apex_fused": "adamw",
    "adamw_torch_xla": "adamw", "adamw": "adamw", "adam": "adam",
    "adamw_bnb_8bit": "adamw_8bit", "adamw_8bit": "adamw_8bit", "adamw_torch_8bit": "adamw_8bit",
    "paged_adamw_8bit": "paged_adamw_8bit", "paged_adamw_32bit": "paged_adamw_32bit", "sgd": "sgd",
}
ATTENTION_KEYS = {"flash_attention": "flash", "sdp_attention": "sdpa", "eager_attention": "eager"}
UNMODELLED_ATTENTION = ("flex_attention", "xformers_attention", "s2_attention", "sage_attention")
ATTN_IMPLEMENTATIONS = {"flash_attention_2": "flash", "flash_attention_3": "flash", "sdpa": "sdpa", "eager": "eager"}
# The `activation_offloading` value the Axolotl plugin runs on hsoffload (axolotl_plugin.HIDDEN_STATES_MODE; that
# module imports torch, this one may not).
HIDDEN_STATES_MODE = "hidden_states"
LIGER_KEYS = ("liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy")
# Keys read that change nothing the planner counts (their values are checked where they matter).
NEUTRAL_AXOLOTL = ("gradient_checkpointing_kwargs", "fsdp_version", "lora_alpha", "lora_dropout", "tf32",
                   "liger_layer_norm", "liger_rope", "liger_cross_entropy", "hsoffload_min_offload_size",
                   "hsoffload_use_streams", "hsoffload_pin_memory", "hsoffload_max_host_bytes",
                   "hsoffload_max_pool_bytes", "hsoffload_reserve_host_bytes", "hsoffload_spill_dir",
                   "hsoffload_spill_prefetch_depth", "hsoffload_spill_wait_ms", "hsoffload_offload_cpu_tensors",
                   "hsoffload_auto_calibration_steps", "hsoffload_auto_report_only", "hsoffload_auto_state_path",
                   "hsoffload_device_budget", "hsoffload_zero3_loading", "hsoffload_zero3_loading_verify")


@dataclasses.dataclass
class Reading:
    """What one or more files give a PlanInput: its fields, the keys not read (by file) and what cannot be counted."""

    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    not_read: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    unmodelled: list[str] = dataclasses.field(default_factory=list)

    def merge(self, other: "Reading") -> None:
        """`other` over this one (its values win)."""
        self.values.update(other.values)
        for where, keys in other.not_read.items():
            self.not_read.setdefault(where, []).extend(keys)
        self.unmodelled.extend(u for u in other.unmodelled if u not in self.unmodelled)

    def input_values(self) -> dict[str, Any]:
        """PlanInput's fields: the values, `unmodelled` included where something was."""
        return {**self.values, **({"unmodelled": tuple(self.unmodelled)} if self.unmodelled else {})}


class _Keys:
    """A file's mapping with the keys read marked; what is left is `not_read`."""

    def __init__(self, data: dict[str, Any], prefix: str = "") -> None:
        self.data, self.prefix, self.read = data, prefix, set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.data.get(key)
        return default if value is None else value

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def not_read(self) -> list[str]:
        return [self.prefix + str(k) for k in self.data if k not in self.read]


def _load(path: str, what: str) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise PlanError(f"hsoffload plan: {what} {path}: cannot read it ({exc.strerror})") from None
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise PlanError(f"hsoffload plan: {what} {path}: reading YAML needs PyYAML (pip install pyyaml)") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PlanError(f"hsoffload plan: {what} {path}: not YAML ({str(exc).splitlines()[0]})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"hsoffload plan: {what} {path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PlanError(f"hsoffload plan: {what} {path}: expected one mapping of keys, got {type(data).__name__}")
    return data


def _optimizer(name: str, key: str, r: Reading) -> None:
    if name in OPTIMIZER_NAMES:
        r.values["optimizer"] = OPTIMIZER_NAMES[name]
    else:
        r.unmodelled.append(f"{key}={name} (its states are not counted; the planner knows "
                            f"{' '.join(sorted(OPTIMIZER_NAMES))})")


def _local_file(value: str, beside: Path) -> Optional[Path]:
    """`value` as a path: relative to the file that names it, then to the working directory; None if neither."""
    for p in (beside.parent / value, Path(value)):
        if p.exists():
            return p
    return None


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed


def read_deepspeed(config: Any, where: str) -> Reading:
    """A DeepSpeed config (a path, or the dict TrainingArguments may hold): the ZeRO stage (3: everything sharded;
    0: replicated; 1 and 2 shard part of the states, which the planner cannot count), the offload devices (cpu:
    --cpu-offload optimizer / params), bf16/fp16, the micro-batch and accumulation when numbers. The buckets are
    counted from the file (hsoffload.planning.overhead)."""
    r = Reading()
    if isinstance(config, dict):
        data, name = config, f"{where} (inline deepspeed)"
        r.not_read.setdefault(name, []).append("zero_optimization buckets (inline: pass --deepspeed-config FILE)")
    else:
        data, name = _load(str(config), "--deepspeed-config"), str(config)
        r.values["deepspeed_config"] = str(config)
    top, zero = _Keys(data), _Keys(data.get("zero_optimization") or {}, "zero_optimization.")
    top.get("zero_optimization")
    stage = zero.get("stage", 0)
    r.values["fsdp"] = stage == 3
    if stage in (1, 2):
        r.unmodelled.append(f"zero_optimization.stage={stage} (optimizer states{' and gradients' * (stage == 2)} "
                            "sharded with the weights replicated)")
    devices = {k: (zero.get(k) or {}).get("device", "none") for k in ("offload_optimizer", "offload_param")}
    if devices["offload_param"] == "cpu":
        r.values["cpu_offload"] = "params"
    elif devices["offload_optimizer"] == "cpu":
        r.values["cpu_offload"] = "optimizer"
    r.unmodelled += [f"zero_optimization.{k}.device=nvme" for k, d in devices.items() if d == "nvme"]
    zero.get("reduce_bucket_size"), zero.get("stage3_prefetch_bucket_size")
    for key, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        if (top.get(key) or {}).get("enabled") is True:
            r.values["dtype"] = dtype
    for key, field in (("train_micro_batch_size_per_gpu", "micro_batch"), ("gradient_accumulation_steps",
                                                                          "grad_accum")):
        value = top.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            r.values[field] = value
    r.not_read[name] = top.not_read() + zero.not_read()
    return r


# ---------------------------------------------------------------------------------------------------------------
# Axolotl


def _model_config(k: _Keys, path: Path, given: Optional[str]) -> Optional[str]:
    """The config.json the shapes come from: `given` (the positional argument), else base_model_config or
    base_model as a local file or folder; PlanError naming the file and what to pass when neither is local."""
    names = [k.get("base_model_config"), k.get("base_model")]
    if given is not None:
        return None
    for name in names:
        if isinstance(name, str) and (local := _local_file(name, path)) is not None:
            return str(local)
    name = next((n for n in names if n), None)
    if name is None:
        raise PlanError(f"hsoffload plan: {path}: no base_model; pass the model's config.json: "
                        f"hsoffload plan CONFIG --axolotl {path}")
    raise PlanError(f"hsoffload plan: {path}: base_model {name!r} is not a local config.json or model folder and "
                    f"the planner reads no network; fetch its config.json (huggingface-cli download {name} "
                    f"config.json) and pass it: hsoffload plan CONFIG --axolotl {path}")


def _adapter(k: _Keys, r: Reading) -> None:
    adapter = k.get("adapter")
    four_bit, eight_bit = k.get("load_in_4bit", False), k.get("load_in_8bit", False)
    if adapter in ("lora", "qlora"):
        r.values["adapter"] = "qlora" if adapter == "qlora" or four_bit else "lora"
    elif adapter:
        r.unmodelled.append(f"adapter={adapter}")
    if eight_bit:
        r.unmodelled.append("load_in_8bit (an int8 base)")
    if k.has("lora_r"):
        r.values["lora_r"] = k.get("lora_r")
    modules = k.get("lora_target_modules")
    if k.get("lora_target_linear", False):
        r.values["lora_target_modules"] = (settings.ALL_LINEAR,)
    elif modules:
        names = [modules] if isinstance(modules, str) else list(modules)
        known = tuple(n for n in names if n in settings.LORA_MODULES + (settings.ALL_LINEAR,))
        r.values["lora_target_modules"] = known or (settings.ALL_LINEAR,)
        r.unmodelled += [f"lora_target_modules={n}" for n in names if n not in known]
    for key in ("lora_modules_to_save", "peft_use_dora", "unfrozen_parameters", "relora"):
        if k.get(key):
            r.unmodelled.append(key)
    double = (k.get("bnb_config_kwargs") or {}).get("bnb_4bit_use_double_quant")
    if isinstance(double, bool):
        r.values["double_quant"] = double


def _kernels(k: _Keys, r: Reading) -> None:
    """Attention, the chunked loss, Liger and the tiled MLP's keys."""
    for key, attn in ATTENTION_KEYS.items():
        if k.get(key, False):
            r.values["attn"] = attn
    implementation = k.get("attn_implementation")
    if implementation:
        if implementation in ATTN_IMPLEMENTATIONS:
            r.values["attn"] = ATTN_IMPLEMENTATIONS[implementation]
        else:
            r.unmodelled.append(f"attn_implementation={implementation}")
    r.unmodelled += [key for key in UNMODELLED_ATTENTION if k.get(key, False)]
    plugins = [str(p) for p in k.get("plugins", [])]
    if k.get("chunked_cross_entropy", False) or k.get("cut_cross_entropy", False) or any(
            "cut_cross_entropy" in p for p in plugins):
        r.values["chunked_loss"] = True
    liger = [key for key in LIGER_KEYS if k.get(key, False)]
    if len(liger) == len(LIGER_KEYS):
        r.values["fused_kernels"] = "liger"
    elif "liger_fused_linear_cross_entropy" in liger:
        r.values["chunked_loss"] = True
    if liger and len(liger) < len(LIGER_KEYS) and liger != ["liger_fused_linear_cross_entropy"]:
        r.unmodelled.append(f"{' '.join(liger)} (partial Liger: the planner counts RMSNorm and SwiGLU together)")
    if k.get("tiled_mlp", False) or k.has("tiled_mlp_num_shards"):
        r.values["tiled_mlp"] = k.get("tiled_mlp_num_shards", 0)  # 0: ALST's auto, decided with the shapes


def _parallel(k: _Keys, r: Reading, path: Path) -> None:
    """Sequence parallelism (Axolotl's is ring attention), FSDP, DeepSpeed (its file read as --deepspeed-config)."""
    degree = k.get("sequence_parallel_degree") or k.get("context_parallel_size")
    if degree:
        r.values.update(sequence_parallel=degree, sequence_parallel_kind="ring", world_size=degree)
    fsdp, cfg = k.get("fsdp"), k.get("fsdp_config")
    if fsdp or cfg:
        options_ = fsdp if isinstance(fsdp, list) else str(fsdp or "full_shard").split()
        conf = {str(key).removeprefix("fsdp_"): v for key, v in (cfg or {}).items()}
        r.values["fsdp"] = True
        if "shard_grad_op" in options_ or conf.get("reshard_after_forward") is False:
            r.unmodelled.append("fsdp shard_grad_op / reshard_after_forward=false (weights kept gathered)")
        if conf.get("offload_params") is True or "offload" in options_:
            r.values["cpu_offload"] = "params"
        if conf.get("activation_checkpointing") is True:
            r.values["checkpointing"] = True
    deepspeed = k.get("deepspeed")
    if deepspeed:
        local = _local_file(str(deepspeed), path) if isinstance(deepspeed, str) else None
        if isinstance(deepspeed, str) and local is None:
            raise PlanError(f"hsoffload plan: {path}: deepspeed {deepspeed!r}: no such file (relative to the config "
                            "or the working directory); pass it: --deepspeed-config FILE")
        r.merge(read_deepspeed(str(local) if local else deepspeed, str(path)))
    elif not (fsdp or cfg):
        r.values["fsdp"] = False


def _training(k: _Keys, r: Reading) -> None:
    """Precision, checkpointing, Axolotl's own activation offload, the optimizer, packing."""
    if k.get("fp16", False) is True:
        r.values["dtype"] = "float16"
    r.values["dtype"] = "bfloat16" if k.get("bf16", False) in (True, "auto") else r.values.get("dtype", "float32")
    checkpointing = k.get("gradient_checkpointing", False)
    r.values["checkpointing"] = bool(checkpointing)
    if isinstance(checkpointing, str):
        r.unmodelled.append(f"gradient_checkpointing={checkpointing} (Axolotl's own offload of the checkpoints)")
    offload = k.get("activation_offloading", False)
    if offload and offload != HIDDEN_STATES_MODE:
        r.unmodelled.append(f"activation_offloading={offload} (Axolotl's own offloader; hidden_states runs hsoffload)")
    if k.has("optimizer"):
        _optimizer(str(k.get("optimizer")), "optimizer", r)
    if k.get("torch_compile", False):
        r.unmodelled.append("torch_compile")


def _by_table(k: _Keys, r: Reading) -> None:
    """The settings whose Axolotl key is one plain key the table names (sequence_len, micro_batch_size, ...)."""
    special = {"base_model", "optimizer", "adapter", "lora_target_modules", "gradient_checkpointing", "deepspeed",
               "fsdp_config"}
    for s in settings.SETTINGS:
        if s.axolotl and " " not in s.axolotl and "." not in s.axolotl and s.axolotl not in special \
                and k.has(s.axolotl):
            r.values[s.name] = k.get(s.axolotl)


def read_axolotl(path: str, config: Optional[str] = None) -> Reading:
    """An Axolotl config: PlanInput's fields, the keys not read, what cannot be counted. `config`: the config.json
    given beside it (else base_model, local)."""
    p = Path(path)
    k = _Keys(_load(path, "--axolotl"))
    r = Reading()
    model = _model_config(k, p, config)
    if model is not None:
        r.values["config"] = model
    _by_table(k, r)
    _training(k, r)
    _kernels(k, r)
    _adapter(k, r)
    _parallel(k, r, p)
    policy = k.get("hsoffload_policy")
    for key in ("hsoffload_offload_fraction", "hsoffload_offload_output_head"):
        if k.get(key) not in (None, 1.0, 1, False):
            r.unmodelled.append(f"{key}={k.get(key)}")
    if policy is not None:
        r.values["policy"] = policy
    for key in NEUTRAL_AXOLOTL:
        k.get(key)
    r.not_read = {path: k.not_read(), **r.not_read}
    return r


def auto_tiles(values: dict[str, Any], hidden: int) -> int:
    """`tiled_mlp: true` without a shard count: ALST's (and Axolotl's) ceil(tokens per rank / hidden size)."""
    tokens = values.get("micro_batch", 1) * values.get("seq_len", 1) // values.get("sequence_parallel", 1)
    return max(1, math.ceil(tokens / hidden))


# ---------------------------------------------------------------------------------------------------------------
# TrainingArguments


def read_trainer_args(path: str) -> Reading:
    """`TrainingArguments` as JSON (`training_args.to_json_string()`; TRL's SFTConfig's max_length and packing
    included)."""
    k = _Keys(_load(path, "--trainer-args"))
    r = Reading()
    for s in settings.SETTINGS:
        if s.trainer_args and " " not in s.trainer_args and k.has(s.trainer_args) and s.name not in (
                "checkpointing", "optimizer", "sample_packing", "fused_kernels"):
            r.values[s.name] = k.get(s.trainer_args)
    length = k.get("max_length") or k.get("max_seq_length")
    if length:
        r.values["seq_len"] = length
    # transformers 5 names it activation_checkpointing (gradient_checkpointing kept as its deprecated alias)
    r.values["checkpointing"] = bool(k.get("gradient_checkpointing", False) or k.get("activation_checkpointing", False))
    k.get("gradient_checkpointing_kwargs"), k.get("activation_checkpointing_kwargs"), k.get("liger_kernel_config")
    r.unmodelled += [key for key in ("parallelism_config", "optim_target_modules", "auto_find_batch_size")
                     if k.get(key, False)]
    r.values["dtype"] = "bfloat16" if k.get("bf16", False) else "float16" if k.get("fp16", False) else "float32"
    if k.has("optim"):
        _optimizer(str(k.get("optim")), "optim", r)
    r.values["sample_packing"] = bool(k.get("packing", False))
    if k.get("use_liger_kernel", False):
        r.values["fused_kernels"] = "liger"
    if k.get("torch_compile", False):
        r.unmodelled.append("torch_compile")
    fsdp = k.get("fsdp") or ""
    options_ = fsdp if isinstance(fsdp, list) else str(fsdp).split()
    conf = {str(key).removeprefix("fsdp_"): v for key, v in (k.get("fsdp_config") or {}).items()}
    r.values["fsdp"] = bool(options_)
    if "shard_grad_op" in options_ or "hybrid_shard" in options_:
        r.unmodelled.append(f"fsdp={' '.join(options_)}")
    if "offload" in options_ or conf.get("offload_params") is True:
        r.values["cpu_offload"] = "params"
    if conf.get("activation_checkpointing") is True:
        r.values["checkpointing"] = True
    deepspeed = k.get("deepspeed")
    if deepspeed:
        r.merge(read_deepspeed(deepspeed, path))
    r.not_read = {path: k.not_read(), **r.not_read}
    return r


def read_files(axolotl: Optional[str], trainer_args: Optional[str], deepspeed: Optional[str],
               config: Optional[str]) -> Reading:
    """The user's files, later over earlier: the Axolotl config, the TrainingArguments, the DeepSpeed config given
    as --deepspeed-config (over the one the others name). `config`: the config.json given as the argument."""
    r = Reading()
    if axolotl:
        r.merge(read_axolotl(axolotl, config))
    if trainer_args:
        r.merge(read_trainer_args(trainer_args))
    if deepspeed:
        r.merge(read_deepspeed(deepspeed, deepspeed))
    return r
