"""`hsoffload plan`: will a run fit, before launch, from a model's config.json alone.

Two questions, per rank:

- the device: its peak allocated bytes during one training step (forward, backward with recompute, optimizer step),
  from the model in `plan_memory` (every term a function there), with hsoffload under the chosen policy, with
  checkpointing alone and without checkpointing; the verdict compares the first with `device_bytes`, and when it
  does not fit, the plan names the dominant term and the knobs that would make it fit;
- the host: what the offload policy moves, per node (`max_host_bytes=auto` is 80 % of the node's available RAM),
  and what would spill to disk. Times are estimates: the copy at the given bandwidth, the layer's forward at the given
  compute rate (2 FLOPs per parameter and token, plus causal attention).

`max_seq` searches the longest sequence that fits the device for each combination of knobs that matters.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Optional

from .. import choose, options
from ..options import PolicyName
from . import memory as pm
from . import adapters, band, overhead, timing, walls
from .overhead import DeviceFit, Overhead
from .band import CANNOT_JUDGE
from .host import (HOST_STATES_FRACTION, HostSide, host_advice, host_limit, host_side,  # noqa: F401
                   offloaded_bytes_per_rank)
from .report import advice, format_max_seq, format_plan  # noqa: F401  (the planner's public names)
from .settings import PlanError
from .shapes import PLAN_FORMAT_VERSION, AutoPlan, Fastest, LongestRun, MaxSeqResult, MaxSeqRow, PlanInput, PlanResult  # noqa: F401

logger = logging.getLogger("hsoffload")

_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


def read_config(path: str) -> dict[str, Any]:
    """The dict of a config.json (or of a directory's); PlanError naming the file when it is not one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise PlanError(f"hsoffload plan: {path}: no config.json there; pass a config.json or a directory holding one")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"hsoffload plan: {p}: not a JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise PlanError(f"hsoffload plan: {p}: a config.json holds one JSON object, got {type(data).__name__}")
    return data


# Model types whose configs the planner's formulas follow (checked against meta-device models in
# tests/planning/test_plan.py); other types are looked up in transformers' registry (importing transformers costs
# seconds).
_COMMON_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "olmo2", "phi3", "granite",
    "gemma3_text",
})


def _known_model_types() -> Optional[set[str]]:
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:  # transformers absent: the fields decide
        return None
    return set(CONFIG_MAPPING_NAMES)


def model_shape(path: str) -> pm.ModelShape:
    """The ModelShape of the config at `path`; PlanError for missing or unknown model types and non-LM configs."""
    data = read_config(path)
    model_type = data.get("model_type")
    if not model_type:
        raise PlanError(f"hsoffload plan: {path} has no model_type; it must be a transformers config.json")
    known = None if model_type in _COMMON_MODEL_TYPES else _known_model_types()
    if known is not None and model_type not in known:
        raise PlanError(f"hsoffload plan: {path}: unknown model_type {model_type!r} (not one of the "
                        f"{len(known)} this transformers knows)")
    return pm.shape_from_config(data, source=str(path))


def _mem_available() -> int:
    """This machine's MemAvailable: what max_host_bytes=auto starts from."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_device_bytes() -> int:
    """The local GPU's memory when there is one, else 80 GiB. torch (seconds to import) is asked only on a machine
    with an NVIDIA driver: elsewhere the planner stays stdlib-only."""
    if not Path("/proc/driver/nvidia").exists() and not any(Path("/dev").glob("nvidia[0-9]*")):
        return 80 * (1 << 30)
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except Exception:  # noqa: BLE001  (no usable CUDA: the default stands)
        logger.debug("hsoffload plan: no CUDA device; --device-gib defaults to 80")
    return 80 * (1 << 30)


def _transformers_dir() -> Optional[Path]:
    """The transformers package the planner's process would import, found without importing it (seconds)."""
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return None
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def default_experts_implementation(text_model_type: str) -> str:
    """What transformers runs for an MoE model's experts when nobody asks, decided as transformers decides it:
    "grouped_mm" from 5.0 for model classes whose modeling file uses `@use_experts_implementation` (transformers'
    own test), else "eager" (the expert loop; all of transformers 4.x). Without transformers: "grouped_mm"."""
    package = _transformers_dir()
    if package is None:
        return "grouped_mm"
    init = (package / "__init__.py").read_text(errors="replace") if (package / "__init__.py").is_file() else ""
    version = re.search(r'^__version__\s*=\s*["\']([^"\']+)', init, re.M)
    major = version.group(1).split(".", 1)[0] if version else ""
    if major.isdigit() and int(major) < 5:
        return "eager"
    folder = text_model_type.removesuffix("_text")
    modeling = package / "models" / folder / f"modeling_{folder}.py"
    if modeling.is_file() and "@use_experts_implementation" not in modeling.read_text(errors="replace"):
        return "eager"
    return "grouped_mm"


