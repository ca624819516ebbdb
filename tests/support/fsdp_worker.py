"""One rank of the FSDP RAM-efficient loading tests (run under torchrun by tests/loading/test_fsdp.py).

Per rank: load the checkpoint with `from_pretrained` under the FSDP env gate twice -- stock
transformers first, then with `hsoffload.fsdp.patch()` -- counting, independently of hsoffload,
the writes that land in the storages of the model's parameters and persistent buffers while
`_initialize_missing_keys` runs. Then shard the patched model with FSDP2 (`fully_shard` on a CPU
mesh), broadcast rank 0's weights (torch's `set_model_state_dict(broadcast_from_rank0=True)`),
and check checksums, non-persistent buffers and one forward/backward. Writes a JSON per rank.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import hashlib
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


def _model_class() -> type:
    from transformers import LlamaForCausalLM

    class InPlaceInitLlama(LlamaForCausalLM):
        """A model whose `_init_weights` also writes in place, past transformers' guards.

        It reports itself as built-in (`is_custom_code() -> False`): transformers >= 5.4 skips the
        whole `_init_weights` of a *custom-code* module whose tensors are all flagged, but calls it
        for built-in models, so an unguarded write there reaches flagged tensors on non-rank-0.
        """

        def __init__(self, config: Any) -> None:
            if os.environ.get("HSOFFLOAD_TEST_FAIL_RANK") == str(dist.get_rank()):
                raise RuntimeError(f"injected failure on rank {dist.get_rank()} during load")
            super().__init__(config)

        @classmethod
        def is_custom_code(cls) -> bool:
            return False

        def _init_weights(self, module: torch.nn.Module) -> None:
            super()._init_weights(module)
            if isinstance(module, torch.nn.Linear):
                module.weight.data.normal_(mean=0.0, std=0.02)
            elif isinstance(module, torch.nn.Embedding):
                module.weight.data.uniform_(-0.05, 0.05)
            elif module is self:
                # A parent writing a child's weight (value-preserving): the top model's subtree
                # holds the rotary non-persistent buffers, so this call is not skipped as a whole.
                self.lm_head.weight.data.mul_(1.0)

    return InPlaceInitLlama


class _CountWrites(TorchDispatchMode):
    """Counts ops that write into any of the given storages (the test's own, independent count)."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages = storages
        self.writes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                x = args[i] if i < len(args) else kwargs.get(a.name)
                for t in x if isinstance(x, (list, tuple)) else [x]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages:
                        self.writes += 1
        return func(*args, **kwargs)


_counter: list[_CountWrites] = []


def _install_counter() -> None:
    """Wrap whatever `_initialize_missing_keys` is installed (stock or hsoffload's) with a write counter."""
    from transformers import PreTrainedModel

    inner = PreTrainedModel.__dict__["_initialize_missing_keys"]

    def counting(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        storages = set()
        for m in self.modules():
            storages.update(p.untyped_storage().data_ptr() for p in m._parameters.values() if p is not None)
            storages.update(
                b.untyped_storage().data_ptr()
                for n, b in m._buffers.items()
                if b is not None and n not in m._non_persistent_buffers_set
            )
        storages.discard(0)
        mode = _CountWrites(storages)
        _counter.append(mode)
        with mode:
            return inner(self, *args, **kwargs)

    PreTrainedModel._initialize_missing_keys = counting
    _install_counter.restore = lambda: setattr(PreTrainedModel, "_initialize_missing_keys", inner)  # type: ignore[attr-defined]


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _load(path: str, patched: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    from proc_memory import rss_mib  # a sibling module: torchrun puts this folder first on sys.path

    import hsoffload.fsdp as hf

    if patched:
        hf.patch()
    _install_counter()
    try:
        _reset_peak_rss()
        before = rss_mib()["VmRSS"]
        t0 = time.perf_counter()
        model = _model_class().from_pretrained(path, dtype=torch.float32)
        seconds = time.perf_counter() - t0
        peak = rss_mib()["VmHWM"]
    finally:
        _install_counter.restore()  # type: ignore[attr-defined]
        if patched:
            hf.unpatch()
    report = hf.last_report() if patched else None
    info = {
        "writes_on_flagged": _counter[-1].writes,
        "seconds": seconds,
        "peak_rss_delta_mib": peak - before,
        "report": None if report is None else report.__dict__,
        "param_all_zero": all(bool((p == 0).all()) for p in model.parameters()),
    }
    return model, info


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _fsdp2_from_rank0(model: torch.nn.Module) -> torch.nn.Module:
    """Accelerate's RAM-efficient flow, driven directly: meta, fully_shard, broadcast from rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    full_sd = {k: v.clone() for k, v in model.state_dict().items()} if dist.get_rank() == 0 else {}
    non_persistent = {
        f"{mn}.{bn}" if mn else bn: (m, bn, b.clone())
        for mn, m in model.named_modules()
        for bn, b in m._buffers.items()
        if b is not None and bn in m._non_persistent_buffers_set
    }
    model = model.to(torch.device("meta"))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for m, bn, b in non_persistent.values():
        m._buffers[bn] = b
    return model


def _steps(model: torch.nn.Module, batches: list[torch.Tensor], offload: bool) -> tuple[list[float], list[Any]]:
    """AdamW steps on `batches` (the same on every rank); per step the loss and the offload counters."""
    import hsoffload

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, stats = [], []
    for ids in batches:
        if offload:
            with hsoffload.offload_hidden_states(model, offload_cpu_tensors=True, min_offload_size=0) as scope:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            stats.append(scope.stats.__dict__)
        else:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, stats


def _train_with_offload(path: str, vocab: int, steps: int) -> dict[str, Any]:
    """FSDP2 + RAM-efficient loading + hidden-state offload (non-reentrant checkpointing), against the same FSDP2
    model without offload (bitwise: offload only moves bytes) and a single-process model without FSDP (within a
    tolerance: FSDP2 averages gradients in another order). Stock LlamaForCausalLM here: the in-place-init class
    above re-randomises weights on purpose, differently per load."""
    import transformers

    import hsoffload.fsdp as hf
    from hsoffload.targets import enable_checkpointing

    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(3, vocab, (2, 16), generator=g) for _ in range(steps)]  # the same on every rank
    ckpt = {"use_reentrant": False}
    runs: dict[str, list[float]] = {}
    stats: list[Any] = []
    report = None
    for name in ("offload", "fsdp_no_offload"):
        hf.patch()
        try:
            model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
        finally:
            hf.unpatch()
        if name == "offload":
            report = hf.last_report()
        model = _fsdp2_from_rank0(model)
        enable_checkpointing(model, ckpt)
        model.train()
        runs[name], s = _steps(model, batches, offload=name == "offload")
        stats = stats or s
    os.environ["ACCELERATE_USE_FSDP"] = "0"  # a plain single-process load: no FSDP gate
    try:
        single = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    finally:
        os.environ["ACCELERATE_USE_FSDP"] = "1"
    single.train()
    runs["single_process"], _ = _steps(single, batches, offload=False)
    return {
        "losses": runs["offload"],
        "fsdp_no_offload_losses": runs["fsdp_no_offload"],
        "single_process_losses": runs["single_process"],
        "stats": stats,
        "layers": len(single.model.layers),
        "report": report.__dict__ if report is not None else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--skip-stock", action="store_true")
    ap.add_argument("--train-steps", type=int, default=0, help="then train this many steps under hidden-state offload")
    a = ap.parse_args()
    faulthandler.enable()  # a native abort prints every thread's Python stack (see dtensor_worker.py)

    os.environ["ACCELERATE_USE_FSDP"] = "1"
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "1"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)  # different RNG per rank: equal weights can only come from the broadcast

    import transformers
    import hsoffload  # noqa: F401  (loads the op library)
    import hsoffload.fsdp as hf

    result: dict[str, Any] = {"rank": rank, "transformers": transformers.__version__, "upstream_fix": hf.has_upstream_fix()}
    if not a.skip_stock:
        _, result["stock"] = _load(a.model_dir, patched=False)
    model, result["patched"] = _load(a.model_dir, patched=True)

    # Non-persistent buffers must be right on every rank before the broadcast (accelerate copies them).
    ref = transformers.LlamaConfig.from_pretrained(a.model_dir)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    expected = LlamaRotaryEmbedding(ref).inv_freq
    result["inv_freq_ok"] = bool(torch.equal(model.model.rotary_emb.inv_freq, expected))
    result["inv_freq_digest"] = _digest(model.model.rotary_emb.inv_freq)

    model = _fsdp2_from_rank0(model)
    digests = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        digests[name] = _digest(full)
    result["digests"] = digests

    ids = torch.arange(2 * 16).reshape(2, 16) % ref.vocab_size
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    result["loss"] = float(out.loss.detach())
    result["grad_finite"] = all(bool(torch.isfinite(p.grad.full_tensor()).all()) for p in model.parameters())

    if a.train_steps:
        result["train"] = _train_with_offload(a.model_dir, ref.vocab_size, a.train_steps)

    from worker_exit import finish  # a sibling module: torchrun puts this folder first on sys.path

    finish(a.out_dir, rank, result)
    return 0


if __name__ == "__main__":
    from worker_exit import leave  # a sibling module: torchrun puts this folder first on sys.path
    leave(main())  # no interpreter finalization (worker_exit.py)
