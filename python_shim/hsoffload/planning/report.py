"""The text of `hsoffload plan`: a plan's table and verdict lines, the `--max-seq` table, the advice sentence.

Reads the typed results (hsoffload.planning.shapes) only; stdlib only.
"""

from __future__ import annotations

from typing import Optional

from ..options import AUTO_HOST_BUDGET_FRACTION
from . import walls
from .band import CANNOT_JUDGE
from .shapes import LongestRun, MaxSeqResult, MaxSeqRow, PlanInput, PlanResult

_GIB = float(1 << 30)

_SEQUENCE_PARALLEL_KINDS = {"ulysses": "Ulysses all-to-all", "ring": "ring key/value chunks"}
_CPU_OFFLOAD = {"optimizer": "optimizer states on the host", "params": "model states on the host"}

# The parts of a phase, as the text names them.
_PART_NAMES = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "optimizer_update": "optimizer update temporaries",
    "fsdp_gathered_layers": "FSDP-gathered layers",
    "held_for_backward": "held for backward",
    "attention_mask": "attention mask",
    "layer_working_set": "one layer's forward/recompute + backward working set",
    "final_norm": "final norm",
    "logits": "logits",
    "logits_float32": "logits in float32",
    "log_probs": "loss log-probabilities (float32)",
    "logits_gradients": "logits' gradients",
    "chunked_loss": "chunked loss (one chunk, head gradient)",
}
_OVERHEAD_NAMES = {
    "cuda_context": "CUDA context",
    "cublas_workspaces": "cuBLAS workspaces",
    "nccl_data_parallel": "NCCL communicator (data parallel: gathers or all-reduce)",
    "nccl_sequence_parallel": "NCCL communicator (sequence parallelism)",
    "zero3_buckets": "ZeRO-3 reduce and prefetch buckets",
    "overhead_given": "overhead (--overhead-gib)",
    "fragmentation": "allocator fragmentation margin",
}



def advice(dominant: str, nbytes: int, fixes: list[str]) -> str:
    """One sentence: the dominant term and what would make the run fit."""
    if dominant == "logits":  # the logits' parts summed: the float32 loss over them included
        need = f"the logits and their float32 loss need {nbytes / _GIB:,.1f} GiB"
    else:
        what = _PART_NAMES.get(dominant, dominant.replace("_", " "))
        need = f"the {what} need{'s' if not what.endswith('s') else ''} {nbytes / _GIB:,.1f} GiB"
    if fixes:
        return f"{need}: {' or '.join(fixes)} would make it fit"
    return f"{need}; no combination of the planner's knobs fits this device: more ranks, shorter sequences"


def _knobs_text(i: PlanInput) -> list[str]:
    """The knobs a plan's first line names (from its resolved input)."""
    knobs = [f"attn {i.attn}"]
    if i.sequence_parallel > 1:
        knobs.append(f"sequence parallel {i.sequence_parallel} ({_SEQUENCE_PARALLEL_KINDS[i.sequence_parallel_kind]})")
    if i.fused_kernels != "none":
        knobs.append(f"{i.fused_kernels} kernels")
    if i.experts_implementation:
        knobs.append(f"experts {i.experts_implementation}")
    if i.tiled_mlp > 1:
        knobs.append(f"tiled MLP {i.tiled_mlp}")
    if i.chunked_loss:
        knobs.append("chunked loss")
    if i.sample_packing:
        knobs.append("sample packing")
    if i.adapter != "none":
        knobs.append(f"{i.adapter} r={i.lora_r} on {','.join(i.lora_target_modules)}")
    knobs.append("FSDP" if i.fsdp and i.world_size > 1 else "unsharded")
    knobs.append(i.optimizer)
    if i.cpu_offload != "none":
        knobs.append(_CPU_OFFLOAD[i.cpu_offload])
    return knobs


