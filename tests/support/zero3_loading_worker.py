"""One rank of the ZeRO-3 RAM-efficient loading check (tests/loading/test_zero3_loading.py; issue 28 item 5).

Loads a Llama under ZeRO-3 (an `HfDeepSpeedConfig` alive, `DS_ACCELERATOR=cpu`, gloo) several times in one process,
in the order `--plan` gives (`from_config:patched,from_config:stock,...`): `from_config` (zero.Init, then
transformers' gathered `initialize_weights_zero3`) or `from_pretrained` of a 4-shard safetensors checkpoint, each
stock or with `hsoffload.zero3_loading.patch()`. Per load and rank: peak RSS above the level just before the call
(VmHWM reset through /proc/self/clear_refs), wall and CPU time of the load and of `initialize_weights_zero3`, bytes
this rank received through full-size broadcasts / all-gathers (an independent counter around torch.distributed), the
patch's counters, a digest of every full parameter and buffer, and one forward loss through a DeepSpeed engine.

Failing loads (kinds `mismatch`, `mismatch_ignored`, `rank0_read_error`, patched only, run after the others in the
same process): a checkpoint whose MLP shapes do not fit the model's config (without and with
`ignore_mismatched_sizes=True`), and a failure on rank 0 only -- rank 0 loads a copy of the checkpoint with one
shard truncated (as a node-local copy can be), rank 1 the intact one, so only rank 0's read raises; and
`rank0_init_error`: `from_config` whose model's `_init_weights` raises on rank 0 only, inside the gathered
`initialize_weights_zero3` (with `--verify`: the verification's gather must still run on every rank); and
`verify_detects` (with `--verify`): rank 1 flips one byte of the partition of CORRUPTED it received (the module's
test hook), which `verify=True` must report on every rank. Per rank: the exception's type and text, and the seconds
from the call to the raise.

`--verify` patches with `patch(verify=True)` (every partition's checksum compared with rank 0's slice).

RSS only means something for the first load of a process: a later load reuses memory an earlier one freed (glibc
keeps it) without raising the peak. The measurement command in docs/usage.md runs one load per launch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import faulthandler
import functools
import gc
import hashlib
import json
import logging
import os
import shutil
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
from proc_memory import rss_mib
from worker_exit import finish, leave

DS_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "steps_per_print": 10**9,
    "wall_clock_breakdown": False,
}


DTYPE = torch.float32  # --bf16: torch.bfloat16
VERIFY = False  # --verify
FAILING = ("mismatch", "mismatch_ignored", "rank0_read_error", "rank0_init_error", "verify_detects",
           "receiver_capped_init", "receiver_capped_gathered", "rank0_own_slice_fails", "rank1_missing_index", "rank1_missing_config")
FAILURE_WAIT_S = 15.0  # patch(failure_wait_s=...): far below the collectives' timeout (120 s)
CORRUPTED = "model.layers.1.self_attn.q_proj.weight"  # verify_detects: rank 1 flips one byte of its partition


def model_config(size: str) -> Any:
    from hf_tiny import tiny_config

    if size == "small":  # ~6 MiB: the test's size
        config = tiny_config("llama", 4)
        config.hidden_size, config.intermediate_size, config.vocab_size = 256, 768, 2048
        config.num_attention_heads, config.num_key_value_heads = 4, 2
    elif size == "odd":  # hidden 255 (head_dim 64): the norms and embeddings have an odd number of elements, so the
        # last partition of 2 ranks is padded and rank 1 receives those through a scratch buffer
        config = tiny_config("llama", 2)
        config.hidden_size, config.intermediate_size, config.vocab_size = 255, 512, 1023
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 64
    else:  # ~107 MiB (8 layers, hidden 512, vocab 8192): the measured size
        config = tiny_config("llama", 8)
        config.hidden_size, config.intermediate_size, config.vocab_size = 512, 1536, 8192
        config.num_attention_heads, config.num_key_value_heads = 8, 4
    return config


class CommBytes:
    """Bytes this rank receives through full-size collectives (broadcast, all-gather) while installed: counted
    around torch.distributed's functions, which DeepSpeed's torch backend calls by attribute at each call."""

    NAMES = ("broadcast", "all_gather_into_tensor", "_all_gather_base", "all_gather")

    def __init__(self) -> None:
        self.bytes = 0
        self._saved: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> "CommBytes":
        for name in self.NAMES:
            original = getattr(dist, name)
            self._saved[name] = original
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            t = args[0] if args else kwargs.get("tensor", kwargs.get("output_tensor", kwargs.get("tensor_list")))
            tensors = t if isinstance(t, (list, tuple)) else [t]
            if name != "broadcast" or (kwargs.get("src", args[1] if len(args) > 1 else 0) != dist.get_rank()):
                self.bytes += sum(x.numel() * x.element_size() for x in tensors if isinstance(x, torch.Tensor))
            return original(*args, **kwargs)

        return counted


class InitTimer:
    """Wall and CPU seconds this rank spends in transformers' `initialize_weights_zero3` (outermost wrapper)."""

    def __init__(self) -> None:
        import transformers.integrations.deepspeed as m

        self._m = m
        self.wall = self.cpu = 0.0

    def __enter__(self) -> "InitTimer":
        self._original = self._m.initialize_weights_zero3

        @functools.wraps(self._original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            w, c = time.perf_counter(), time.process_time()
            try:
                return self._original(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - w
                self.cpu += time.process_time() - c

        self._m.initialize_weights_zero3 = timed
        return self

    def __exit__(self, *exc: Any) -> None:
        self._m.initialize_weights_zero3 = self._original


class ScratchCap:
    """A capacity cap on the buffers hsoffload's loading collectives allocate (`zero3._scratch`, the module that
    allocates them: zero.Init swaps torch's own factories in and out, so those cannot be patched): once `cap` bytes
    are used, this call and every later one fail, as an exhausted device or host would. `armed` False lets calls
    through uncounted until `arm()`."""

    def __init__(self, z3: Any, cap: int, armed: bool = True) -> None:
        self._z3, self.cap, self.armed = z3, cap, armed
        self.used = 0
        self.failed_at: int = -1  # the call that failed first (counted from arming)
        self.calls = 0
        self._original = z3._scratch

    def __enter__(self) -> "ScratchCap":
        self._z3._scratch = self
        return self

    def __exit__(self, *exc: Any) -> None:
        self._z3._scratch = self._original

    def arm(self) -> None:
        self.armed = True

    def __call__(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if not self.armed:
            return self._original(numel, dtype, device)
        self.calls += 1
        nbytes = numel * dtype.itemsize
        if self.failed_at >= 0 or self.used + nbytes > self.cap:
            self.failed_at = self.calls if self.failed_at < 0 else self.failed_at
            raise RuntimeError(f"scratch buffer of {nbytes} bytes refused: this rank's capacity of {self.cap} bytes "
                               "is used up (a cap injected by the test)")
        self.used += nbytes
        return self._original(numel, dtype, device)


def digest(model: torch.nn.Module) -> str:
    """sha256 over every full parameter (gathered with DeepSpeed's own GatheredParameters) and buffer."""
    import deepspeed

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            h.update(name.encode() + p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for name, b in model.named_buffers():
        h.update(name.encode() + b.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def forward_loss(model: torch.nn.Module, vocab: int) -> float:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=DS_CONFIG)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (1, 16), generator=g)
    with torch.no_grad():
        loss = engine(input_ids=ids, labels=ids).loss
    out = float(loss.item())
    engine.destroy()
    return out


def load_only(kind: str, config: Any, path: str) -> torch.nn.Module:
    import transformers

    if kind == "from_config":
        return transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPE)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE)


def load(kind: str, patched: bool, config: Any, path: str) -> dict[str, Any]:
    import transformers

    import hsoffload.zero3_loading as z3

    if patched:
        z3.patch(verify=VERIFY)
    else:
        z3.unpatch()
    z3.reset_stats()
    gc.collect()
    dist.barrier()
    torch.manual_seed(1234)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss_mib()["VmRSS"]
    wall, cpu = time.perf_counter(), time.process_time()
    with CommBytes() as comm, InitTimer() as init:
        model = load_only(kind, config, path)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rss = rss_mib()
    model_bytes = sum(int(p.ds_numel) * p.element_size() for p in model.parameters())
    partition_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    result = {
        "kind": kind,
        "patched": patched,
        "rank": dist.get_rank(),
        "peak_rss_delta_mib": rss["VmHWM"] - before,
        "rss_after_delta_mib": rss["VmRSS"] - before,
        "load_wall_s": wall,
        "load_cpu_s": cpu,
        "init_wall_s": init.wall,
        "init_cpu_s": init.cpu,
        "full_collective_bytes": comm.bytes,
        "model_bytes": model_bytes,
        "partition_bytes": partition_bytes,
        "params": sum(1 for _ in model.parameters()),
        "stats": dataclasses.asdict(z3.stats()),
    }
    z3.unpatch()
    result["digest"] = digest(model)
    result["loss"] = forward_loss(model, config.vocab_size)
    del model
    gc.collect()
    return result


def truncated_copy(path: str, out_dir: str) -> str:
    """A copy of the checkpoint at `path` whose last shard lost its last 64 bytes (rank 0 only reads it)."""
    bad = os.path.join(out_dir, "checkpoint-truncated")
    if not os.path.isdir(bad):
        shutil.copytree(path, bad)
        shard = sorted(f for f in os.listdir(bad) if f.endswith(".safetensors"))[-1]
        with open(os.path.join(bad, shard), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(bad, shard)) - 64)
    return bad