def resolve(inp: PlanInput, shape: pm.ModelShape) -> PlanInput:
    """`inp` with what it leaves to the planner decided: the policy (the table's default with checkpointing; without
    it only "all" has something to offload), the experts' implementation (None for a dense model), the chunked loss
    Liger's fused cross-entropy is, the last layers kept (at most all), ranks per node, the device's and the host's
    memory, the torch the walls are read for. What a result embeds as its input."""
    policy = inp.policy or (options.default("policy") if inp.checkpointing else PolicyName.ALL).value
    experts = (inp.experts_implementation or default_experts_implementation(shape.text_model_type)
               if shape.moe_layers else None)
    return dataclasses.replace(
        inp, policy=policy, experts_implementation=experts,
        chunked_loss=inp.chunked_loss or inp.fused_kernels == "liger",
        keep_last_layers=min(inp.keep_last_layers, shape.layers),
        local_world_size=inp.local_world_size or min(inp.world_size, 8),
        device_bytes=inp.device_bytes if inp.device_bytes is not None else default_device_bytes(),
        host_ram_bytes=inp.host_ram_bytes if inp.host_ram_bytes is not None else _mem_available(),
        torch_version=inp.torch_version or walls.installed_torch_version(),
    )


def setup_of(inp: PlanInput, shape: pm.ModelShape) -> pm.Setup:
    """The planner's Setup of `inp` (resolved first: resolving a resolved input changes nothing): its step settings
    by name; policy auto as its leanest choice (every layer offloaded: the decision is `auto_decision`'s). PlanError
    on what cannot work."""
    inp = resolve(inp, shape)
    policy = PolicyName(inp.policy)
    if policy.chooses_per_layer:
        if not inp.checkpointing:
            raise PlanError("hsoffload plan: --policy auto chooses per layer whether to checkpoint: drop "
                            "--no-checkpointing")
        policy = PolicyName.HIDDEN_STATES
    setup = pm.setup_from(inp, policy=policy, dtype_bytes=_DTYPES[inp.dtype],
                          selective_checkpointing=policy.offloads_sac_saves)
    setup.check(shape)
    return setup


def unmodelled(inp: PlanInput, shape: pm.ModelShape) -> list[str]:
    """What `inp` sets that changes memory and the planner cannot count, by key: the verdict is then "cannot judge"
    (never a refusal). The keys the input names (`unmodelled`, from a user's files), sample packing without
    flash-attention's varlen kernel (the packed rows' block-diagonal masks), LoRA on MoE experts, a 4-bit MoE base."""
    out = list(inp.unmodelled)
    if inp.sample_packing and inp.attn != "flash":
        out.append(f"sample_packing (with --attn {inp.attn}: each packed row's block-diagonal mask is not modelled; "
                   "--attn flash runs packed sequences without one)")
    return out + adapters.unmodelled_adapter_targets(shape, inp)


