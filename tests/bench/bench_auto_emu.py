"""policy "auto" against every fixed configuration, side by side on the emulated device (issue 39).

The model and the method are hsoffload.tools.bench.policy_auto's (a Qwen3-MoE of 6 layers, every other one dense
with an MLP intermediate of 1,024 and the others MoE of 8 experts of 128, top 2, transformers' eager expert loop;
float32, 512 tokens, AdamW; every configuration on the device at once, stepped in turn; the fastest fixed
configuration picked on a first phase, auto compared with it on a second, paired round by round). Here at three
copy/compute ratios (`hsemu.copy_rate`): a fast link's, where a layer's input copy takes a sixtieth of its forward,
as over a GH200's 450 GB/s; an H100-like one, a sixth; a copy-bound one, 3x its forward. `sac_all` does not run
copy-bound (each of its steps would copy about 100 forwards' worth of bytes: half a minute a step).

Exits 1 when a goal is missed (auto's peak over a budget; its paired median step over 1.03x the fastest fixed
configuration that fits).

    .venv/bin/python tests/bench/bench_auto_emu.py [--json F] [--pick-rounds 15] [--compare-rounds 30]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "device" / "emu"))
import hsemu  # noqa: E402

from hsoffload.offload import auto  # noqa: E402
from hsoffload.tools.bench import policy_auto as bench  # noqa: E402

REGIMES = (("fast link (copy = 1/60 of a layer's forward, as over a GH200's 450 GB/s)", 1 / 60),
           ("H100-like (copy = 1/6 of a layer's forward)", 1 / 6),
           ("copy-bound (copy = 3x forward)", 3.0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--pick-rounds", type=int, default=15, help="every configuration's steps (5 warm)")
    parser.add_argument("--compare-rounds", type=int, default=30, help="auto's and the picked ones' paired steps")
    parser.add_argument("--regimes", default="0,1,2", help="which of the three (indices)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    hsemu.load()
    hsemu.set_copy_delay(0, 0, 0)
    dev = torch.device(hsemu.DEVICE, 0)
    setup = bench.Setup()
    # The layers' forward time, once (every layer offloaded, fast copies): the regimes' copy rates follow it.
    probe = bench.Field(setup, dev, [("auto", 1 << 40)])
    probe.rounds(3)
    costs = auto.controller(probe.runners[0].model).costs
    forward_s = statistics.mean(c.forward_s for c in costs)
    x_bytes = costs[0].held_keep
    del probe, costs
    gc.collect()
    results, found = [], []
    for k in (int(i) for i in args.regimes.split(",")):
        name, ratio = REGIMES[k]
        rate = int(x_bytes / (ratio * forward_s))
        with hsemu.copy_rate(rate, rate, 0):
            result = bench.side_by_side(setup, dev, sac=ratio < 1, pick_rounds=args.pick_rounds,
                                        compare_rounds=args.compare_rounds)
        result.update(regime=name, rate_bytes_per_s=rate)
        results.append(result)
        found += bench.misses(result, name)
        print(bench.report(result, f"\n{name}: copy rate {rate / 1e6:.2f} MB/s (a layer's input {x_bytes / 2**10:.0f} "
                                   f"KiB, its forward {forward_s * 1e3:.1f} ms); picked on {args.pick_rounds} rounds "
                                   f"(5 warm), compared on {args.compare_rounds} (up to 3x where undecided)"),
              flush=True)
    if args.json:
        bench.save(args.json, results, found)
    for m in found:
        print("MISS:", m)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
