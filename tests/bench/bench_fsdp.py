"""Benchmark: FSDP RAM-efficient loading, stock transformers vs hsoffload.fsdp, 2 CPU ranks.

    python tests/bench/bench_fsdp.py [--hidden 1536 --layers 16] [--tf53]

Builds a ~0.55B-parameter Llama from a config (saved once under /tmp), then for each transformers
version runs 2 ranks under torchrun (gloo, ACCELERATE_USE_FSDP=1,
FSDP_CPU_RAM_EFFICIENT_LOADING=1). Each rank loads the checkpoint with `from_pretrained` twice in
one process -- stock, then patched -- and measures the load's wall time and its peak RSS above
the RSS before the load (VmHWM reset through /proc/self/clear_refs). Prints per-rank figures and
patched/stock ratios for rank 1 (the non-rank-0 process). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _rss() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


def _rank_main(model_dir: str, out: str) -> None:
    import torch.distributed as dist

    os.environ["ACCELERATE_USE_FSDP"] = "1"
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "1"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    import transformers
    from transformers import LlamaForCausalLM

    import hsoffload.fsdp as hf

    res: dict = {"rank": dist.get_rank(), "transformers": transformers.__version__, "upstream_fix": hf.has_upstream_fix()}
    for label in ("stock", "patched"):
        if label == "patched":
            hf.patch()
        gc.collect()
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _rss()["VmRSS"]
        t0 = time.perf_counter()
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        seconds = time.perf_counter() - t0
        peak = _rss()["VmHWM"] - before
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        zeros = all(float(p.detach().view(-1)[:: max(1, p.numel() // 97)].abs().sum()) == 0 for p in model.parameters())
        res[label] = {"seconds": seconds, "peak_rss_delta": peak, "model_bytes": nbytes, "all_zero": zeros}
        if label == "patched":
            rep = hf.last_report()
            res[label]["report"] = None if rep is None else rep.__dict__
            hf.unpatch()
        del model
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def _checkpoint(hidden: int, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(tempfile.gettempdir()) / f"hsoffload_bench_llama_{hidden}x{layers}"
    if not (path / "config.json").exists():
        cfg = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=hidden * 8 // 3 // 256 * 256 + 256,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 128,
            num_key_value_heads=hidden // 128,
            vocab_size=32000,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _run(model_dir: Path, extra_path: Path | None) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ)
        paths = [str(ROOT / "python_shim")] if not _installed() else []
        if extra_path is not None:
            paths.insert(0, str(extra_path))
        env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env.pop("LOCAL_RANK", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__]
        subprocess.run(cmd + ["--rank-main", str(model_dir), out], env=env, check=True)
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in (0, 1)]


def _installed() -> bool:
    try:
        import hsoffload  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tf53", action="store_true", help="also run transformers 5.3.0 from .deps/tf53")
    ap.add_argument("--rank-main", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_main:
        _rank_main(*a.rank_main)
        return
    model_dir = _checkpoint(a.hidden, a.layers)
    runs = [None] + ([ROOT / ".deps" / "tf53"] if a.tf53 else [])
    mib = 2**20
    for extra in runs:
        r0, r1 = _run(model_dir, extra)
        nbytes = r1["stock"]["model_bytes"]
        print(f"\ntransformers {r1['transformers']} (upstream fix: {r1['upstream_fix']}), model {nbytes / 2**30:.2f} GiB fp32")
        print(f"{'':10}{'rank':>5}{'load s':>9}{'peak RSS MiB':>14}{'% model':>9}{'all zero':>10}")
        for r in (r0, r1):
            for label in ("stock", "patched"):
                x = r[label]
                print(
                    f"{label:10}{r['rank']:>5}{x['seconds']:>9.2f}{x['peak_rss_delta'] / mib:>14.0f}"
                    f"{100 * x['peak_rss_delta'] / nbytes:>8.1f}%{str(x['all_zero']):>10}"
                )
        s, p = r1["stock"], r1["patched"]
        print(
            f"rank 1 patched/stock: load time x{p['seconds'] / s['seconds']:.3f}, "
            f"peak RSS x{p['peak_rss_delta'] / max(1, s['peak_rss_delta']):.3f}; report {p['report']}"
        )


if __name__ == "__main__":
    main()
