"""The one table of knobs: every option of an offload scope (and the Axolotl plugin's loading keys), once.

Each option has its name, kind, default, range, a doc line, and where else it is spelled; everything else is derived
from this table or checked against it by `tests/offload/test_options.py`:

- `hsoffload.OffloadConfig` (its fields' defaults and their validation: `validate`);
- the engine: `csrc/include/hsoffload/options.h` is generated from it (`python -m hsoffload.options --write`), the C++
  `OffloadConfig` fields and the `OffloadScope` class constructor's arguments and defaults come from that header, and
  the shim passes the engine's options by name (`engine_kwargs`);
- the Axolotl plugin's `hsoffload_<name>` keys, their pydantic model and validation, and the YAML in its docstring;
- the `hsoffload plan` flags that share a knob's name (`--prefetch-depth`, `--policy`, ...);
- the table in docs/usage.md ("Knobs").

Also the one decider of the auto host budget's fraction of MemAvailable (engine, shim and planner).

Pure data and stdlib: the planner and the CLI import it without torch.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import textwrap
from enum import Enum
from pathlib import Path
from typing import Any, Optional, Union

# "auto" host budget: this fraction of MemAvailable at first use, per rank on the node (engine: host_budget.cpp through
# options.h; shim: hsoffload.offload.host; planner: hsoffload.planning.plan).
AUTO_HOST_BUDGET_FRACTION = 0.8


class PolicyName(str, Enum):
    """The named offload policies (a callable policy is the fourth kind; hsoffload.offload.policy). A str: users and
    YAML pass and compare the plain strings ("sac" == PolicyName.SAC)."""

    HIDDEN_STATES = "hidden_states"
    SAC = "sac"
    ALL = "all"
    AUTO = "auto"

    def __str__(self) -> str:
        return self.value

    @property
    def marks_layer_inputs(self) -> bool:
        """The patch marks each checkpointed decoder layer's hidden_states (and checkpointing is expected)."""
        return self in (PolicyName.HIDDEN_STATES, PolicyName.SAC, PolicyName.AUTO)

    @property
    def chooses_per_layer(self) -> bool:
        """Per decoder layer, measured: no checkpointing, its input kept, or offloaded (hsoffload.offload.auto)."""
        return self is PolicyName.AUTO

    @property
    def picks_saved_tensors(self) -> bool:
        """The pack hook chooses among saved tensors (a selector runs per save): every policy but hidden_states (and
        auto, which applies hidden_states to the layers it offloads)."""
        return self not in (PolicyName.HIDDEN_STATES, PolicyName.AUTO)

    @property
    def offloads_every_save(self) -> bool:
        """Every saved activation worth a copy is offloaded (the output head's only when asked); no checkpointing
        needed."""
        return self is PolicyName.ALL

    @property
    def offloads_sac_saves(self) -> bool:
        """Every tensor a selective-checkpoint context keeps is offloaded, not only *_CPU_OFFLOAD ones."""
        return self is PolicyName.SAC

    @classmethod
    def parse(cls, value: Any) -> "PolicyName":
        """`value` as a PolicyName; ValueError naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"hsoffload: policy must be one of {', '.join(repr(p.value) for p in cls)} or a callable "
                             f"(tensor, module_qualified_name) -> bool, got {value!r}") from None


# Option kinds: how a value is checked, typed in C++ and pydantic, and spelled in YAML.
INT, BOOL, FLOAT, BYTES, BYTES_OR_AUTO, PATH, FILE, POLICY = (
    "int", "bool", "float", "bytes", "bytes_or_auto", "path", "file", "policy")


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    kind: str
    default: Any
    doc: str
    engine: bool = False  # the engine's OffloadConfig has it (csrc; the OffloadScope class constructor's argument)
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    nullable: bool = False  # None is a value (OffloadConfig) / null (YAML)
    env: Optional[str] = None  # the default is read from this environment variable when it is set
    config: bool = True  # a field of OffloadConfig (False: an Axolotl plugin key only)
    plan_flag: Optional[str] = None  # the `hsoffload plan` flag that takes this knob, if any

    @property
    def axolotl_key(self) -> str:
        return f"hsoffload_{self.name}"


OPTIONS: tuple[Option, ...] = (
    # The engine's options, in the OffloadScope class constructor's argument order.
    Option("min_offload_size", INT, 1024, "marked tensors smaller than this many bytes stay on the device",
           engine=True, minimum=0),
    Option("offload_cpu_tensors", BOOL, False, "also copy marked CPU tensors into the host pool (CPU runs, tests)",
           engine=True),
    Option("pin_memory", BOOL, True, "pinned host buffers for accelerator tensors (needed for asynchronous copies)",
           engine=True),
    Option("use_streams", BOOL, True, "copy on side streams ordered by events; false: on the compute stream",
           engine=True),
    Option("prefetch_depth", INT, 1, "decoder layers (prefetch groups) restored ahead of their use in backward",
           engine=True, minimum=0, plan_flag="--prefetch-depth"),
    Option("spill_dir", PATH, None, "local directory for packs over the host budget (null: they stay on the device)",
           engine=True, nullable=True, env="HSOFFLOAD_SPILL_DIR"),
    Option("spill_prefetch_depth", INT, 2, "decoder layers of spilled tensors read back ahead of their use",
           engine=True, minimum=0),
    Option("spill_wait_ms", INT, 30000, "a pack's longest wait (ms) for host room when the disk lags (0: keep on device)",
           engine=True, minimum=0, maximum=3600 * 1000),
    Option("share_copies", BOOL, False, "saves of one tensor by several ops share one host copy (fewer bytes; a .data "
           "write between the saves then restores the first's bytes)", engine=True, plan_flag="--share-copies"),
    # The shim's options (process-wide limits applied at scope entry; what is marked).
    Option("max_pool_bytes", INT, None, "cap of the pinned host pool (null: follows the host budget)",
           minimum=0, nullable=True),
    Option("reserve_host_bytes", BYTES, None, "host bytes pinned before the first step (`hsoffload plan`'s host "
           "figure; null: the pool grows during the first steps)", nullable=True),
    Option("max_host_bytes", BYTES_OR_AUTO, None, "offloaded bytes in host RAM at once: bytes, a size such as 64GiB, "
           f"or auto ({AUTO_HOST_BUDGET_FRACTION:.0%} of MemAvailable / ranks on the node); null: keep the process's "
           "budget", nullable=True,
           env="HSOFFLOAD_MAX_HOST_BYTES"),
    Option("policy", POLICY, PolicyName.HIDDEN_STATES, "what is offloaded: hidden_states, sac (plus what selective "
           "checkpointing keeps), all (every saved activation; no checkpointing needed) or auto (per layer, measured: "
           "no checkpointing, input kept, projections and input offloaded (sac) or input offloaded, the fastest step "
           "under device_budget)", plan_flag="--policy"),
    Option("device_budget", BYTES, None, "policy auto: the device bytes a step may reserve at its peak (null: the "
           "device's memory less what the process holds outside the allocator, less 2 %; at most 95 %)", nullable=True),
    Option("auto_calibration_steps", INT, 2, "policy auto: steps run with every layer offloaded, measuring, before "
           "the first decision", minimum=1, maximum=100),
    Option("auto_report_only", BOOL, False, "policy auto: decide and log, but keep every layer offloaded"),
    Option("auto_state_path", FILE, None, "policy auto: a JSON file its measurements are saved to at each decision "
           "and read from by a run that starts with it (a cache: where its identity matches, each bucket's first "
           "step checks it, then decides from it); {rank} is replaced by the rank (null: not saved; the Trainer "
           "integration uses <output_dir>/hsoffload_auto/, read only by a run that resumes)",
           nullable=True),
    Option("keep_last_layers", INT, 0, "the last k decoder layers keep their tensors on the device", minimum=0,
           plan_flag="--keep-last-layers"),
    Option("offload_fraction", FLOAT, 1.0, "share of the other decoder layers (the first ones) that offload",
           minimum=0.0, maximum=1.0),
    Option("offload_output_head", BOOL, False, "policy all: also the output head's saved tensors"),
    # The Axolotl plugin's loading keys (not scope options).
    Option("zero3_loading", BOOL, False, "with a ZeRO-3 `deepspeed:` config: ranks other than rank 0 receive only "
           "their partition while the model loads", config=False),
    Option("zero3_loading_verify", BOOL, False, "check every partition against rank 0's values (a checksum each)",
           config=False),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
CONFIG_OPTIONS: tuple[Option, ...] = tuple(o for o in OPTIONS if o.config)
ENGINE_OPTIONS: tuple[Option, ...] = tuple(o for o in OPTIONS if o.engine)

_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_bytes(value: Union[int, str], what: str) -> Union[int, str]:
    """`value` as an int of bytes, or "auto". Accepts ints and strings like "64GiB", "500MB"; "1e9" is refused."""
    if isinstance(value, bool):
        raise ValueError(f"hsoffload: {what} must be bytes (an int or a string like '64GiB') or 'auto', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"hsoffload: {what} must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        m = _BYTES.match(value)
        if m:
            unit = m.group(2).lower()
            base = 1024 if (m.group(3) or "").lower() == "ib" or not m.group(3) else 1000
            return int(float(m.group(1)) * base ** " kmgt".index(unit or " "))
    raise ValueError(f"hsoffload: {what} must be bytes (an int or a string like '64GiB') or 'auto', got {value!r}")


def default(name: str) -> Any:
    """The option's default: its environment variable when set (parsed as the option is), else the table's."""
    option = BY_NAME[name]
    if option.env is not None:
        value = os.environ.get(option.env)
        if value:
            return validate(option, value, what=option.env)
    return option.default


def allowed(option: Option) -> str:
    """What the option accepts, in words (error messages, the Axolotl keys)."""
    kind = option.kind
    if kind == INT:
        low, high = option.minimum, option.maximum
        if low is not None and high is not None:
            words = f"an int from {int(low):,} to {int(high):,}"
        elif low is not None:
            words = "a non-negative int" if low == 0 else f"an int >= {int(low):,}"
        else:
            words = "an int" if high is None else f"an int <= {int(high):,}"
    elif kind == FLOAT:
        words = f"a number from {option.minimum:g} to {option.maximum:g}"
    else:
        words = {
            BOOL: "true or false",
            BYTES: "an int >= 0 (bytes) or a size such as 24GiB",
            BYTES_OR_AUTO: "auto, an int >= 0 (bytes) or a size such as 64GiB",
            PATH: "a directory path",
            FILE: "a file path (a template: {rank} is replaced by the rank)",
            POLICY: ", ".join(p.value for p in list(PolicyName)[:-1]) + " or " + list(PolicyName)[-1].value,
        }[kind]
    return ("null or " + words) if option.nullable else words


def validate(option: Option, value: Any, what: Optional[str] = None) -> Any:
    """`value` checked (and normalised: sizes to bytes, paths to str, a policy name to its plain string) for `option`;
    ValueError/TypeError naming `what` (default: the option's name), the value and what is allowed."""
    what = what or option.name
    if value is None and option.nullable:
        return None
    kind = option.kind
    if kind == BOOL:
        if not isinstance(value, bool):
            raise TypeError(f"hsoffload: {what} must be a bool, got {value!r}")
        return value
    if kind == INT:
        if not isinstance(value, int) or isinstance(value, bool) or (option.minimum is not None and value < option.minimum):
            raise ValueError(f"hsoffload: {what} must be {allowed(option)}, got {value!r}")
        if option.maximum is not None and value > option.maximum:
            raise ValueError(f"hsoffload: {what} must be {allowed(option)}, got {value}")
        return value
    if kind == FLOAT:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
            option.minimum <= float(value) <= option.maximum
        ):
            raise ValueError(f"hsoffload: {what} must be a number in [{option.minimum:g}, {option.maximum:g}], "
                             f"got {value!r}")
        return value
    if kind in (BYTES, BYTES_OR_AUTO):
        parsed = parse_bytes(value, what)
        if parsed == "auto" and kind == BYTES:
            raise ValueError(f"hsoffload: {what} must be bytes (an int or a string like '8GiB'), got 'auto'")
        return parsed
    if kind in (PATH, FILE):
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise ValueError(f"hsoffload: {what} must be {allowed(option)}, got {value!r}")
        return os.fspath(value)
    if kind == POLICY:  # stored as the plain string (YAML/JSON dump it); its behaviour: PolicyName(value)
        return value if callable(value) else PolicyName.parse(value).value
    raise AssertionError(f"unknown option kind {kind!r}")


