"""One shape per plan: the typed input of `hsoffload plan` (from CLI flags, a Python call or a JSON/YAML file alike)
and its typed results, whose JSON is the dataclass's own, with a format version.

Stdlib only (YAML needs PyYAML, imported when a .yaml file is read).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path
from typing import Any, Optional

from . import settings
from .settings import PlanError
from .band import ErrorBand
from .walls import WallHit

# The version of the JSON of PlanInput and the results: raised when a key is renamed or removed (adding one keeps it).
# 2: a result embeds its input (`input`: PlanInput's fields, its defaults resolved) instead of echoing its settings
#    at the top level; optimizer "adamw8bit" is "adamw_8bit".
PLAN_FORMAT_VERSION = 2
READABLE_INPUT_VERSIONS = (1, 2)  # an input's fields were not renamed from 1 to 2


class _PlanInputMethods:
    """PlanInput's methods; its fields come from the planner's table (hsoffload.planning.settings)."""

    SETTINGS: tuple[settings.Setting, ...] = ()

    def __post_init__(self) -> None:
        settings.check(self, type(self).SETTINGS)

    @classmethod
    def from_mapping(cls, data: dict[str, Any], where: str = "the plan input") -> Any:
        """A PlanInput from a dict of its fields (to_json's output included); PlanError naming an unknown key (and
        the closest field) or another format version."""
        data = dict(data)
        version = data.pop("format_version", PLAN_FORMAT_VERSION)
        if version not in READABLE_INPUT_VERSIONS:
            raise PlanError(f"hsoffload plan: {where}: format_version {version!r}; this hsoffload reads "
                            f"{' and '.join(map(str, READABLE_INPUT_VERSIONS))}")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f"; did you mean {close[0]}?" if close else f"; known: {', '.join(names)}"
                raise PlanError(f"hsoffload plan: {where}: unknown key {key!r}{hint}")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise PlanError(f"hsoffload plan: {where}: missing {', '.join(missing)}")
        return cls(**data)

    @classmethod
    def from_file(cls, path: str, defaults: Optional[dict[str, Any]] = None) -> Any:
        """A PlanInput from a JSON or YAML file of its fields (`config` relative to the file's folder); `defaults`
        fill what the file leaves out (the CLI's seq_len under --max-seq)."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise PlanError(f"hsoffload plan: {path}: cannot read it ({exc.strerror})") from None
        if p.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise PlanError(f"hsoffload plan: {path}: reading YAML needs PyYAML (pip install pyyaml), or write "
                                "the same keys as JSON") from None
            data = yaml.safe_load(text)
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise PlanError(f"hsoffload plan: {path}: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise PlanError(f"hsoffload plan: {path}: a plan input is one mapping of PlanInput's fields")
        if isinstance(data.get("config"), str) and not Path(data["config"]).is_absolute():
            data = {**data, "config": str(p.parent / data["config"])}
        return cls.from_mapping({**(defaults or {}), **data}, where=str(path))

    def to_json(self) -> dict[str, Any]:
        return {"format_version": PLAN_FORMAT_VERSION, **dataclasses.asdict(self)}


# Everything a plan depends on besides the model's config.json: one field per setting of the planner's table, named
# as the setting (the CLI flag is --name-with-dashes but for the GiB sizes, `--device-gib` is device_bytes).
def input_class(table: tuple[settings.Setting, ...]) -> Any:
    """The PlanInput class of a table of settings (the module's PlanInput is the planner table's)."""
    return settings.plan_input_class(table, _PlanInputMethods, module=__name__)


PlanInput = input_class(settings.SETTINGS)


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """What `hsoffload plan` answers for one sequence length (per rank unless the name says per node)."""

    input: Any  # the PlanInput planned, its defaults resolved (policy, sizes, ranks per node, torch, experts)
    model_type: str
    layers: int
    hidden_size: int
    parameters: int
    experts: int
    tokens_per_rank: int
    trainable_parameters: int  # what the optimizer updates: all, or an adapter run's adapters
    layer_input_bytes: int
    offloaded_bytes_per_rank: int
    device_bytes_checkpointing: int  # held for backward, checkpointing alone
    device_bytes_offload: int  # held for backward, with hsoffload
    model_states_device_bytes: int
    model_states_host_bytes_per_node: int
    device_peak_bytes: int  # the tensors' peak (what torch.cuda.max_memory_allocated reports)
    device_reserved_bytes: int  # the tensors' peak plus `overhead`: what the process reserves (nvidia-smi); must fit
    overhead: dict[str, int]  # the process's device bytes beyond its tensors, by term (hsoffload.planning.overhead)
    device_peak_bytes_checkpointing: int
    device_reserved_bytes_checkpointing: int  # what the process reserves with checkpointing alone
    device_peak_bytes_no_checkpointing: int
    peak_phase: str
    peak_parts: dict[str, int]
    dominant_term: str
    dominant_term_bytes: int
    terms: dict[str, int]  # one entry per term of hsoffload.planning.memory (each a function there)
    host_budget_bytes_per_node: int
    host_bytes_per_node: int
    spill_bytes_per_node: int
    host_model_states_fit: bool
    transfer_s_per_layer: float
    forward_s_per_layer: float
    copies_hide_behind_compute: bool
    device_profile: str  # the profile the times are for
    step_time_s: float  # one step with hsoffload as planned (hsoffload.planning.timing)
    step_time_s_checkpointing: float  # the same step with checkpointing alone
    step_overhead: float  # step_time_s / step_time_s_checkpointing - 1
    step_parts: dict[str, float]  # step_time_s by part: compute, exposed copies, collectives, optimizer
    # "fits", "fits with spill", "does not fit", "cannot judge" (a setting the planner cannot model changes memory:
    # `unmodelled` names it), "does not run" (a wall) or "silently wrong" (a wall)
    verdict: str
    fixes: list[str]
    advice: str
    walls: list[WallHit]  # the kernels' walls this run meets (hsoffload.planning.walls), the silently wrong first
    unmodelled: list[str] = dataclasses.field(default_factory=list)  # what makes the verdict "cannot judge"
    # The planner's measured error for the input's device class (hsoffload.planning.band) and the verdict it allows
    # for what the process reserves: "fits", "may not fit" or "does not fit" (None where a wall or an unmodelled
    # setting decides the verdict, or the host's model states do not fit)
    error_band: Optional["ErrorBand"] = None
    banded_verdict: Optional[str] = None
    step_time_s_without_offload: Optional[float] = None  # the same step, checkpointing as given, without hsoffload
    auto_decision: Optional["AutoPlan"] = None  # --policy auto: the decision per layer (hsoffload.choose)

    def to_json(self) -> dict[str, Any]:
        return {"format_version": PLAN_FORMAT_VERSION, **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class AutoPlan:
    """`--policy auto`: the decision the runtime would make from the models' costs (hsoffload.choose)."""

    choices: list[str]  # per decoder layer: none, keep, sac or offload
    counts: dict[str, int]
    budget_bytes: int  # the device
    peak_bytes: int  # predicted, what the process reserves
    step_time_s: float  # predicted
    fits: bool
    table: str  # the decision as the runtime logs it
    prefetch_depth: Optional[int] = None  # layers restored ahead in backward, as chosen


@dataclasses.dataclass(frozen=True)
class LongestRun:
    """The longest sequence one way of running fits (0: none), with its peak and the peak's dominant term."""

    seq_len: int
    peak_bytes: Optional[int] = None
    dominant_term: Optional[str] = None
    wall: Optional[WallHit] = None  # the wall that stopped it below the memory limit, if one did
    reserved_bytes: Optional[int] = None  # the peak plus the process's overhead (what must fit the device)
    step_time_s: Optional[float] = None  # one step at that length (hsoffload.planning.timing)
    step_overhead: Optional[float] = None  # that step over the same without hsoffload's copies, minus 1


@dataclasses.dataclass(frozen=True)
class Fastest:
    """The fastest way of running one length among the table's combinations that fit it: the most tokens per second
    per rank."""

    seq_len: int  # the length compared at: --seq-len given with --max-seq, else the longest any combination fits
    knobs: str  # the row
    column: str  # "checkpointing" or "hsoffload"
    step_time_s: float
    tokens_per_s: float  # per rank: micro-batches x length / sequence-parallel degree / step time
    # PlanInput's fields this combination sets over the searched input (seq_len, checkpointing, chunked_loss,
    # tiled_mlp, sequence_parallel, cpu_offload): `--emit axolotl` writes them back (hsoffload.planning.emit)
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class MaxSeqRow:
    knobs: str  # the knob combination, as the table names it
    checkpointing: LongestRun  # checkpointing alone
    hsoffload: LongestRun  # checkpointing with hsoffload
    hsoffload_host_limit: Optional[int] = None  # with a host RAM: the longest the host holds without spill


@dataclasses.dataclass(frozen=True)
class MaxSeqResult:
    """What `hsoffload plan --max-seq` answers: the longest sequence per knob combination."""

    input: Any  # the PlanInput searched (its seq_len: the first step's), its defaults resolved
    model_type: str
    model_states_device_bytes: int
    model_states_host_bytes_per_node: int
    policy: Optional[str]  # the hsoffload column's policy
    step: int
    rows: list[MaxSeqRow]
    device_profile: str  # the profile the step times are for
    fastest: Optional[Fastest] = None  # None: no combination fits (or none fits the length asked)

    def to_json(self) -> dict[str, Any]:
        return {"format_version": PLAN_FORMAT_VERSION, **dataclasses.asdict(self)}