_LOGIT_PARTS = ("logits", "logits_float32", "log_probs", "logits_gradients")
def _peak_summary(shape: pm.ModelShape, setup: pm.Setup) -> tuple[pm.Phase, str, int]:
    """The peak phase, its dominant term (logit parts summed as "logits") and that term's bytes."""
    phase = pm.peak(shape, setup)
    parts = dict(phase.parts)
    logits = sum(parts.pop(k, 0) for k in _LOGIT_PARTS)
    if logits:
        parts["logits"] = logits
    name = max(parts, key=lambda k: parts[k])
    return phase, name, parts[name]


def device_profile_of(inp: PlanInput) -> timing.DeviceProfile:
    """The device profile the step times are for: the named or given one, with --tflops / --bandwidth applied."""
    return timing.with_overrides(timing.profile(inp.device_profile), inp.tflops, inp.bandwidth_gbps)


def offloaded_layer_bytes(shape: pm.ModelShape, s: pm.Setup) -> list[int]:
    """What each layer copies to the host and back under `s` (0 for kept layers and without hsoffload)."""
    if s.policy is None:
        return [0] * shape.layers
    held = [pm.held_per_layer_bytes(shape, s, pm.is_moe_layer(shape, i)) for i in range(shape.layers)]
    return [b if i < shape.layers - s.keep_last_layers else 0 for i, b in enumerate(held)]


def overhead_of(inp: PlanInput, shape: pm.ModelShape) -> Overhead:
    """How the process's overhead is counted for `inp` (hsoffload.planning.overhead: each term's default sourced)."""
    zero3 = overhead.zero3_bucket_elements(inp.deepspeed_config, shape.hidden) if inp.deepspeed_config else 0
    return Overhead(fixed_bytes=inp.overhead_bytes, fragmentation=inp.fragmentation, zero3_bucket_elements=zero3)


def _degree_allowed(shape: pm.ModelShape, s: pm.Setup, d: int) -> bool:
    """Whether sequence parallelism of degree `d` (of `s`'s kind) can run this model (Setup.check's rule)."""
    try:
        dataclasses.replace(s, sequence_parallel=d).check_sequence_parallel(shape)
    except PlanError:
        return False
    return True


def _parallel_degrees(shape: pm.ModelShape, s: pm.Setup) -> list[int]:
    return [d for d in (2, 4, 8, 16, 32, 64) if d > s.sequence_parallel and d <= s.world_size
            and s.seq_len % d == 0 and _degree_allowed(shape, s, d)]


def _knob_changes(shape: pm.ModelShape, s: pm.Setup) -> list[tuple[str, dict[str, Any]]]:
    """Single knob changes worth trying, cheapest first."""
    out: list[tuple[str, dict[str, Any]]] = []
    if s.attn in ("eager", "math"):
        out.append(("--attn sdpa", {"attn": "sdpa"}))
    if not s.chunked_loss:
        out.append(("a chunked loss (--chunked-loss)", {"chunked_loss": True}))
    tiles = max(2, math.ceil(s.tokens / shape.hidden))
    if s.tiled_mlp < tiles:
        out.append((f"a tiled MLP (--tiled-mlp {tiles})", {"tiled_mlp": tiles}))
    if not s.checkpointing:
        out.append(("checkpointing with hsoffload", {"checkpointing": True, "policy": options.default("policy").value}))
    for d in _parallel_degrees(shape, s):
        out.append((f"sequence parallelism {d} (--sequence-parallel {d})", {"sequence_parallel": d}))
    if s.world_size > 1 and not s.fsdp:
        out.append(("FSDP sharding", {"fsdp": True}))
    if s.cpu_offload == "none":
        out.append(("optimizer states on the host (--cpu-offload optimizer)", {"cpu_offload": "optimizer"}))
    if s.cpu_offload != "params":
        out.append(("model states on the host (--cpu-offload params)", {"cpu_offload": "params"}))
    return out


