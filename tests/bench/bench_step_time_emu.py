"""The step-time model against the emulated device (issue 38): one calibration, then a sweep of copy bandwidths.

The emulated device (tests/device/emu) runs compute on this machine's CPU and queues copies on worker threads that
sleep n / rate for n bytes (`hsemu.set_copy_rate`). The planner's compute rate is calibrated once, from the steps of
checkpointing alone measured beside every point; the bandwidth of each point is the knob's. Every point is predicted by `hsoffload plan` with
those fixed parameters and measured with hidden-state offload, three repeats each (a repeat: the median of three steps; the repeats' spread printed), from
copies a quarter of a layer's forward (hidden) to several times its backward (copy-bound). Exits 1 when a point is
off by more than 15 % or no point has >= 30 % of its step in exposed copies.

    .venv/bin/python tests/bench/bench_step_time_emu.py [--ratios 0.25,0.5,1,2,3,4,6] [--repeats 3] [--json F]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "device" / "emu"))
import hsemu  # noqa: E402

from hsoffload.tools.bench import step_time  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", default="0.25,0.5,1,2,3,4,6",
                        help="copy time per layer over the predicted forward of a layer, one point each")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per repeat (a repeat's figure: their median)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="compute threads (default: all cores but one, which the copy workers get, as a GPU's "
                             "copy engines are not its SMs)")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    hsemu.load()
    hsemu.set_copy_delay(0, 0, 0)  # copy time is the bytes at the rate only
    dev = torch.device(hsemu.DEVICE, 0)
    shape = step_time.Workload.small(seq=args.seq, layers=args.layers)
    layer_bytes = shape.seq * shape.model.hidden * 4  # a layer's input, float32

    # A first calibration only picks each point's rate (copy time per layer over the predicted forward of a layer);
    # the sweep calibrates once more, from checkpointing alone measured beside every point, and predicts with that.
    trainer = step_time.Trainer(shape, dev, hsemu.synchronize)
    trainer.step_s(False, 1)
    tflops = step_time.calibrate_tflops(shape, trainer.step_s(False, args.steps), "math")
    _, _, forward_s = step_time.predict(shape, tflops, 1.0, "math")
    del trainer

    def points():
        for r in (float(x) for x in args.ratios.split(",")):
            rate = int(layer_bytes / (r * forward_s))
            yield (f"copy/forward {r:g}", shape, rate / 1e9, lambda rate=rate: hsemu.copy_rate(rate, rate, 0))

    result = step_time.sweep(points(), dev, hsemu.synchronize, "math", args.repeats, args.steps)
    print(step_time.report(result, f"step-time model vs the emulated device: Llama {shape.model.layers} layers, hidden "
                                   f"{shape.model.hidden}, {shape.seq} tokens, float32, {args.repeats} repeats of "
                                   f"{args.steps} steps per point; {torch.get_num_threads()} compute threads"))
    if args.json:
        step_time.save(result, args.json, device="hsemu")
    misses = step_time.verdict(result)
    for m in misses:
        print("MISS:", m)
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