def engine_kwargs(config: Any) -> dict[str, Any]:
    """The engine's options of `config` by name, as the OffloadScope class constructor takes them (None path: "")."""
    out = {}
    for option in ENGINE_OPTIONS:
        value = getattr(config, option.name)
        out[option.name] = "" if value is None and option.kind == PATH else value
    return out


# ---------------------------------------------------------------------------------------------------------------
# The generated C++ header

HEADER = Path("csrc/include/hsoffload/options.h")
_CPP_TYPES = {INT: "int64_t", BOOL: "bool", PATH: "std::string"}


def _cpp_value(option: Option) -> str:
    if option.kind == BOOL:
        return "true" if option.default else "false"
    if option.kind == PATH:
        return '""' if option.default is None else f'"{option.default}"'
    return str(int(option.default))


def cpp_header() -> str:
    """The text of csrc/include/hsoffload/options.h."""
    lines = [
        "// The engine's options of one offload scope, as X-macros. GENERATED from python_shim/hsoffload/options.py",
        "// (the one table of knobs) by `python -m hsoffload.options --write`: edit the table, not this file",
        "// (tests/offload/test_options.py fails when they differ).",
        "//",
        "// X(type, name, default): one per option, in the OffloadScope class constructor's argument order. Used for",
        "// the fields of hsoffload::OffloadConfig (scope.h) and the constructor's arguments (ops/registration.cpp).",
        "#pragma once",
        "",
        "#include <cstdint>",
        "#include <string>",
        "",
    ]
    for option in ENGINE_OPTIONS:
        lines += textwrap.wrap(f"{option.name}: {option.doc}.", 116, initial_indent="// ", subsequent_indent="//   ")
    lines.append("#define HSOFFLOAD_ENGINE_OPTIONS(X) \\")
    for i, option in enumerate(ENGINE_OPTIONS):
        end = " \\" if i + 1 < len(ENGINE_OPTIONS) else ""
        lines.append(f"  X({_CPP_TYPES[option.kind]}, {option.name}, {_cpp_value(option)}){end}")
    lines += [
        "",
        "// The constructor's parameters (the same list as one parameter list).",
        "#define HSOFFLOAD_ENGINE_OPTION_PARAMS \\",
        *[f"  {_CPP_TYPES[o.kind]} {o.name}" + (", \\" if i + 1 < len(ENGINE_OPTIONS) else "")
          for i, o in enumerate(ENGINE_OPTIONS)],
        "",
        "namespace hsoffload {",
        "",
        "// spill_wait_ms's bound (one hour).",
        f"constexpr int64_t kMaxSpillWaitMs = {int(BY_NAME['spill_wait_ms'].maximum)};",
        "// The auto host budget: this fraction of MemAvailable at first use, per rank on the node.",
        f"constexpr double kAutoHostBudgetFraction = {AUTO_HOST_BUDGET_FRACTION!r};",
        "",
        "}  // namespace hsoffload",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The Axolotl YAML (the plugin's docstring shows it; the test checks the docstring against it)

def yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    return str(value)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m hsoffload.options --write [ROOT]` rewrites the generated header; `--check` exits 1 if it differs."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("--write", "--check"):
        print("usage: python -m hsoffload.options --write|--check [REPO_ROOT]", file=sys.stderr)
        return 2
    root = Path(args[1]) if len(args) > 1 else Path.cwd()
    path = root / HEADER
    text = cpp_header()
    if args[0] == "--write":
        path.write_text(text)
        return 0
    return 0 if path.is_file() and path.read_text() == text else 1


if __name__ == "__main__":
    sys.exit(main())