def suggest(shape: pm.ModelShape, s: pm.Setup, fit: DeviceFit) -> list[str]:
    """What would make `s` fit: single knob changes that do, else the first combination (greedy) that does."""
    single = []
    for label, change in _knob_changes(shape, s):
        try:
            candidate = dataclasses.replace(s, **change)
            candidate.check(shape)
        except PlanError:
            continue
        if fit.fits(shape, candidate):
            single.append(label)
    if single:
        return single
    combined, labels = s, []
    for _ in range(6):  # greedy: take the change that lowers the peak most, until it fits
        best: Optional[tuple[int, str, pm.Setup]] = None
        for label, change in _knob_changes(shape, combined):
            try:
                candidate = dataclasses.replace(combined, **change)
                candidate.check(shape)
            except PlanError:
                continue
            total = pm.peak(shape, candidate).total
            if best is None or total < best[0]:
                best = (total, label, candidate)
        if best is None or best[0] >= pm.peak(shape, combined).total:
            break
        combined = best[2]
        labels.append(best[1])
        if fit.fits(shape, combined):
            return [" + ".join(labels)]
    return []


def _terms(shape: pm.ModelShape, setup: pm.Setup, moe_last: bool, held_first: int) -> dict[str, int]:
    """One entry per term of hsoffload.planning.memory (the last layer's where a layer's)."""
    return {
        "weights": pm.weights_bytes(shape, setup),
        "gradients": pm.gradients_bytes(shape, setup),
        "optimizer_states": pm.optimizer_state_bytes(shape, setup),
        "optimizer_update": pm.optimizer_step_bytes(shape, setup),
        "fsdp_gathered_layers": pm.fsdp_gathered_bytes(shape, setup),
        "held_for_backward_per_layer": held_first,
        "layer_saved": pm.layer_saved_bytes(shape, setup, moe_last),
        "attention_saved": pm.attention_saved_bytes(shape, setup),
        "mlp_saved": pm.mlp_saved_bytes(shape, setup, moe_last),
        "layer_backward": pm.layer_backward_bytes(shape, setup, moe_last),
        "attention_mask": pm.attention_mask_bytes(shape, setup),
        "ulysses_buffers": pm.ulysses_buffer_bytes(shape, setup),
        "ring_buffers": pm.ring_buffer_bytes(shape, setup),
        "moe_routing": pm.moe_routing_bytes(shape, setup, moe_last),
        "logits": pm.logits_bytes(shape, setup),
        "head_saved": pm.head_saved_bytes(shape, setup),
        "head_forward": pm.head_forward_transient_bytes(shape, setup),
        "head_backward": pm.head_backward_transient_bytes(shape, setup),
        "embedding_output": pm.embedding_bytes(shape, setup),
    }


def _verdict(hit: list[walls.WallHit], cannot: list[str], fits: bool, host: "HostSide") -> str:
    """A wall outranks memory (the run dies or computes garbage whatever the bytes); a setting the planner cannot
    model outranks its bytes."""
    if any(h.consequence == walls.SILENT for h in hit):
        return walls.SILENT
    if hit:
        return walls.CRASH
    if cannot:
        return CANNOT_JUDGE
    if not fits or not host.states_fit:
        return "does not fit"
    return "fits with spill" if host.spill > 0 else "fits"


def _advice(shape: pm.ModelShape, setup: pm.Setup, fit: DeviceFit, fits: bool, host: "HostSide",
            dominant: str, dominant_bytes: int, hit: list[walls.WallHit], cannot: list[str]) -> tuple[list[str], str]:
    """The fixes that would make the run fit and the advice sentence."""
    fixes = [] if fits else suggest(shape, setup, fit)
    why = advice(dominant, dominant_bytes, fixes) if not fits else host_advice(host, setup) if not host.states_fit \
        else ""
    if cannot:
        why = f"the planner cannot model {'; '.join(cannot)}" + (f"; its figures otherwise: {why}" if why else "")
    if hit:
        why = "; ".join(h.sentence() for h in hit) + (f"; also {why}" if why else "")
    return fixes, why