def format_plan(p: PlanResult) -> str:
    g = lambda n: f"{n / _GIB:,.2f} GiB"  # noqa: E731
    ms = lambda s: f"{s * 1e3:,.2f} ms"  # noqa: E731
    i = p.input
    knobs = _knobs_text(i)
    policy = f"policy {i.policy}" if i.checkpointing else f"no checkpointing, policy {i.policy}"
    rows: list[tuple[str, Optional[str]]] = [
        (f"per rank, device peak ({p.peak_phase}):", None),
    ]
    rows += [(_PART_NAMES.get(k, k), g(v)) for k, v in p.peak_parts.items()]
    rows += [("per rank, beyond the tensors (the process):", None)]
    rows += [(_OVERHEAD_NAMES.get(k, k), g(v)) for k, v in p.overhead.items()]
    rows += [
        ("reserved with hsoffload (nvidia-smi)", f"{g(p.device_reserved_bytes)} of {g(i.device_bytes)}"),
        ("tensors' peak with hsoffload", g(p.device_peak_bytes)),
        ("tensors' peak, checkpointing only", g(p.device_peak_bytes_checkpointing)),
        ("reserved, checkpointing only", g(p.device_reserved_bytes_checkpointing)),
        ("tensors' peak, no checkpointing", g(p.device_peak_bytes_no_checkpointing)),
        ("per rank, terms:", None),
        ("model states on the device", g(p.model_states_device_bytes)),
        ("held for backward, checkpointing only", g(p.device_bytes_checkpointing)),
        ("held for backward, with hsoffload", g(p.device_bytes_offload)),
        ("one layer's saved tensors (recompute)", g(p.terms['layer_saved'])),
        ("  of which attention", g(p.terms['attention_saved'])),
        ("  of which MLP", g(p.terms['mlp_saved'])),
        ("one layer's backward, at its peak", g(p.terms['layer_backward'])),
        ("logits (in the dtype)", g(p.terms['logits'])),
        ("head: saved / forward / backward in flight",
         f"{g(p.terms['head_saved'])} / {g(p.terms['head_forward'])} / {g(p.terms['head_backward'])}"),
        ("per node, in host memory:", None),
        ("model states, all ranks (pinned)", g(p.model_states_host_bytes_per_node)),
        ("offloaded, all ranks", g(p.offloaded_bytes_per_rank * i.local_world_size)),
        (f"host budget ({AUTO_HOST_BUDGET_FRACTION:.0%} of {g(i.host_ram_bytes)} - model states)", g(p.host_budget_bytes_per_node)),
        ("in host memory", g(p.host_bytes_per_node)),
        ("to spill_dir", g(p.spill_bytes_per_node)),
        ("per layer:", None),
        (f"copy of what it holds for backward ({g(p.layer_input_bytes)})", ms(p.transfer_s_per_layer)),
        ("forward compute (estimate)", ms(p.forward_s_per_layer)),
        (f"per step ({p.device_profile}"
         + (f", {i.grad_accum} micro-batches per optimizer step" if i.grad_accum > 1 else "")
         + "; hsoffload.planning.timing):", None),
        ("with hsoffload", f"{p.step_time_s:,.3f} s ({p.step_overhead:+.1%} against checkpointing only)"),
        ("checkpointing only", f"{p.step_time_s_checkpointing:,.3f} s"),
        *([("without checkpointing or hsoffload", f"{p.step_time_s_without_offload:,.3f} s")]
          if not i.checkpointing and p.step_time_s_without_offload is not None else []),
        ("of which copies not hidden by compute",
         ms(p.step_parts.get("exposed_d2h", 0.0) + p.step_parts.get("exposed_h2d", 0.0))),
    ]
    width = max(len(label) for label, value in rows if value is not None) + 4
    lines = [
        f"hsoffload plan: {p.model_type}, {p.layers} layers, hidden {p.hidden_size}, "
        f"{p.parameters / 1e9:.2f} B parameters"
        + (f" ({p.experts} experts)" if p.experts else "")
        + f"; {i.micro_batch} x {i.seq_len:,} tokens ({p.tokens_per_rank:,} per rank), "
        f"{i.dtype}, {i.world_size} ranks ({i.local_world_size} per node); {policy}"
        + (f", keep_last_layers {i.keep_last_layers}" if i.keep_last_layers else "")
        + f"; {', '.join(knobs)}"
    ]
    lines += [label if value is None else f"  {label:<{width}}{value}" for label, value in rows]
    lines += _verdict_lines(p)
    return "\n".join(lines)


def _verdict_lines(p: PlanResult) -> list[str]:
    """The plan's walls, its verdict (with the error band's where it differs) and policy auto's decision."""
    lines: list[str] = []
    hide = (
        "the copies hide behind compute"
        if p.copies_hide_behind_compute
        else f"the copies take {p.transfer_s_per_layer / p.forward_s_per_layer:.1f}x the compute: expect waits"
    )
    for h in p.walls:
        lines.append(f"  wall: {h.sentence()} (source: {h.source})")
    if p.walls:  # the sentences are the wall lines above; what memory says comes after them in the advice
        also = p.advice.split("; also ", 1)[1] if "; also " in p.advice else ""
        label = p.verdict.upper() if p.verdict == walls.SILENT else p.verdict
        lines.append(f"verdict: {label}: the wall{'s' if len(p.walls) > 1 else ''} above" + (f"; also {also}" if also else ""))
    elif p.verdict in ("does not fit", CANNOT_JUDGE):
        lines.append(f"verdict: {p.verdict}; {p.advice}")
    else:
        extra = " (set spill_dir)" if p.verdict == "fits with spill" else ""
        lines.append(f"verdict: {p.verdict}{extra}; {hide}")
    plain = p.verdict.removesuffix(" with spill")
    if p.banded_verdict is not None and p.error_band is not None and p.banded_verdict != plain:
        e = p.error_band
        lines.append(f"with the planner's measured error ({e.device_class}: {e.over:+.0%} / {-e.under:+.0%}): "
                     f"{p.banded_verdict}")
    if p.auto_decision is not None:  # --policy auto: what the runtime would choose, from the models
        lines.append("with --policy auto (the figures above: every layer offloaded, its leanest choice), reserved:")
        lines.extend("  " + line for line in p.auto_decision.table.splitlines())
    return lines


