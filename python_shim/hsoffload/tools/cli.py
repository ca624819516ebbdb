"""The `hsoffload` command: `hsoffload demo`, `hsoffload bench` and `hsoffload plan`.

Tables and the progress bar are the command's output (stdout and stderr); library messages go
through `logging.getLogger("hsoffload")`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from ..planning import settings as plan_settings

logger = logging.getLogger("hsoffload")


def _int_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        scale = 1
        if part.endswith("k"):
            scale, part = 1024, part[:-1]
        out.append(int(part) * scale)
    if not out:
        raise argparse.ArgumentTypeError("expected a comma-separated list such as 8k,32k,128k")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsoffload",
        description="Hidden-state offload for gradient-checkpointed training: demo and benchmarks.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log hsoffload messages at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a tiny Llama with and without offload; show it is bit-identical")
    demo.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    demo.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    demo.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    demo.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    demo.add_argument("--seq", type=int, default=256, help="sequence length (default 256)")
    demo.add_argument("--plot", default="hsoffload_demo.png", help="PNG to write (default hsoffload_demo.png); '' for none")
    demo.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    demo.add_argument("--threads", type=int, default=1, help="CPU threads for torch on a CPU device (default 1: a tiny model gains nothing from more, and a busy machine makes OpenMP spin)")

    bench = sub.add_parser("bench", help="benchmarks: CPU suite, and the GPU suite when CUDA is present")
    bench.add_argument(
        "--suite",
        choices=("auto", "cpu", "gpu", "disk", "all"),
        default="auto",
        help="auto (default): cpu, plus gpu when CUDA is available; disk: the spill tier against the file system; "
        "all: cpu, disk and gpu, failing if no GPU",
    )
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke runs)")
    bench.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    bench.add_argument("--plot", default=None, metavar="PNG", help="write a plot (GPU suite: PNG; CPU suite: PNG with -cpu suffix when both run)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--trace", default=None, metavar="FILE", help="also profile one offloaded step (tiny Llama on a CPU; 8B-wide layers at --trace-seq on a GPU) and write its Chrome/Perfetto trace to FILE, and FILE.png: a timeline of copies against compute")
    bench.add_argument("--trace-seq", type=int, default=None, help="sequence length of the traced step (default 256 on a CPU, 8192 on a GPU)")
    bench.add_argument("--threads", type=int, default=1, help="CPU threads for torch in the CPU suite (default 1, for stable timings on a shared machine)")
    d = bench.add_argument_group("disk suite (spill tier)")
    d.add_argument("--spill-dir", default=None, help="directory the disk suite spills to (default: a temporary directory under $HSOFFLOAD_SPILL_DIR or /tmp)")
    d.add_argument("--spill-mib", type=int, default=512, help="MiB the disk suite writes and reads back (default 512)")
    g = bench.add_argument_group("GPU suite (Llama-3-8B layer dimensions, bf16, batch 1)")
    g.add_argument("--layers", type=int, default=8, help="decoder layers (default 8; Llama-3-8B has 32)")
    g.add_argument("--seqs", type=_int_list, default=[8192, 32768, 131072], help="sequence lengths (default 8k,32k,128k)")
    g.add_argument("--steps", type=int, default=3, help="timed steps per method and length (median; default 3)")
    g.add_argument("--warmup", type=int, default=1, help="warm-up steps per method and length (default 1)")
    g.add_argument("--methods", default=None, help="comma-separated subset of: checkpointing,hsoffload,trl,save_on_cpu,transformers_offload,axolotl")
    g.add_argument("--budget-gib", type=float, default=40.0, help="device memory budget (GiB) for the longest-sequence search: predicted from the peaks at the first two lengths, verified with one step under that cap (default 40)")
    g.add_argument("--fit-layers", type=int, default=None, help="layers for the longest-sequence search (default: --layers)")
    g.add_argument("--profile-seq", type=int, default=None, help="length of the profiled step used for copy bandwidth (default: 32k or the longest that ran)")
    g.add_argument("--time-limit", type=float, default=420.0, help="seconds after which the GPU suite stops starting new measurements (default 420)")

    pl = sub.add_parser("plan", help="before launch: a run's device peak and host/spill bytes, from a config.json alone")
    pl.add_argument("--input", default=None, metavar="FILE", help="a JSON or YAML file of hsoffload.plan.PlanInput's fields (config relative to the file); flags given beside it override it")
    pl.add_argument("--axolotl", default=None, metavar="YAML", help="an Axolotl config: read through the table's Axolotl keys (base_model, a local config.json or model folder, unless CONFIG is given); the keys not read are listed; flags given beside it override it")
    pl.add_argument("--trainer-args", default=None, metavar="JSON", help="transformers TrainingArguments as JSON (training_args.to_json_string()); read over --axolotl; flags override it")
    pl.add_argument("--emit", choices=("axolotl",), default=None, help="axolotl: print the fastest combination that fits (the --max-seq table's pick, at --seq-len when given) as Axolotl keys to merge into the config")
    pl.add_argument("--max-seq", action="store_true", help="instead: the longest sequence that fits the device, as one table (checkpointing only vs hsoffload, per knob combination)")
    # One flag per setting of the planner's table (hsoffload.planning.settings): its type, default and help.
    plan_settings.add_flags(pl, plan_settings.SETTINGS)
    pl.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


class UsageError(ValueError):
    """A command-line argument that cannot work; reported as one line, exit status 2, before any work."""


def _at_least(args: argparse.Namespace, name: str, low: float, why: str = "") -> None:
    value = getattr(args, name)
    if value is not None and value < low:
        raise UsageError(f"--{name.replace('_', '-')} must be >= {low}{why}, got {value}")


def _writable(option: str, path: Optional[str]) -> None:
    """The file `path` can be created or replaced (checked before hours of work, not after)."""
    if not path:
        return
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise UsageError(f"{option} {path}: is a directory; give a file name")
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"{option} {path}: not writable")


def _device(spec: Optional[str]) -> None:
    if spec is None:
        return
    import torch

    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"--device {spec}: not a torch device ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {spec}: this torch has no usable CUDA device (torch.cuda.is_available() is False)")
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"--device {spec}: cannot allocate a tensor there ({first})") from None


def validate(args: argparse.Namespace) -> None:
    """Raises UsageError naming the first argument that cannot work."""
    if args.command == "plan":
        if args.config is None and args.input is None and args.axolotl is None:
            raise UsageError("a config.json (or --input FILE, or --axolotl YAML) is required")
        files = (args.input, args.axolotl, args.trainer_args)
        if args.seq_len is None and not args.max_seq and all(f is None for f in files):
            raise UsageError("--seq-len is required (or --max-seq)")
        return  # each setting's value is checked once, by PlanInput (hsoffload.planning.settings)
    if args.command == "demo":
        for name in ("steps", "layers", "batch"):
            _at_least(args, name, 1)
        # The loss of a causal LM shifts labels by one: one token leaves nothing to predict (a NaN loss).
        _at_least(args, "seq", 2, " (a causal LM predicts token i+1 from token i)")
        _at_least(args, "threads", 0)
        _device(args.device)
        _writable("--plot", args.plot)
        _writable("--json", args.json)
    else:
        for name in ("layers", "steps"):
            _at_least(args, name, 1)
        _at_least(args, "warmup", 0)
        _at_least(args, "threads", 0)
        if args.fit_layers is not None:
            _at_least(args, "fit_layers", 1)
        if args.profile_seq is not None:
            _at_least(args, "profile_seq", 2)
        if args.budget_gib <= 0:
            raise UsageError(f"--budget-gib must be > 0, got {args.budget_gib}")
        if args.time_limit <= 0:
            raise UsageError(f"--time-limit must be > 0 seconds, got {args.time_limit}")
        if any(s < 2 for s in args.seqs):
            raise UsageError(f"--seqs: every length must be >= 2, got {','.join(map(str, args.seqs))}")
        _writable("--json", args.json)
        _writable("--plot", args.plot)
        _at_least(args, "spill_mib", 1)
        _writable("--trace", args.trace)
        if args.trace_seq is not None:
            _at_least(args, "trace_seq", 2)
        if args.spill_dir is not None and not os.path.isdir(args.spill_dir):
            raise UsageError(f"--spill-dir {args.spill_dir!r} is not a directory")


def _plan_flags_given(argv: Sequence[str]) -> set[str]:
    """The dests of the `plan` flags written on the command line (argv parsed again with every default suppressed:
    a flag given with its default value counts as given)."""
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices["plan"]  # noqa: SLF001  (argparse keeps subparsers there)
    for action in sub._actions:  # noqa: SLF001
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(list(argv)))) - {"command", "verbose"}


def plan_input(args: argparse.Namespace, argv: Sequence[str], not_read: Optional[dict[str, list[str]]] = None) -> Any:
    """The one typed input of `hsoffload plan` from its flags (one per setting of the planner's table); with --input
    and the user's files (--axolotl, --trainer-args, --deepspeed-config: hsoffload.planning.user_files), their
    fields, later over earlier, overridden by the flags written beside them. `not_read` receives each file's keys the
    planner did not read."""
    from ..planning import user_files
    from ..planning.shapes import PlanInput

    table = plan_settings.SETTINGS
    values = plan_settings.input_values(args, table)
    files = user_files.read_files(args.axolotl, args.trainer_args, args.deepspeed_config, args.config)
    if not_read is not None:
        not_read.update(files.not_read)
    if args.input is None and not files.values and not files.unmodelled:
        return PlanInput(**{**values, "seq_len": args.seq_len if args.seq_len is not None else 1})
    given = _plan_flags_given(argv)
    dests = plan_settings.flag_dests(table)
    overrides = {name: value for name, value in values.items() if dests[name] in given}
    defaults = {"seq_len": 1} if args.max_seq else {}  # --max-seq searches the length: the file need not give one
    read = {**files.input_values(), **overrides}
    if read.get("tiled_mlp") == 0:  # `tiled_mlp: true` without a count: ALST's, from the model's hidden size
        from ..planning import plan

        config = read.get("config") or (PlanInput.from_file(args.input, defaults).config if args.input else None)
        read["tiled_mlp"] = user_files.auto_tiles(read, plan.model_shape(config).hidden if config else 1)
    if args.input is None:
        where = args.axolotl or args.trainer_args or args.deepspeed_config
        return PlanInput.from_mapping({**defaults, **read}, where=where)
    return dataclasses.replace(PlanInput.from_file(args.input, defaults), **read)


def _plan(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import json

    from ..planning import plan

    not_read: dict[str, list[str]] = {}
    try:
        inp = plan_input(args, argv, not_read)
    except ValueError as exc:
        print(str(exc).splitlines()[0], file=sys.stderr)
        return 2
    try:
        if args.emit:
            from ..planning import emit

            result = plan.max_seq(inp, target=args.seq_len if args.max_seq else inp.seq_len)
            text = emit.axolotl_yaml(result)
        elif args.max_seq:
            result = plan.max_seq(inp, target=args.seq_len)
            text = plan.format_max_seq(result)
        else:
            result = plan.plan(inp)
            text = plan.format_plan(result)
    except ValueError as exc:
        print(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**result.to_json(), **({"not_read": not_read} if not_read else {})}))
        return 0
    # Every key of the user's files the planner did not read, named (never silently ignored).
    heading = [f"{where}: not read: {', '.join(keys)}" for where, keys in not_read.items() if keys]
    print("\n".join((["# " + line for line in heading] if args.emit else heading) + [text]))
    return 0


def _demo(args: argparse.Namespace) -> int:
    import torch

    from . import demo
    from . import workloads as common

    device = torch.device(args.device) if args.device else None
    if (device or common.default_device()).type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    result = demo.run_demo(
        device=device, steps=args.steps, layers=args.layers, batch=args.batch, seq=args.seq, plot=args.plot or None
    )
    print(demo.format_result(result))
    if args.json:
        import dataclasses

        payload = dataclasses.asdict(result)
        payload["environment"] = common.environment()
        common.write_json(args.json, payload)
    return 0 if result.all_equal else 1


def _bench(args: argparse.Namespace) -> int:
    import torch

    from . import workloads as common

    started = time.monotonic()
    has_cuda = torch.cuda.is_available()
    suites = {
        "auto": ["cpu"] + (["gpu"] if has_cuda else []),
        "cpu": ["cpu"],
        "gpu": ["gpu"],
        "disk": ["disk"],
        "all": ["cpu", "disk", "gpu"],
    }[args.suite]
    if "gpu" in suites and not has_cuda:
        print("hsoffload bench: the GPU suite needs CUDA, and torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    if args.suite == "auto" and not has_cuda:
        print("hsoffload bench: no CUDA device; running the CPU suite only", file=sys.stderr)
    results: dict[str, Any] = {"environment": common.environment()}
    status = 0
    if "cpu" in suites:
        from .bench import cpu

        if args.threads > 0:
            torch.set_num_threads(args.threads)
        res = cpu.run(quick=args.quick, progress_enabled=not args.no_progress)
        results["cpu"] = res
        print(cpu.report(res))
        if args.plot:
            path = args.plot if suites == ["cpu"] else _suffixed(args.plot, "-cpu")
            cpu_plot = cpu.plot(res, path)
            if cpu_plot:
                print(f"plot: {cpu_plot}")
    if "disk" in suites:
        from .bench import disk

        res = disk.run(spill_dir=args.spill_dir, mib=args.spill_mib, quick=args.quick)
        results["disk"] = res
        print(disk.report(res))
    if "gpu" in suites:
        from .bench import gpu

        res = gpu.run(args, progress_enabled=not args.no_progress)
        results["gpu"] = res
        print(gpu.report(res))
        if args.plot:
            gpu_plot = gpu.plot(res, args.plot)
            if gpu_plot:
                print(f"plot: {gpu_plot}")
        if res.get("errors"):
            status = 1
    if args.trace and "gpu" in suites and time.monotonic() - started > args.time_limit:
        # The GPU suite keeps gpu.TRACE_RESERVE_S of --time-limit for the trace; past the limit, no new work starts.
        results["trace"] = {"status": "skipped: time limit"}
        print(f"trace: skipped (--time-limit {args.time_limit:.0f} s reached)")
    elif args.trace:
        from .bench import trace

        device = torch.device("cuda") if "gpu" in suites else torch.device("cpu")
        seq = args.trace_seq or (8192 if device.type == "cuda" else 256)
        res = trace.run(args.trace, device=device, seq=seq)
        results["trace"] = res
        print(f"trace: {args.trace} (ranges: {', '.join(res['ranges'])})")
        png = trace.plot(args.trace, args.trace + ".png", title=f"one step, {res['layers']} layers, seq {seq}, {device}")
        if png:
            print(f"timeline: {png}")
    if args.json:
        common.write_json(args.json, results)
        print(f"json: {args.json}")
    return status


def _suffixed(path: str, suffix: str) -> str:
    stem, dot, ext = path.rpartition(".")
    return f"{stem}{suffix}.{ext}" if dot else path + suffix


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        validate(args)
    except UsageError as exc:
        print(f"hsoffload {args.command}: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:
        logger.setLevel(logging.DEBUG)
    if args.command == "demo":
        return _demo(args)
    if args.command == "plan":
        return _plan(args, argv)
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