def plan(inp: PlanInput) -> PlanResult:
    """Will `inp` fit: the device peak and its terms, the host side, the copies' time, the verdict and fixes."""
    shape = model_shape(inp.config)
    inp = resolve(inp, shape)
    setup = setup_of(inp, shape)
    layers, local = shape.layers, inp.local_world_size
    moe_flags = [pm.is_moe_layer(shape, i) for i in range(layers)]
    ckpt_setup = dataclasses.replace(setup, checkpointing=True, policy=None)
    held = [pm.held_per_layer_bytes(shape, setup, m) for m in moe_flags]
    layer_input = held[0] if setup.checkpointing else pm.hidden_bytes(shape, setup)
    offloaded_per_rank = offloaded_bytes_per_rank(shape, setup)
    host = host_side(inp.host_ram_bytes, pm.model_states_host_bytes(shape, setup) * local, offloaded_per_rank * local)
    phase, dominant, dominant_bytes = _peak_summary(shape, setup)
    peak_ckpt = pm.peak(shape, ckpt_setup).total
    device = device_profile_of(inp)
    step = timing.step_time(shape, setup, device, offloaded_layer_bytes(shape, setup), local)
    step_ckpt = timing.step_time(shape, ckpt_setup, device, [0] * layers, local)
    step_plain = timing.step_time(shape, dataclasses.replace(setup, policy=None), device, [0] * layers, local)
    transfer_s = layer_input / timing.copy_bandwidth(device, local)
    fit = DeviceFit(inp.device_bytes, overhead_of(inp, shape))
    overhead_terms = fit.terms(shape, setup, phase.total)
    reserved = phase.total + sum(overhead_terms.values())
    hit = walls.met(shape, setup, inp.torch_version)
    cannot = unmodelled(inp, shape)
    fixes, why = _advice(shape, setup, fit, reserved <= inp.device_bytes, host, dominant, dominant_bytes, hit, cannot)
    auto = PolicyName(inp.policy).chooses_per_layer
    return PlanResult(
        input=inp, model_type=shape.model_type, layers=layers, hidden_size=shape.hidden,
        parameters=shape.parameters(), experts=shape.experts, tokens_per_rank=setup.tokens,
        trainable_parameters=adapters.trainable_parameters(shape, setup, moe_flags),
        layer_input_bytes=layer_input, offloaded_bytes_per_rank=offloaded_per_rank,
        device_bytes_checkpointing=sum(pm.held_per_layer_bytes(shape, ckpt_setup, m) for m in moe_flags),
        device_bytes_offload=min(layers, setup.keep_last_layers + 1 + setup.prefetch_depth) * layer_input,
        model_states_device_bytes=pm.model_states_device_bytes(shape, setup),
        model_states_host_bytes_per_node=host.model_states,
        device_peak_bytes=phase.total, device_reserved_bytes=reserved, overhead=overhead_terms,
        device_peak_bytes_checkpointing=peak_ckpt,
        device_reserved_bytes_checkpointing=fit.reserved(shape, ckpt_setup, peak_ckpt),
        device_peak_bytes_no_checkpointing=pm.peak(shape, dataclasses.replace(setup, checkpointing=False,
                                                                              policy=None)).total,
        peak_phase=phase.name, peak_parts=phase.parts, dominant_term=dominant, dominant_term_bytes=dominant_bytes,
        terms=_terms(shape, setup, moe_flags[-1], held[0]),
        host_budget_bytes_per_node=host.budget, host_bytes_per_node=host.offloaded_in_host,
        spill_bytes_per_node=host.spill, host_model_states_fit=host.states_fit,
        transfer_s_per_layer=transfer_s, forward_s_per_layer=step.parts["forward"] / layers,
        copies_hide_behind_compute=transfer_s <= step.parts["forward"] / layers, device_profile=device.name,
        step_time_s=step.total_s, step_time_s_checkpointing=step_ckpt.total_s,
        step_time_s_without_offload=step_plain.total_s, step_overhead=step.total_s / step_ckpt.total_s - 1,
        step_parts=step.parts, verdict=_verdict(hit, cannot, reserved <= inp.device_bytes, host), fixes=fixes,
        advice=why, walls=hit, unmodelled=cannot, error_band=band.BANDS[inp.device_class],
        banded_verdict=None if hit or cannot or not host.states_fit
        else band.BANDS[inp.device_class].verdict(reserved, inp.device_bytes),
        auto_decision=auto_decision(shape, setup, device, local, fit, inp.device_bytes,
                                    host.budget // max(1, local)) if auto else None,
    )


def auto_decision(shape: pm.ModelShape, s: pm.Setup, device: timing.DeviceProfile, local: int, fit: DeviceFit,
                  device_bytes: int, host_bytes: Optional[int] = None) -> AutoPlan:
    """policy auto's decision from the models alone: each layer's bytes without checkpointing and its input, its
    forward and backward at the profile's rate, its copy at the host link; the leanest choice's reserved peak (every
    layer offloaded) as the baseline the runtime measures; the device as the budget."""
    lean = dataclasses.replace(s, policy=PolicyName.HIDDEN_STATES, keep_last_layers=0)
    plain = dataclasses.replace(s, checkpointing=False, policy=None)
    link = timing.copy_bandwidth(device, local)
    costs = []
    projections = timing.projection_times(shape, lean, device)
    for i, (fwd, bwd) in enumerate(timing.layer_times(shape, lean, device)):
        moe = pm.is_moe_layer(shape, i)
        held_keep = pm.held_per_layer_bytes(shape, dataclasses.replace(lean, policy=None), moe)
        costs.append(choose.LayerCost(name=f"model.layers.{i}", held_none=pm.held_per_layer_bytes(shape, plain, moe),
                                      held_keep=held_keep, forward_s=fwd, backward_s=bwd, copy_s=held_keep / link,
                                      sac_bytes=lean.tokens * pm.sac_copied_elements_per_token(shape, moe)
                                      * lean.dtype_bytes, projection_s=projections[i]))
    lean_phases, costs = _auto_phases(shape, lean, plain, fit, costs)
    fixed = timing.step_time(shape, plain, device, [0] * shape.layers, local).total_s
    # The host bytes sac's projections may take: this rank's host budget less the inputs every layer may offload.
    host_room = None if host_bytes is None else max(0, host_bytes - sum(c.held_keep for c in costs))
    d = choose.choose(costs, device_bytes, lean_phases, fixed, sac_window=s.prefetch_depth + 1, host_room=host_room,
                      prefetch_depths=choose.prefetch_depths(s.prefetch_depth))
    return AutoPlan(choices=[str(c) for c in d.choices], counts=d.counts(), budget_bytes=device_bytes,
                    peak_bytes=d.peak_bytes, step_time_s=d.step_s, fits=d.fits, table=d.table(costs),
                    prefetch_depth=d.prefetch_depth)


def _auto_phases(shape: pm.ModelShape, lean: pm.Setup, plain: pm.Setup, fit: DeviceFit,
                 costs: list[choose.LayerCost]) -> tuple[choose.Phases, list[choose.LayerCost]]:
    """The leanest step's reserved peak by phase (hsoffload.costs.Phases) from the phase model, and each layer's own
    forward and backward without checkpointing (its working sets there): the order-aware peak the runtime measures."""
    lean_by = {p.name: p for p in pm.phases(shape, lean)}
    plain_by = {p.name: p for p in pm.phases(shape, plain)}
    n, depth = shape.layers, lean.prefetch_depth

    def reserved(name: str) -> int:
        return fit.reserved(shape, lean, lean_by[name].total)

    def work(by: dict[str, pm.Phase], name: str) -> int:
        return by[name].parts.get("layer_working_set", 0)

    phases = choose.Phases(
        forward=max(reserved("head forward"), reserved("head backward")),
        backward=tuple(reserved(f"backward layer {i}") for i in range(n)),
        after=reserved("optimizer step"),
        layers=tuple(reserved(f"forward layer {k}") for k in range(n)),
        layer_work=tuple(work(lean_by, f"forward layer {k}") for k in range(n)),
        backward_work=tuple(work(lean_by, f"backward layer {i}") for i in range(n)),
        restores=tuple(sum(costs[j].held_keep for j in range(max(0, i - depth), i)) for i in range(n)),
        shared=lean_by[f"backward layer {n - 1}"].parts.get("attention_mask", 0) if n else 0)
    costs = [dataclasses.replace(c, none_forward=work(plain_by, f"forward layer {k}"),
                                 none_backward=work(plain_by, f"backward layer {k}")) for k, c in enumerate(costs)]
    return phases, costs


# ---------------------------------------------------------------------------------------------------------------
# --max-seq


def _longest(shape: pm.ModelShape, s: pm.Setup, fit: DeviceFit, step: int, auto_tiles: bool,
             limit: int = 1 << 26) -> int:
    """The longest multiple of `step` (<= limit) whose peak fits, 0 if none: doubling, then bisection (the peak
    grows with the length; where it steps, as the chunked loss's chunk doubling at powers of two, the length found
    fits but a slightly longer one past the step might too). `auto_tiles`: the MLP tiled in hidden-size chunks at
    each length (ALST's choice)."""

    def ok(k: int) -> bool:
        try:
            candidate = _at_length(shape, s, k * step, auto_tiles)
            candidate.check(shape)
        except PlanError:
            return False
        return fit.fits(shape, candidate)

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi * step <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit // step + 1)
    while hi - lo > 1:  # ok(lo), not ok(hi)
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo * step


def max_seq(inp: PlanInput, step: int = 1024, target: Optional[int] = None) -> MaxSeqResult:
    """The longest sequence (a multiple of `step`, and of the parallel degree) that fits the device, for checkpointing
    alone and hsoffload, with each knob combination that matters; and the fastest of them at `target` tokens (default:
    the longest any of them fits)."""
    shape = model_shape(inp.config)
    # Resolved but for the host's RAM: a host column only where it was given.
    inp = dataclasses.replace(resolve(inp, shape), host_ram_bytes=inp.host_ram_bytes)
    base = setup_of(dataclasses.replace(inp, seq_len=math.lcm(step, inp.sequence_parallel)), shape)
    column_policy = base.policy if base.checkpointing else PolicyName(options.default("policy").value)
    sp = max([1] + [d for d in (2, 4, 8, 16, 32, 64) if d <= inp.world_size and _degree_allowed(shape, base, d)])
    tiles = 0  # hidden-size chunks at each length (ALST's choice)
    combos: list[tuple[str, dict[str, Any]]] = [("as given", {})]
    combos.append(("+ chunked loss", {"chunked_loss": True}))
    combos.append(("+ chunked loss + tiled MLP", {"chunked_loss": True, "tiled_mlp": tiles}))
    last_label, last = combos[-1]
    if sp > 1:
        last_label, last = (f"+ chunked loss + tiled MLP + sequence parallel {sp}",
                            {"chunked_loss": True, "tiled_mlp": tiles, "sequence_parallel": sp})
        combos.append((last_label, last))
    if base.cpu_offload != "params":
        combos.append((f"{last_label} + model states on host", {**last, "cpu_offload": "params"}))
    local, torch_version = inp.local_world_size, inp.torch_version
    fit = DeviceFit(inp.device_bytes, overhead_of(inp, shape))
    device = device_profile_of(inp)
    rows = []
    setups: dict[tuple[str, str], tuple[pm.Setup, bool]] = {}  # (row, column): its setup, and whether it auto-tiles
    for label, change in combos:
        row: dict[str, Any] = {"knobs": label}
        for column, over in (("checkpointing", {"checkpointing": True, "policy": None}),
                             ("hsoffload", {"checkpointing": True, "policy": column_policy})):
            s = dataclasses.replace(base, **{**change, **over})
            setups[(label, column)] = (s, change.get("tiled_mlp") == 0)
            unit = math.lcm(step, s.sequence_parallel)
            # A kernel's wall stops the search below it (past it the run does not run); it is what stopped the
            # search when the longest length found is the last multiple of `unit` before it.
            wall = walls.first_below(shape, dataclasses.replace(s, seq_len=unit), torch_version)
            cap = wall.first_seq_len - 1 if wall is not None else 1 << 26
            longest = _longest(shape, s, fit, unit, auto_tiles=change.get("tiled_mlp") == 0, limit=cap)
            if wall is not None and longest != cap // unit * unit:
                wall = None
            row[column] = LongestRun(seq_len=longest, wall=wall)
            if column == "hsoffload" and inp.host_ram_bytes is not None:
                row["hsoffload_host_limit"] = host_limit(shape, s, inp.host_ram_bytes, local, unit)
            if longest:
                at = _at_length(shape, s, longest, auto_tiles=change.get("tiled_mlp") == 0)
                phase, dominant, _ = _peak_summary(shape, at)
                predicted = timing.step_time(shape, at, device, offloaded_layer_bytes(shape, at), local).total_s
                plain = timing.step_time(shape, at, device, [0] * shape.layers, local).total_s
                row[column] = LongestRun(seq_len=longest, peak_bytes=phase.total, dominant_term=dominant, wall=wall,
                                         reserved_bytes=fit.reserved(shape, at, phase.total), step_time_s=predicted,
                                         step_overhead=predicted / plain - 1)
        rows.append(MaxSeqRow(**row))
    on_host = dataclasses.replace(base, cpu_offload="params")
    fastest = _fastest(shape, rows, setups, device, local, target, fit)
    return MaxSeqResult(
        input=inp, model_type=shape.model_type, model_states_device_bytes=pm.model_states_device_bytes(shape, base),
        model_states_host_bytes_per_node=pm.model_states_host_bytes(shape, on_host) * local,
        policy=column_policy.value, step=step, rows=rows, device_profile=device.name, fastest=fastest,
    )


def _fastest(shape: pm.ModelShape, rows: list[MaxSeqRow], setups: dict[tuple[str, str], tuple[pm.Setup, bool]],
             device: timing.DeviceProfile, local: int, target: Optional[int], fit: DeviceFit) -> Optional[Fastest]:
    """Among the cells whose longest run reaches `target` tokens (default: the longest any reaches), the one of most
    tokens per second per rank at `target` (sequence parallelism splits a sequence over ranks: its step is shorter
    but each rank trains fewer tokens); the simpler combination (earlier row, checkpointing alone first) on a tie."""
    runs = [(row.knobs, col, getattr(row, col).seq_len) for row in rows for col in ("checkpointing", "hsoffload")]
    seq = target if target is not None else max((n for _, _, n in runs), default=0)
    best: Optional[Fastest] = None
    for knobs, col, longest in runs:
        if not longest or longest < seq:
            continue
        s, auto_tiles = setups[(knobs, col)]
        if seq % s.sequence_parallel:
            continue
        at = _at_length(shape, s, seq, auto_tiles)
        if not fit.fits(shape, at):  # the peak is not monotone in the length everywhere (the loss's chunks)
            continue
        t = timing.step_time(shape, at, device, offloaded_layer_bytes(shape, at), local).total_s
        rate = at.tokens * at.grad_accum / t
        if best is None or rate > best.tokens_per_s * (1 + 1e-9):
            chosen = {name: getattr(at, name) for name in ("chunked_loss", "tiled_mlp", "sequence_parallel",
                                                            "cpu_offload")}
            best = Fastest(seq_len=seq, knobs=knobs, column=col, step_time_s=t, tokens_per_s=rate,
                           settings={"seq_len": seq, "checkpointing": True, **chosen})
    return best


def _at_length(shape: pm.ModelShape, s: pm.Setup, seq: int, auto_tiles: bool) -> pm.Setup:
    """`s` at `seq` tokens, its MLP tiled in hidden-size chunks at that length where `auto_tiles` (ALST's choice)."""
    return dataclasses.replace(s, seq_len=seq, tiled_mlp=_auto_tiles(shape, s, seq) if auto_tiles else s.tiled_mlp)


def _auto_tiles(shape: pm.ModelShape, s: pm.Setup, seq: int) -> int:
    tokens = s.micro_batch * seq // s.sequence_parallel
    return max(1, math.ceil(tokens / shape.hidden))
