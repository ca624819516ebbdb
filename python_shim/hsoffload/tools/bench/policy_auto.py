"""`policy="auto"` against every fixed configuration, side by side on one device (issue 39).

A model whose best answer mixes choices across layers: a Qwen3-MoE whose every other layer is dense and the others
MoE (transformers' eager expert loop), AdamW. The fixed configurations: checkpointing alone, offload of every layer
(hidden_states), selective checkpointing of every layer with its projections' outputs offloaded (`sac_all`: the
`context_fn` of auto's sac choice), every `keep_last_layers` from 1 to L-1, no checkpointing. At 4 budgets between
the leanest configuration's peak and the peak without checkpointing, and 2 above it (1.02x and 1.6x: where no
checkpointing fits, auto must not checkpoint), `policy="auto", device_budget=B` against the fastest fixed
configuration whose peak fits B; auto's peak as a share of B (what of the budget it used).

The runners (a model, its optimizer and batch each) stay on the device side by side: one for the fixed
configurations and one per budget for auto; a step's peak is the device's less the other runners' bytes (each
runner's parameters and optimizer states, made at creation). Every round steps them in a new order, so that a shared
machine's slow spells fall on all of them alike. Two phases:

1. **pick** (`pick_rounds`, the first `warm` not counted: auto calibrates and decides there): every fixed
   configuration one step **on one model** (`Field.pick`, `as_config`: two models of one configuration measured up
   to 5 % apart here, their memory placed differently, so a pick over separate models would rank the models too),
   and every auto runner its own; their peaks, and per budget the fastest fixed configuration that fits (median
   step);
2. **compare** (`compare_rounds` per budget, fresh samples: a pick and a comparison on the same samples would hold
   auto to the minimum of many noisy medians, below any one configuration's own): per budget, auto's runner alone,
   each round one step of auto and one of the picked configuration **on auto's own model** (`as_config`; every
   configuration's gradients are plain checkpointing's, so the model goes where it would anyway),
   adjacent in time and in alternating order; the median over rounds of auto's step over the picked one's in the
   same round, with a distribution-free 90 % interval of that median (rounds taken as independent). Where the
   interval holds the goal (these rounds cannot tell it met from missed), rounds are added, a third at a time, up
   to 3x, once every budget has had its own (`compare`): one rule on both sides of the goal; the verdict is the
   median's.

Goals (issue 39): auto's peak under the budget over every step, calibration included; auto's paired median step
within GOAL (3 %) of the fastest fixed configuration that fits, or faster.

The emulated device's regimes (copy rates) are tests/bench/bench_auto_emu.py; on a CUDA GPU (`make gpu-check`) the
link is the machine's: `python -m hsoffload.tools.bench.policy_auto`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import logging
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from ...offload import auto
from ...offload.auto import DeviceMemory
from ...targets import LAYER_ATTR, enable_checkpointing, unwrap_marking

logger = logging.getLogger("hsoffload")

GOAL = 0.03  # auto's step at most 3 % over the fastest fixed configuration that fits (paired median)
BUDGET_FRACTIONS = (0.15, 0.4, 0.65, 0.9)  # of the way from the leanest peak to no checkpointing's
ABOVE_NONE = (1.02, 1.6)  # and these times no checkpointing's peak (what a budget above it buys: no checkpointing)


@dataclasses.dataclass(frozen=True)
class Setup:
    layers: int = 6
    hidden: int = 64
    intermediate: int = 1024  # the dense layers' MLP
    experts: int = 8
    moe_intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    seq: int = 512
    vocab: int = 512
    dtype: str = "float32"

    def fixed_names(self, sac: bool = True) -> list[str]:
        return (["checkpointing", "offload_all"] + (["sac_all"] if sac else [])
                + [f"keep_last_layers={k}" for k in range(1, self.layers)] + ["none"])


def make_model(setup: Setup, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import transformers  # noqa: PLC0415  (the benchmark only)

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=setup.vocab, hidden_size=setup.hidden, intermediate_size=setup.intermediate,
        num_hidden_layers=setup.layers, num_attention_heads=setup.heads, num_key_value_heads=setup.kv_heads,
        head_dim=setup.hidden // setup.heads, num_experts=setup.experts, num_experts_per_tok=2,
        moe_intermediate_size=setup.moe_intermediate, mlp_only_layers=list(range(0, setup.layers, 2)),
        max_position_embeddings=max(2048, setup.seq), tie_word_embeddings=False)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    dtype = getattr(torch, setup.dtype)
    if device.type == "cuda":  # made on the GPU (a CPU init of 17 models would take most of gpu-check's minute)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype)
    model.train()
    enable_checkpointing(model, {"use_reentrant": False})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


@contextlib.contextmanager
def as_config(model: torch.nn.Module, config: str) -> Iterator[None]:
    """`model` (made by `make_model`: every layer checkpointed) as `config` for one step: `none` turns its layers'
    checkpointing off, `sac_all` gives their checkpoints auto's selective context (`auto.SAC_CONTEXT`, as its `sac`
    choice does); both put back after. The others need no change of the layers (auto's scope restores its own)."""
    layers = list(model.model.layers)
    flags = [layer.gradient_checkpointing for layer in layers]
    funcs = [layer.__dict__[LAYER_ATTR] for layer in layers]  # transformers sets it on each layer
    try:
        for layer, func in zip(layers, funcs):
            if config == "none":
                layer.gradient_checkpointing = False
            elif config == "sac_all":
                plain = unwrap_marking(func)
                assert isinstance(plain, functools.partial), "make_model's layers use torch's checkpoint"
                layer.__dict__[LAYER_ATTR] = functools.partial(
                    plain.func, *plain.args, **{**plain.keywords, "context_fn": auto.SAC_CONTEXT})
        yield
    finally:
        for layer, flag, func in zip(layers, flags, funcs):
            layer.gradient_checkpointing = flag
            if config == "sac_all":
                layer.__dict__[LAYER_ATTR] = func


class Runner:
    """One configuration's model, optimizer and batch, kept on the device beside the others'. Its optimizer states
    are made at creation (a step on zero gradients), so every runner's persistent bytes are fixed from the start and
    a step's own peak is the device's peak less the other runners' bytes."""

    def __init__(self, setup: Setup, device: torch.device, memory: DeviceMemory, config: str,
                 budget: Optional[int] = None) -> None:
        self.config, self.budget, self.memory = config, budget, memory
        self.model, self.opt = make_model(setup, device)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, setup.vocab, (1, setup.seq), generator=gen).to(device)
        self.others = 0  # the other runners' persistent bytes: set once every runner exists
        self.peaks: list[int] = []
        self.times: list[float] = []  # one per round this runner stepped in

    def own_bytes(self) -> int:
        """The device bytes this runner keeps between steps (parameters, buffers, batch, AdamW's moments and step),
        each a block of the allocator (rounded up to 512 bytes, as CUDA's and the emulated device's)."""
        tensors = list(self.model.parameters()) + list(self.model.buffers()) + [self.ids] + [
            t for st in self.opt.state.values() for t in st.values()
            if isinstance(t, torch.Tensor) and t.device.type != "cpu"]
        return sum(-(-t.untyped_storage().nbytes() // 512) * 512 for t in tensors)

    def step(self, round_index: int) -> None:
        """One step of this runner's own configuration, its time and peak recorded (`round_index`, the field's
        round, is for runners that keep it: the comparison pairs by round itself, `Field.with_guest`)."""
        elapsed, peak = self.run(self.config)
        self.times.append(elapsed)
        self.peaks.append(peak)

    def run(self, config: str) -> tuple[float, int]:
        """One step of this runner's model as `config` (its own, or a guest's: `as_config`): its time and peak.
        Every configuration's gradients are plain checkpointing's (bit for bit where the kernels are deterministic),
        so a guest's step leaves the model where its own would."""
        import hsoffload  # noqa: PLC0415  (the package's own entry point)

        self.memory.synchronize()
        self.memory.reset_peak()
        t0 = time.perf_counter()
        with as_config(self.model, config):
            if config in ("checkpointing", "none"):
                self.model(input_ids=self.ids, labels=self.ids).loss.backward()
            else:  # sac_all too: its policy's MUST_CPU_OFFLOAD goes through the scope, with the inputs
                kwargs: dict[str, Any] = {"min_offload_size": 0}
                if config == "auto":
                    assert self.budget is not None
                    kwargs.update(policy="auto", device_budget=self.budget + self.others)
                elif config.startswith("keep_last_layers="):
                    kwargs["keep_last_layers"] = int(config.split("=")[1])
                with hsoffload.offload_hidden_states(self.model, **kwargs):
                    self.model(input_ids=self.ids, labels=self.ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.memory.synchronize()
        return time.perf_counter() - t0, int(self.memory.peak() or 0) - self.others

    def choices(self) -> str:
        ctl = auto.controller(self.model)
        return "".join(str(c)[0] for c in ctl.decision.choices) if ctl and ctl.decision else "?"

    def decisions(self) -> list[str]:
        """Every decision auto made, in order, with why (a learned sac cost shows here)."""
        ctl = auto.controller(self.model)
        return list(ctl.decision_log) if ctl else []


class Field:
    """Runners side by side on one device, stepped in turn."""

    def __init__(self, setup: Setup, device: torch.device, configs: list[tuple[str, Optional[int]]]) -> None:
        self.memory = DeviceMemory(device)
        self.runners = [Runner(setup, device, self.memory, c, b) for c, b in configs]
        self.memory.synchronize()
        total = int(self.memory.allocated() or 0)
        owns = [r.own_bytes() for r in self.runners]
        if abs(sum(owns) - total) > 0.01 * total:
            raise RuntimeError(f"policy_auto bench: the runners' own bytes ({sum(owns)}) are not what the device "
                               f"holds ({total}): a step's peak could not be told from the others'")
        for r, own in zip(self.runners, owns):
            r.others = total - own
        self._order = random.Random(0)
        self._round = 0

    def rounds(self, n: int, runners: Optional[list[Runner]] = None,
               deadline: Optional[float] = None) -> int:
        """`n` rounds of `runners` (default: all), a new order every round; stops early past `deadline`
        (time.monotonic()). Returns the rounds run."""
        runners = runners or self.runners
        for k in range(n):
            if deadline is not None and time.monotonic() > deadline:
                return k
            for r in self._order.sample(runners, len(runners)):  # no runner always follows another
                r.step(self._round)
            self._round += 1
        return n

    def pick(self, host: Runner, configs: list[str], n: int,
             deadline: Optional[float] = None) -> dict[str, list[tuple[float, int]]]:
        """`n` rounds: each of `configs` one step on host's model (`Runner.run`: one model for all, so that a
        configuration is not ranked by its model's own speed), every other runner its own step, in a new order every
        round; stops early past `deadline`. Returns each configuration's (step time, peak) per round."""
        samples: dict[str, list[tuple[float, int]]] = {c: [] for c in configs}
        steps: list[tuple[Optional[Runner], str]] = [(None, c) for c in configs]
        steps += [(r, r.config) for r in self.runners if r is not host]
        for _ in range(n):
            if deadline is not None and time.monotonic() > deadline:
                break
            for runner, config in self._order.sample(steps, len(steps)):  # no step always follows another
                if runner is None:
                    samples[config].append(host.run(config))
                else:
                    runner.step(self._round)
            self._round += 1
        return samples

    def with_guest(self, a: Runner, config: str, n: int, deadline: Optional[float] = None) -> list[tuple[float, float]]:
        """`n` rounds of a's own step and one of `config` on a's model (`Runner.run`), adjacent in time (a slow
        spell falls on both), in alternating order (neither always runs after the other), on the same parameters,
        optimizer states and allocations (a model's own speed, its memory's placement, falls on both too). Returns
        the (own, guest) step times per round."""
        out = []
        for _ in range(n):
            if deadline is not None and time.monotonic() > deadline:
                break
            if self._round % 2 == 0:  # by the field's round: batches of any size keep alternating
                a.step(self._round)
                guest, _ = a.run(config)
            else:
                guest, _ = a.run(config)
                a.step(self._round)
            out.append((a.times[-1], guest))
            self._round += 1
        return out


def median_interval(sorted_values: list[float], z: float = 1.645) -> tuple[float, float]:
    """A distribution-free interval of the median (90 % at z=1.645): the order statistics n/2 -+ z sqrt(n)/2."""
    n = len(sorted_values)
    if n == 0:
        return float("nan"), float("nan")
    half = z * math.sqrt(n) / 2
    lo = max(0, int(math.floor(n / 2 - half)))
    hi = min(n - 1, int(math.ceil(n / 2 + half)) - 1)
    return sorted_values[lo], sorted_values[max(lo, hi)]


def undecided(pairs: list[tuple[float, float]]) -> bool:
    """Whether the median ratio's 90 % interval holds the goal: lo <= 1 + GOAL < hi (these rounds cannot tell the
    goal met from missed)."""
    lo, hi = median_interval(sorted(x / y for x, y in pairs))
    return bool(pairs) and lo <= 1 + GOAL < hi


def compare(field: Field, jobs: list[tuple[Runner, str]], rounds: int, most: int,
            deadline: Optional[float] = None) -> list[list[tuple[float, float]]]:
    """Per job (auto's runner, the picked configuration), auto's steps and the configuration's on auto's model
    (`Field.with_guest`): `rounds` for every job first (a time limit then cuts added rounds, not a budget's own),
    then more, a third of `rounds` at a time up to `most`, for the jobs still `undecided`. Returns each job's
    (auto, configuration) step times per round."""
    pairs = [field.with_guest(a, config, min(rounds, most), deadline) for a, config in jobs]
    while True:
        todo = [i for i, p in enumerate(pairs) if len(p) < most and undecided(p)]
        if not todo or (deadline is not None and time.monotonic() > deadline):
            return pairs
        for i in todo:
            a, config = jobs[i]
            pairs[i] += field.with_guest(a, config, min(max(1, rounds // 3), most - len(pairs[i])), deadline)


def side_by_side(setup: Setup, device: torch.device, *, sac: bool = True, pick_rounds: int = 15, warm: int = 5,
                 compare_rounds: int = 30, most_compare_rounds: Optional[int] = None, deadline: Optional[float] = None,
                 fractions: tuple[float, ...] = BUDGET_FRACTIONS,
                 above: tuple[float, ...] = ABOVE_NONE) -> dict[str, Any]:
    """One regime: the fixed configurations' peaks, auto at 6 budgets, the pick and the paired comparison
    (`compare`: `compare_rounds`, up to `most_compare_rounds`, 3x by default, where those cannot decide)."""
    names = setup.fixed_names(sac)
    # The peaks first (deterministic): the budgets lie between the leanest configuration's and no checkpointing's.
    probe = Field(setup, device, [(n, None) for n in ("offload_all", "none")])
    probe.rounds(2)
    lean, none = (max(r.peaks) for r in probe.runners)
    del probe
    gc.collect()
    budgets = [int(lean + f * (none - lean)) for f in fractions] + [int(none * f) for f in above]
    field = Field(setup, device, [("checkpointing", None)] + [("auto", b) for b in budgets])
    host, autos = field.runners[0], field.runners[1:]
    samples = field.pick(host, names, pick_rounds, deadline=deadline)
    picked_rounds = min(len(s) for s in samples.values())
    picked = {n: {"peak": max(p for _, p in s), "step_s": statistics.median([t for t, _ in s[warm:] or s])}
              for n, s in samples.items() if s}  # the pick's own samples
    rows = []
    for a in autos:
        assert a.budget is not None
        timed = {n: x["step_s"] for n, x in picked.items() if x["peak"] <= a.budget}
        rows.append({"budget": a.budget, "auto": a, "best": min(timed, key=timed.__getitem__) if timed else None})
    jobs = [(row["auto"], row["best"]) for row in rows if row["best"] is not None]
    compared = iter(compare(field, jobs, compare_rounds, most_compare_rounds or 3 * compare_rounds, deadline))
    out_rows = []
    for row in rows:
        a, b = row["auto"], row["best"]
        pairs = next(compared) if b is not None else []
        ratios = sorted(x / y for x, y in pairs)
        lo, hi = median_interval(ratios)
        out_rows.append({
            "budget": row["budget"], "choices": a.choices(), "decisions": a.decisions(), "auto_peak": max(a.peaks),
            "auto_share": max(a.peaks) / row["budget"],
            "auto_step_s": statistics.median([x for x, _ in pairs] or [math.nan]),
            "best": b, "best_peak": picked[b]["peak"] if b else None,
            "best_step_s": statistics.median([y for _, y in pairs]) if pairs else None,
            "ratio": statistics.median(ratios) if ratios else math.nan, "ratio_90": (lo, hi), "pairs": len(ratios)})
    return {"fixed": picked,
            "rows": out_rows, "pick_rounds": picked_rounds, "lean_peak": lean, "none_peak": none}


def misses(result: dict[str, Any], name: str) -> list[str]:
    out = []
    for row in result["rows"]:
        if row["auto_peak"] > row["budget"]:
            out.append(f"{name}, budget {row['budget']}: auto's peak {row['auto_peak']} over it")
        if row["best"] is not None and row["pairs"] and not row["ratio"] <= 1 + GOAL:  # none: `report` says so
            out.append(f"{name}, budget {row['budget']}: auto {row['ratio']:.3f}x {row['best']} (paired median "
                       f"over {row['pairs']} rounds)")
    return out


def report(result: dict[str, Any], title: str) -> str:
    lines = [title,
             "  fixed (pick phase): " + "; ".join(f"{n} {x['peak'] / 2**20:.1f} MiB {x['step_s'] * 1e3:.1f} ms"
                                     for n, x in result["fixed"].items()),
             f"  {'budget':>10} {'auto choices':>13} {'auto peak':>10} {'of budget':>9} {'auto step':>10} "
             f"{'fastest fixed that fits':>24} {'its step':>9} {'auto/it (paired median, 90% interval)':>38}"]
    for r in result["rows"]:
        lo, hi = r["ratio_90"]
        lines.append(
            f"  {r['budget'] / 2**20:7.1f} MiB {r['choices']:>13} {r['auto_peak'] / 2**20:6.1f} MiB "
            f"{r['auto_peak'] / r['budget']:8.1%} "
            f"{r['auto_step_s'] * 1e3:7.1f} ms {str(r['best']):>24} {(r['best_step_s'] or math.nan) * 1e3:6.1f} ms "
            f"{r['ratio']:>12.3f} [{lo:.3f}, {hi:.3f}] over {r['pairs']} rounds")
    for r in result["rows"]:
        if len(r["decisions"]) > 1:
            lines.append(f"  at {r['budget'] / 2**20:.1f} MiB auto decided {len(r['decisions'])} times: "
                         + "; ".join(r["decisions"]))
        if r["best"] is not None and not r["pairs"]:
            lines.append(f"  at {r['budget'] / 2**20:.1f} MiB not compared with {r['best']}: the time limit came first")
    return "\n".join(lines)


def save(path: str, results: list[dict[str, Any]], found: list[str], **meta: Any) -> None:
    Path(path).write_text(json.dumps({**meta, "results": results, "misses": found}, indent=1, default=str))


def gpu_main(argv: Optional[list[str]] = None, clock: Callable[[], float] = time.monotonic) -> int:
    """On a CUDA GPU (`python -m hsoffload.tools.bench.policy_auto`): the machine's own link, bf16."""
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser(description="policy auto against every fixed configuration on a CUDA GPU")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--pick-rounds", type=int, default=12)
    parser.add_argument("--compare-rounds", type=int, default=30)
    parser.add_argument("--time-limit", type=float, default=90.0, help="seconds; rounds stop past it")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not torch.cuda.is_available():
        print("policy auto side by side: no CUDA device; nothing to measure (the emulated device's regimes are "
              "tests/bench/bench_auto_emu.py)")
        return 0
    deadline = clock() + args.time_limit
    setup = Setup(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
                  moe_intermediate=args.moe_intermediate, heads=max(1, args.hidden // 128),
                  kv_heads=max(1, args.hidden // 512), seq=args.seq, vocab=32000, dtype="bfloat16")
    result = side_by_side(setup, torch.device("cuda"), pick_rounds=args.pick_rounds,
                          compare_rounds=args.compare_rounds, deadline=deadline)
    name = torch.cuda.get_device_name(0)
    print(report(result, f"policy auto side by side on {name}: {setup}"))
    found = misses(result, name)
    if args.json:
        save(args.json, [result], found, device=name)
    for m in found:
        print("MISS:", m)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(gpu_main())
