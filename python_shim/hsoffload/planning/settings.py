"""The planner's table: every setting of `hsoffload plan`, once (the planner's `hsoffload.options`).

Each setting has its name, kind, default, allowed values, flag, a doc line (the flag's help), and where a user's
own files spell it: the Axolotl config key and the `TrainingArguments` name, where one exists. From the table come:

- `PlanInput` (`plan_input_class`: its fields, defaults and order; hsoffload.planning.shapes), whose values are
  checked once, when it is made (`check`);
- the `hsoffload plan` flags (`add_flags`) and the PlanInput of parsed flags (`input_values`);
- the planner's `Setup` (hsoffload.planning.memory: the settings the step's model reads, `step=True`), derived from
  a PlanInput by name;
- the JSON (PlanInput's own fields; `PlanResult` embeds its input).

A setting shared with an offload scope (`option=`) takes its default from the one table of knobs
(hsoffload.options). Stdlib only.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Iterable, Optional, Sequence

from .. import options
from ..options import PolicyName

GIB = 1 << 30
# The caching allocator's reserved-but-unallocated share of the peak ("a few %"; hsoffload.planning.overhead).
FRAGMENTATION = 0.05


class PlanError(ValueError):
    """A config or setting the planner cannot model; the message is one line naming what and why."""


# Kinds: how a value is checked and how its flag parses it.
INT, FLOAT, BOOL, CHOICE, TEXT, PATH, GIB_BYTES, NAMES = (
    "int", "float", "bool", "choice", "text", "path", "gib_bytes", "names")
_TYPES: dict[str, Any] = {INT: int, FLOAT: float, BOOL: bool, CHOICE: str, TEXT: str, PATH: str, GIB_BYTES: int,
                          NAMES: tuple}
REQUIRED = dataclasses.MISSING  # a setting every PlanInput must give

# Allowed values of the choice settings (the memory model's data per value: hsoffload.planning.memory).
ATTENTION_IMPLEMENTATIONS = ("sdpa", "flash", "math", "eager")
OPTIMIZERS = ("adamw", "adam", "adamw_master", "adamw_param_dtype", "adamw_8bit", "paged_adamw_8bit",
              "paged_adamw_32bit", "sgd", "sgd_momentum")
CPU_OFFLOAD = ("none", "optimizer", "params")
FUSED_KERNELS = ("none", "liger")
SEQUENCE_PARALLEL_KINDS = ("ulysses", "ring")
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager")
DTYPES = ("bfloat16", "float16", "float32")
POLICIES = tuple(p.value for p in PolicyName)
ADAPTERS = ("none", "lora", "qlora")
# The linear layers LoRA may target (PEFT's module names in Llama-style decoders); "all-linear": every one of them.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    kind: str
    default: Any
    doc: str  # one line: the flag's help and the docs
    choices: tuple[str, ...] = ()  # CHOICE: the values; NAMES: the names each item may be (empty: any)
    minimum: Optional[float] = None  # the least allowed value
    above: Optional[float] = None  # the value must be greater
    below: Optional[float] = None  # the value must be less
    nullable: bool = False  # None is a value ("default: ..." in the doc says what it stands for)
    flag: Optional[str] = None  # the `hsoffload plan` flag (default --name-with-dashes; GiB sizes --stem-gib)
    metavar: Optional[str] = None
    option: Optional[str] = None  # the hsoffload.options knob this is: its default (and flag) come from there
    axolotl: Optional[str] = None  # the key of an Axolotl config that sets it (None: none does)
    trainer_args: Optional[str] = None  # the `transformers.TrainingArguments` field that sets it
    step: bool = True  # the step's model reads it: a field of the planner's Setup (hsoffload.planning.memory)

    @property
    def cli_flag(self) -> str:
        if self.option is not None and options.BY_NAME[self.option].plan_flag:
            return options.BY_NAME[self.option].plan_flag
        if self.flag is not None:
            return self.flag
        stem = self.name.removesuffix("_bytes") if self.kind == GIB_BYTES else self.name
        return "--" + stem.replace("_", "-") + ("-gib" if self.kind == GIB_BYTES else "")

    @property
    def dest(self) -> str:
        """The argparse destination: the field's name, but for the GiB sizes (their flag's stem)."""
        return self.cli_flag.lstrip("-").replace("-", "_") if self.kind == GIB_BYTES else self.name

    def default_value(self) -> Any:
        """The default a PlanInput gets (a shared knob's: the one table's, its environment variable included)."""
        if self.option is not None:
            value = options.default(self.option)
            return value.value if isinstance(value, PolicyName) else value
        return self.default

    def field(self) -> tuple[str, Any, Any]:
        """This setting as a dataclass field: (name, type, dataclasses.field)."""
        kind_type = _TYPES[self.kind]
        typ = Optional[kind_type] if self.nullable else kind_type
        if self.default is REQUIRED:
            return self.name, typ, dataclasses.field()
        if self.option is not None:
            return self.name, typ, dataclasses.field(default_factory=self.default_value)
        return self.name, typ, dataclasses.field(default=self.default)


def _sp_doc() -> str:
    return ("ulysses (default: DeepSpeed Ulysses/ALST, all-to-all buffers of q, k, v and the output; D must divide "
            "the attention heads) or ring (ring attention / torch context parallel: key/value chunks passed round; "
            "sdpa or flash only)")


SETTINGS: tuple[Setting, ...] = (
    Setting("config", PATH, REQUIRED, "a transformers config.json, or a directory holding one (no weights needed)",
            flag="config", step=False, axolotl="base_model / base_model_config"),
    Setting("seq_len", INT, REQUIRED, "tokens per sequence (required unless --max-seq; with --max-seq: the length "
            "the fastest combination is picked for)", minimum=1, axolotl="sequence_len",
            trainer_args="max_length / max_seq_length"),
    Setting("micro_batch", INT, 1, "sequences per rank and step (default 1)", minimum=1,
            axolotl="micro_batch_size", trainer_args="per_device_train_batch_size"),
    Setting("grad_accum", INT, 1, "micro-batches per optimizer step: the step time covers them all (default 1)",
            minimum=1, axolotl="gradient_accumulation_steps", trainer_args="gradient_accumulation_steps"),
    Setting("world_size", INT, 1, "ranks in all (default 1: nothing sharded; from an Axolotl config: its sequence-"
            "parallel degree)", minimum=1),
    Setting("local_world_size", INT, None, "ranks per node (default: min(world size, 8))", minimum=1, nullable=True,
            step=False),
    Setting("dtype", CHOICE, "bfloat16", "bfloat16 (default), float16 or float32", choices=DTYPES, step=False,
            axolotl="bf16 / fp16", trainer_args="bf16 / fp16"),
    Setting("device_profile", TEXT, None, "the accelerator the step time is for: h100-sxm (default), h100-pcie, "
            "h200, a100-80gb, or a JSON file of hsoffload.planning.timing.DeviceProfile's fields", nullable=True,
            metavar="NAME|JSON", step=False),
    Setting("bandwidth_gbps", FLOAT, None, "host<->device copy bandwidth per rank, GB/s (default: the device "
            "profile's)", above=0, nullable=True, flag="--bandwidth", metavar="GBps", step=False),
    Setting("tflops", FLOAT, None, "sustained compute per rank, TFLOP/s (default: the device profile's)", above=0,
            nullable=True, step=False),
    Setting("host_ram_bytes", GIB_BYTES, None, "available RAM of one node, GiB (default: this machine's "
            "MemAvailable)", above=0, nullable=True, step=False),
    Setting("device_bytes", GIB_BYTES, None, "memory of one device, GiB (default: the local GPU's when there is "
            "one, else 80)", above=0, nullable=True, flag="--device-gib", step=False),
    Setting("prefetch_depth", INT, None, "layers restored ahead in backward", minimum=0, option="prefetch_depth",
            axolotl="hsoffload_prefetch_depth"),
    Setting("policy", CHOICE, None, "hidden_states (default with checkpointing), sac (projection outputs kept), all "
            "(default with --no-checkpointing) or auto (per layer, from the models)", choices=POLICIES,
            nullable=True, flag="--policy", axolotl="hsoffload_policy"),
    Setting("keep_last_layers", INT, None, "last layers left on the device", minimum=0, option="keep_last_layers",
            axolotl="hsoffload_keep_last_layers"),
    Setting("optimizer", CHOICE, "adamw", "adamw (default: two float32 moments per parameter), adam, adamw_master "
            "(DeepSpeed bf16: float32 master weights and two moments on the device), adamw_param_dtype (torch AdamW "
            "on bf16 weights: moments in bf16), adamw_8bit (bitsandbytes: two 8-bit moments and a float32 absmax "
            "per 256), paged_adamw_8bit / paged_adamw_32bit (bitsandbytes paged: the states in unified memory, "
            "paged in tensor by tensor at the step), sgd or sgd_momentum", choices=OPTIMIZERS,
            axolotl="optimizer", trainer_args="optim"),
    Setting("sequence_parallel", INT, 1, "sequence parallelism of degree D: tokens per rank = micro-batch x seq / D "
            "(default 1)", minimum=1, metavar="D",
            axolotl="sequence_parallel_degree / context_parallel_size"),
    Setting("tiled_mlp", INT, 1, "MLP computed in N sequence chunks, saving only its input (default 1: untiled)",
            minimum=1, metavar="N", axolotl="tiled_mlp / tiled_mlp_num_shards"),
    Setting("chunked_loss", BOOL, False, "a fused/chunked linear cross-entropy: the logits are never materialised",
            axolotl="chunked_cross_entropy / cut_cross_entropy"),
    Setting("attn", CHOICE, "sdpa", "sdpa (default) or flash: linear in the sequence; math (SDPA's fallback without "
            "fused kernels) or eager: quadratic", choices=ATTENTION_IMPLEMENTATIONS,
            axolotl="flash_attention / sdp_attention / eager_attention / attn_implementation"),
    Setting("checkpointing", BOOL, True, "gradient checkpointing (--no-checkpointing: hsoffload then offloads with "
            "policy all)", axolotl="gradient_checkpointing", trainer_args="gradient_checkpointing"),
    Setting("fsdp", BOOL, True, "weights, gradients and optimizer states FSDP-sharded over --world-size "
            "(--no-fsdp: replicated on every rank)", axolotl="fsdp / fsdp_config / deepspeed",
            trainer_args="fsdp / deepspeed"),
    Setting("cpu_offload", CHOICE, "none", "none (default), optimizer (optimizer states, float32 master weights and "
            "gradients in pinned host memory, the step on the CPU: ZeRO-Offload) or params (also the weights: FSDP2 "
            "CPUOffloadPolicy, ZeRO-3 offload_param; the device holds the gathered layers)", choices=CPU_OFFLOAD,
            axolotl="fsdp_config.offload_params / deepspeed", trainer_args="fsdp / deepspeed"),
    Setting("fused_kernels", CHOICE, "none", "none (default: transformers' eager modules) or liger (Liger's RMSNorm, "
            "SwiGLU and fused linear cross-entropy, as TRL's use_liger_kernel or Axolotl's liger_* keys: they save "
            "less; implies --chunked-loss)", choices=FUSED_KERNELS, axolotl="liger_rms_norm / liger_glu_activation "
            "/ liger_fused_linear_cross_entropy", trainer_args="use_liger_kernel"),
    Setting("sequence_parallel_kind", CHOICE, "ulysses", _sp_doc(), choices=SEQUENCE_PARALLEL_KINDS),
    Setting("experts_implementation", CHOICE, None, "MoE models: grouped_mm (transformers 5.x's default: one grouped "
            "GEMM per projection) or eager (the loop over the experts, transformers 4.x); default: what the "
            "installed transformers runs for the model class", choices=EXPERTS_IMPLEMENTATIONS, nullable=True),
    Setting("share_copies", BOOL, None, "as OffloadConfig(share_copies=True): policy all copies a tensor several ops "
            "save once (default: a copy per save, each restoring its own bytes)", option="share_copies",
            axolotl="hsoffload_share_copies"),
    Setting("attention_mask", BOOL, False, "the batches carry a padding or packing mask (SDPA then runs its "
            "memory-efficient kernel with the mask, silently wrong past 65,536 tokens); default: padding-free "
            "causal batches"),
    Setting("adapter", CHOICE, "none", "none (default: a full fine-tune), lora (frozen base weights in the dtype: no "
            "gradients or optimizer states for them; float32 adapters of rank --lora-r on --lora-target-modules) or "
            "qlora (the same over a bitsandbytes nf4 base)", choices=ADAPTERS, axolotl="adapter / load_in_4bit"),
    Setting("lora_r", INT, 8, "LoRA rank r (default 8, PEFT's): each targeted linear of d_in x d_out gains "
            "r x (d_in + d_out) float32 parameters", minimum=1, metavar="R", axolotl="lora_r"),
    Setting("lora_target_modules", NAMES, (ALL_LINEAR,), "the linear layers LoRA targets, comma-separated, from "
            f"{', '.join(LORA_MODULES)}, or {ALL_LINEAR} (default: every one, Axolotl's lora_target_linear)",
            choices=LORA_MODULES + (ALL_LINEAR,), metavar="NAMES", axolotl="lora_target_modules / lora_target_linear"),
    Setting("double_quant", BOOL, True, "qlora: bitsandbytes' double quantisation of the nf4 absmax (default on, as "
            "Axolotl loads 4-bit bases)", axolotl="bnb_config_kwargs.bnb_4bit_use_double_quant"),
    Setting("sample_packing", BOOL, False, "sequences packed into rows of --seq-len tokens, no padding, attention "
            "per packed sequence (flash-attention's varlen kernel; with another --attn the verdict is 'cannot "
            "judge')", axolotl="sample_packing", trainer_args="packing"),
    Setting("packed_sequence_len", INT, None, "sample packing: the mean length of the sequences packed into a row "
            "(their attention cost; default: --seq-len, one per row)", minimum=1, nullable=True, metavar="TOKENS"),
    Setting("unmodelled", NAMES, (), "settings of the run the planner cannot model that change memory (read from "
            "the user's files): the verdict is 'cannot judge', naming them", metavar="KEYS", step=False),
    Setting("device_class", CHOICE, "gpu", "which measured error band the banded verdict uses: gpu (published runs "
            "on NVIDIA GPUs, the default) or emulated (the emulated device's tracked peaks); hsoffload.planning.band",
            choices=("gpu", "emulated"), step=False),
    Setting("torch_version", TEXT, None, "the torch release the kernels' walls are read for (default: the installed "
            "one, from package metadata)", nullable=True, flag="--torch", metavar="VERSION", step=False),
    Setting("overhead_bytes", GIB_BYTES, None, "device GiB the process holds beyond its tensors, instead of the "
            "sourced defaults (CUDA context, cuBLAS workspaces, NCCL communicators, ZeRO-3 buckets); the "
            "allocator's margin (--fragmentation) is added either way", minimum=0, nullable=True, step=False),
    Setting("fragmentation", FLOAT, FRAGMENTATION, "the caching allocator's reserved-but-unused share of the peak "
            f"(default {FRAGMENTATION})", minimum=0, below=1, step=False),
    Setting("deepspeed_config", PATH, None, "a DeepSpeed config: with ZeRO-3, its reduce and prefetch buckets are "
            "counted ('auto' as transformers fills it)", nullable=True, metavar="JSON", step=False,
            axolotl="deepspeed", trainer_args="deepspeed"),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


# ---------------------------------------------------------------------------------------------------------------
# Checks: one per kind, naming the flag, the value and what is allowed


def _bound_words(s: Setting) -> str:
    if s.minimum is not None and s.below is not None:
        return f"in [{s.minimum:g}, {s.below:g})"
    words = [f">= {s.minimum:g}" if s.minimum is not None else "", f"> {s.above:g}" if s.above is not None else "",
             f"< {s.below:g}" if s.below is not None else ""]
    return " and ".join(w for w in words if w)


def _shown(s: Setting, value: Any) -> str:
    return f"{value / GIB:g}" if s.kind == GIB_BYTES and isinstance(value, (int, float)) else repr(value) \
        if isinstance(value, str) else str(value)


def _check_number(s: Setting, value: Any) -> Any:
    number = (int,) if s.kind in (INT, GIB_BYTES) else (int, float)
    if not isinstance(value, number) or isinstance(value, bool):
        raise PlanError(f"hsoffload plan: {s.cli_flag} must be {'an int' if s.kind == INT else 'a number'}, "
                        f"got {value!r}")
    if ((s.minimum is not None and value < s.minimum) or (s.above is not None and value <= s.above)
            or (s.below is not None and value >= s.below)):
        raise PlanError(f"hsoffload plan: {s.cli_flag} must be {_bound_words(s)}, got {_shown(s, value)}")
    return value


def _check_names(s: Setting, value: Any) -> tuple[str, ...]:
    items = tuple(value.split(",")) if isinstance(value, str) else value
    if not isinstance(items, (tuple, list)) or not all(isinstance(v, str) and v for v in items):
        raise PlanError(f"hsoffload plan: {s.cli_flag} must be a list of names, got {value!r}")
    wrong = [v for v in items if s.choices and v not in s.choices]
    if wrong:
        raise PlanError(f"hsoffload plan: {s.cli_flag}: {', '.join(map(repr, wrong))} not one of "
                        f"{', '.join(s.choices)}")
    return tuple(items)


def check_value(s: Setting, value: Any) -> Any:
    """`value` checked (and normalised: a list of names to a tuple) for `s`; PlanError naming the flag otherwise."""
    if value is None and s.nullable:
        return None
    if s.kind in (INT, FLOAT, GIB_BYTES):
        return _check_number(s, value)
    if s.kind == BOOL:
        if not isinstance(value, bool):
            raise PlanError(f"hsoffload plan: {s.cli_flag} must be true or false, got {value!r}")
        return value
    if s.kind == NAMES:
        return _check_names(s, value)
    if not isinstance(value, str) or not value:
        raise PlanError(f"hsoffload plan: {s.cli_flag} must be a non-empty string, got {value!r}")
    if s.kind == CHOICE and value not in s.choices:
        raise PlanError(f"hsoffload plan: {s.cli_flag} must be one of {', '.join(s.choices)}, got {value!r}")
    return value


def check(inp: Any, settings: Iterable[Setting]) -> None:
    """Every field of `inp` checked against its setting, once (PlanInput does it when made); normalised values are
    written back."""
    for s in settings:
        value = check_value(s, getattr(inp, s.name))
        if value is not getattr(inp, s.name):
            object.__setattr__(inp, s.name, value)


# ---------------------------------------------------------------------------------------------------------------
# Generated: PlanInput's class, the flags


def plan_input_class(settings: Sequence[Setting], base: type, name: str = "PlanInput",
                     module: Optional[str] = None) -> type:
    """A frozen dataclass with one field per setting, in the table's order (the REQUIRED ones first), on `base`
    (its methods: from_mapping, from_file, to_json; its __post_init__ runs `check`)."""
    ordered = [s for s in settings if s.default is REQUIRED] + [s for s in settings if s.default is not REQUIRED]
    doc = ("Everything a plan depends on besides the model's config.json: one field per setting of "
           "hsoffload.planning.settings (generated from that table).")
    cls = dataclasses.make_dataclass(name, [s.field() for s in ordered], bases=(base,), frozen=True,
                                     namespace={"SETTINGS": tuple(settings), "__doc__": doc})
    cls.__module__ = module or base.__module__
    return cls


def _parser_type(s: Setting) -> Optional[Callable[[str], Any]]:
    if s.kind == INT:
        return int
    if s.kind in (FLOAT, GIB_BYTES):
        return float
    if s.kind == NAMES:
        return lambda text: tuple(part.strip() for part in text.split(",") if part.strip())
    return None


def add_flags(parser: argparse.ArgumentParser, settings: Iterable[Setting]) -> None:
    """One flag per setting: its type, default (None for the required ones: the CLI says what is missing) and help.
    Switches take --name / --no-name."""
    for s in settings:
        default = None if s.default is REQUIRED else s.default_value()
        if s.kind == GIB_BYTES and default is not None:
            default = default / GIB
        help_text = s.doc + (f" (default {default})" if s.option is not None else "")
        if s.cli_flag == s.name:  # positional
            parser.add_argument(s.name, nargs="?", default=None, help=help_text)
        elif s.kind == BOOL:
            parser.add_argument(s.cli_flag, dest=s.dest, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        else:
            parser.add_argument(s.cli_flag, dest=s.dest, type=_parser_type(s), default=default, metavar=s.metavar,
                                help=help_text)


def input_values(args: argparse.Namespace, settings: Iterable[Setting]) -> dict[str, Any]:
    """PlanInput's fields from parsed flags, by name (GiB sizes as bytes): those the namespace has."""
    out: dict[str, Any] = {}
    for s in settings:
        if not hasattr(args, s.dest):
            continue
        value = getattr(args, s.dest)
        out[s.name] = int(value * GIB) if s.kind == GIB_BYTES and value is not None else value
    return out


def flag_dests(settings: Iterable[Setting]) -> dict[str, str]:
    """Each setting's argparse destination, by its name."""
    return {s.name: s.dest for s in settings}


def markdown_table(settings: Iterable[Setting] = SETTINGS) -> str:
    """The table for docs/usage.md: setting, flag, default, Axolotl key, TrainingArguments name."""
    rows = ["| setting | flag | default | Axolotl | TrainingArguments |", "|---|---|---|---|---|"]
    for s in settings:
        default = "required" if s.default is REQUIRED else repr(s.default_value())
        rows.append(f"| `{s.name}` | `{s.cli_flag}` | {default} | {s.axolotl or '-'} | {s.trainer_args or '-'} |")
    return "\n".join(rows)