def without_file(path: str, out_dir: str, name: str) -> str:
    """A copy of the checkpoint at `path` without its file `name`: rank 1's node-local copy, incomplete, on which
    transformers fails before the model exists (resolving the shards without their index; reading the config)."""
    bad = os.path.join(out_dir, f"checkpoint-without-{name}")
    if not os.path.isdir(bad):
        shutil.copytree(path, bad)
        os.remove(os.path.join(bad, name))
    return bad


class ArmInInit:
    """Arms a ScratchCap when transformers' initialize_weights_zero3 starts (zero.Init's scatters are done then)."""

    def __init__(self, cap: Any) -> None:
        self._cap = cap

    def __enter__(self) -> "ArmInInit":
        if self._cap is None:
            return self
        import transformers.integrations.deepspeed as m

        self._m, self._original = m, m.initialize_weights_zero3
        cap = self._cap

        @functools.wraps(self._original)
        def armed(*args: Any, **kwargs: Any) -> Any:
            cap.arm()
            return self._original(*args, **kwargs)

        m.initialize_weights_zero3 = armed
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._cap is not None:
            self._m.initialize_weights_zero3 = self._original


def load_failing(kind: str, config: Any, path: str, out_dir: str) -> dict[str, Any]:
    """One patched from_pretrained that must fail on every rank (or, `mismatch_ignored`, load on every rank)."""
    import copy

    import transformers

    import hsoffload.zero3_loading as z3

    z3.patch(verify=VERIFY, failure_wait_s=FAILURE_WAIT_S)
    z3.reset_stats()
    gc.collect()
    rank = dist.get_rank()
    kwargs: dict[str, Any] = {}
    load_path = path
    cap: Any = contextlib.nullcontext()
    arm_in_init = False
    if kind in ("receiver_capped_init", "receiver_capped_gathered"):
        config = model_config("odd")  # padded last partitions: rank 1 receives those through scratch buffers
        if rank == 1:  # zero.Init: the embedding's padded slice fits (522 kB), then every allocation fails
            cap = ScratchCap(z3, 600_000 if kind == "receiver_capped_init" else 0,
                             armed=kind == "receiver_capped_init")
            arm_in_init = kind == "receiver_capped_gathered"  # from the gathered initialize_weights_zero3 on
    elif kind == "rank0_own_slice_fails" and rank == 0:
        # the small model has no padded partition: rank 0's only scratch buffers are its own slices (then, with
        # --verify, the checksums'), so the first allocation refused is an own slice, inside the gathered init
        cap = ScratchCap(z3, 0, armed=False)
        arm_in_init = True
    elif kind == "rank1_missing_index" and rank == 1:
        load_path = without_file(path, out_dir, "model.safetensors.index.json")
    elif kind == "rank1_missing_config" and rank == 1:
        load_path = without_file(path, out_dir, "config.json")
    if kind in ("mismatch", "mismatch_ignored"):
        bad = copy.deepcopy(config)
        bad.intermediate_size = config.intermediate_size // 2  # every layer's gate/up/down_proj differs
        kwargs["config"] = bad
        kwargs["ignore_mismatched_sizes"] = kind == "mismatch_ignored"
    elif kind == "rank0_read_error" and rank == 0:
        load_path = truncated_copy(path, out_dir)
    elif kind == "rank0_init_error" and rank == 0:
        # The user's model code failing on rank 0 alone, inside the gathered init (a fault injected in the model's
        # own _init_weights, not in transformers or DeepSpeed).
        def failing_init(self: Any, module: torch.nn.Module) -> None:
            raise RuntimeError("rank 0's _init_weights failed (injected by the test)")

        previous_init = transformers.LlamaForCausalLM.__dict__.get("_init_weights")  # usually inherited: None
        transformers.LlamaForCausalLM._init_weights = failing_init
    elif kind == "verify_detects" and rank == 1:
        def flip(label: str, partition: torch.Tensor) -> None:
            if label.startswith(CORRUPTED + " "):
                partition.view(torch.uint8)[0] ^= 1

        z3._TEST_HOOKS["after_receive"] = flip
    dist.barrier()
    t0 = time.perf_counter()
    model = None
    raised = None
    try:
        with cap, ArmInInit(cap if arm_in_init else None):
            if kind in ("rank0_init_error", "receiver_capped_init", "receiver_capped_gathered",
                        "rank0_own_slice_fails"):
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPE)
            else:
                model = transformers.AutoModelForCausalLM.from_pretrained(load_path, dtype=DTYPE, **kwargs)
    except Exception as e:  # what the test asserts: the same error on every rank
        raised = {"type": type(e).__name__, "message": str(e)}
    finally:
        if kind == "rank0_init_error" and rank == 0:
            if previous_init is None:
                del transformers.LlamaForCausalLM._init_weights
            else:
                transformers.LlamaForCausalLM._init_weights = previous_init
    seconds = time.perf_counter() - t0
    z3._TEST_HOOKS["after_receive"] = None
    result: dict[str, Any] = {"kind": kind, "patched": True, "rank": rank, "raised": raised, "seconds": seconds,
                              "stats": dataclasses.asdict(z3.stats())}
    if isinstance(cap, ScratchCap):
        result["cap"] = {"calls": cap.calls, "failed_at": cap.failed_at, "used": cap.used}
    z3.unpatch()
    if model is not None:
        result["params"] = sum(1 for _ in model.parameters())
        result["digest"] = digest(model)
        result["loss"] = forward_loss(model, model.config.vocab_size)
        del model
    gc.collect()
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True)
    p.add_argument("--plan", default="from_config:patched,from_config:stock")
    p.add_argument("--size", default="small", choices=("small", "measured"))
    p.add_argument("--checkpoint-dir", default="")
    p.add_argument("--bf16", action="store_true", help="DeepSpeed bf16 and the model loaded in bf16")
    p.add_argument("--verify", action="store_true", help="patch(verify=True): compare every partition's checksum")
    p.add_argument("--warmup", action="store_true",
                   help="load a tiny model both ways first (imports, DeepSpeed and transformers set-up), so "
                        "the first measured load's RSS is the model's and not the code's")
    a = p.parse_args()
    global DTYPE, VERIFY
    VERIFY = a.verify
    if a.bf16:
        DS_CONFIG["bf16"] = {"enabled": True}
        DTYPE = torch.bfloat16
    faulthandler.enable()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    logging.basicConfig(level=logging.WARNING)
    import deepspeed
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    config = model_config(a.size)
    steps = [tuple(s.split(":")) for s in a.plan.split(",") if s]
    path = a.checkpoint_dir or os.path.join(a.out_dir, f"checkpoint-{a.size}")
    if any(kind != "from_config" for kind, _ in steps) and rank == 0 and not os.path.isdir(path):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(
            path, max_shard_size="30MB" if a.size == "measured" else "2MB")
    tiny_path = os.path.join(a.out_dir, "checkpoint-warmup")
    if a.warmup and rank == 0:
        from hf_tiny import tiny_config

        transformers.AutoModelForCausalLM.from_config(tiny_config("llama", 2)).save_pretrained(tiny_path)
    dist.barrier()
    keep = HfDeepSpeedConfig(DS_CONFIG)  # noqa: F841 -- ZeRO-3 is on while it lives
    if a.warmup:
        from hf_tiny import tiny_config

        for mode in ("from_config", "from_pretrained"):
            _ = load_only(mode, tiny_config("llama", 2), tiny_path)
        gc.collect()
    results: list[dict[str, Any]] = []
    rc = 0
    for kind, variant in steps:
        try:
            if kind in FAILING:
                results.append(load_failing(kind, config, path, a.out_dir))
            else:
                results.append(load(kind, variant == "patched", config, path))
        except Exception:  # recorded; the test fails on it with the traceback
            results.append({"kind": kind, "patched": variant == "patched", "error": traceback.format_exc()})
            rc = 1
            break
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k not in ("digest", "stats")}), flush=True)
    finish(a.out_dir, rank, results, indent=1)
    leave(rc)


if __name__ == "__main__":
    main()