def format_max_seq(r: MaxSeqResult) -> str:
    def cell(row: MaxSeqRow, col: str) -> str:
        run: LongestRun = getattr(row, col)
        if not run.seq_len:
            return "none fits"
        stop = f"; wall: {run.wall.name}" if run.wall else ""
        return (f"{run.seq_len:,} ({run.reserved_bytes / _GIB:,.1f} GiB reserved, {run.peak_bytes / _GIB:,.1f} "
                f"tensors, {run.dominant_term}{stop}; {run.step_time_s:,.1f} s/step"
                + (f", {run.step_overhead:+.1%} copies" if col == "hsoffload" else "") + ")")

    i = r.input
    given = "".join([f", experts {i.experts_implementation}" if i.experts_implementation else "",
                     f", {i.fused_kernels} kernels" if i.fused_kernels != "none" else "",
                     f", {i.adapter}" if i.adapter != "none" else "",
                     f", {_CPU_OFFLOAD[i.cpu_offload]}" if i.cpu_offload != "none" else "",
                     f", sequence parallelism {_SEQUENCE_PARALLEL_KINDS[i.sequence_parallel_kind]}"
                     if i.world_size > 1 else ""])
    header = (f"hsoffload plan --max-seq: {r.model_type}, {i.dtype}, micro-batch {i.micro_batch}, "
              f"{i.world_size} ranks, {i.device_bytes / _GIB:,.1f} GiB per device, attn {i.attn}{given}; longest "
              f"sequence that fits (multiples of {r.step:,}), with what the process reserves, the tensors' peak and "
              "its dominant term")
    width = max(len(row.knobs) for row in r.rows) + 2
    col = max([len("checkpointing only")] + [len(cell(row, c)) for row in r.rows
                                            for c in ("checkpointing", "hsoffload")]) + 2
    with_host = i.host_ram_bytes is not None
    hs_title = f"hsoffload ({r.policy})"
    lines = [header, f"  {'knobs':<{width}}{'checkpointing only':<{col}}{hs_title:<{col if with_host else 0}}"
                     + (f"host RAM, no spill ({i.host_ram_bytes / _GIB:,.0f} GiB per node)" if with_host else "")]
    for row in r.rows:
        host = f"{row.hsoffload_host_limit:,}" if with_host and row.hsoffload_host_limit else "none fits"
        lines.append(f"  {row.knobs:<{width}}{cell(row, 'checkpointing'):<{col}}"
                     + (f"{cell(row, 'hsoffload'):<{col}}{host}" if with_host else cell(row, "hsoffload")))
    if r.fastest is not None:
        f = r.fastest
        lines.append(f"  fastest at {f.seq_len:,} tokens: {f.knobs}, "
                     f"{'checkpointing only' if f.column == 'checkpointing' else hs_title}: {f.step_time_s:,.2f} s/step "
                     f"({f.tokens_per_s:,.0f} tokens/s per rank, device profile {r.device_profile})")
    stopped = {run.wall.name: run.wall for row in r.rows for run in (row.checkpointing, row.hsoffload) if run.wall}
    for wall in stopped.values():
        lines.append(f"  wall {wall.name}: {wall.sentence()} (source: {wall.source})")
    if not any(row.hsoffload.seq_len for row in r.rows):
        lines.append(f"  the model states alone (weights, gradients, optimizer states: "
                     f"{r.model_states_device_bytes / _GIB:,.1f} GiB per rank) leave no room: shard them over more "
                     "ranks (--world-size), pick a lighter optimizer, or move them to the host (--cpu-offload)")
    elif any(row.knobs.endswith("model states on host") for row in r.rows):
        lines.append(f"  model states on host: weights, gradients and optimizer states in pinned host memory "
                     f"(--cpu-offload params: {r.model_states_host_bytes_per_node / _GIB:,.1f} GiB per node, "
                     "beside what hsoffload offloads; check the host side with --seq-len N)")
    return "\n".join(lines)
