"""GPU-only checks: streams, pinned memory, memory actually freed, and race amplification.

Skipped (with a reason) without CUDA; run on a GPU machine by scripts/gpu_check.sh.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import hsoffload
from hsoffload import OffloadScope
from hsoffload.targets import enable_checkpointing
from support.device_model import Block  # the model every device test shares

pytestmark = pytest.mark.gpu
mark = torch.ops.hsoffload.mark_hidden_state
MiB = 1 << 20


def _figure(test: str, **values) -> None:
    """Appends one line of measured figures to $HSOFFLOAD_GPU_FIGURES (scripts/gpu_check.sh points it at its
    summary.txt) as soon as they are measured, so a run cut short still reports what it measured."""
    path = os.environ.get("HSOFFLOAD_GPU_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(f"    figures {test}: {json.dumps(values, default=str)}\n")


@contextlib.contextmanager
def _peak():
    """Device bytes allocated above the level at entry, at its highest inside the block (after a synchronize):
    `torch.cuda.reset_peak_memory_stats` / `max_memory_allocated`. Yields a dict filled in at exit."""
    out: dict = {}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        yield out
    finally:
        torch.cuda.synchronize()
        out["peak"] = torch.cuda.max_memory_allocated() - base


class Stack(torch.nn.Module):
    def __init__(self, dim: int, layers: int, stall_cycles: int = 0) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(layers))
        self.stall_cycles = stall_cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1  # a non-leaf first input, like an embedding output (leaves requiring grad are never offloaded)
        for block in self.blocks:
            if self.stall_cycles:
                torch.cuda._sleep(self.stall_cycles)  # the compute stream lags the host: copies must wait on it
            h = checkpoint(block, mark(h), use_reentrant=False)
        return h.float().pow(2).mean()


def _step(model: Stack, x: torch.Tensor, offload: bool, sentinel: bool = False):
    model.zero_grad(set_to_none=True)
    stats = None
    if offload:
        with OffloadScope(min_offload_size=0) as scope:
            loss = model(x)
            if sentinel:
                # Reuse freed device blocks of the same size with garbage: a missing event wait or
                # record_stream would let this NaN reach a gradient.
                junk = [torch.full_like(x, float("nan")) for _ in range(len(model.blocks) + 2)]
                torch.cuda._sleep(1_000_000)
                del junk
            loss.backward()
        stats = scope.stats
    else:
        loss = model(x)
        loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_identical_on_gpu(dtype):
    torch.manual_seed(0)
    ref = Stack(256, 4).cuda().to(dtype)
    off = copy.deepcopy(ref)
    for _ in range(3):
        x = torch.randn(2, 512, 256, device="cuda", dtype=dtype, requires_grad=True)
        a = _step(ref, x, False)
        b = _step(off, x, True)
        assert torch.equal(a[0], b[0])
        assert all(torch.equal(g1, g2) for g1, g2 in zip(a[1], b[1]))
        s = b[2]
        assert s.offloaded_tensors == 4 and s.restored_tensors == 4
        assert s.offloaded_bytes == 4 * x.numel() * x.element_size()
        assert s.prefetch_hits == 3


def test_race_amplification_with_stalls_and_sentinels():
    torch.manual_seed(0)
    ref = Stack(512, 6).cuda()
    off = copy.deepcopy(ref)
    off.stall_cycles = 2_000_000
    x = torch.randn(4, 1024, 512, device="cuda", requires_grad=True)
    a = _step(ref, x, False)
    for _ in range(3):
        b = _step(off, x, True, sentinel=True)
        assert torch.equal(a[0], b[0])
        assert all(torch.equal(g1, g2) for g1, g2 in zip(a[1], b[1]))
        assert all(not torch.isnan(g).any() for g in b[1])


def test_pack_on_a_non_default_stream():
    torch.manual_seed(0)
    ref = Stack(256, 3).cuda()
    off = copy.deepcopy(ref)
    x = torch.randn(2, 256, 256, device="cuda", requires_grad=True)
    a = _step(ref, x, False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        b = _step(off, x, True)
    torch.cuda.synchronize()
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(g1, g2) for g1, g2 in zip(a[1], b[1]))
    assert b[2].offloaded_tensors == 3 and b[2].restored_tensors == 3  # it engaged on the side stream


def test_device_memory_is_freed_during_forward():
    """Peak allocated device memory (reset_peak_memory_stats / max_memory_allocated), around the forward and around
    the whole step. Without offload the forward ends holding every layer's input (checkpointing keeps them); with it
    only the layer being computed holds one, so the forward's peak is lower by the other layers - 1 inputs. In
    backward offload holds the restored input of the layer being recomputed and the prefetched next one
    (prefetch_depth 1): the step's peak is lower by at least layers - 2 inputs."""
    torch.manual_seed(0)
    layers, dim = 8, 1024
    model = Stack(dim, layers).cuda()
    x = torch.randn(1, 8192, dim, device="cuda", requires_grad=True)
    hidden_bytes = x.numel() * x.element_size()

    def peaks(offload: bool) -> tuple[int, int]:
        model.zero_grad(set_to_none=True)
        x.grad = None
        scope = OffloadScope(min_offload_size=0) if offload else contextlib.nullcontext()
        with scope, _peak() as step:
            with _peak() as forward:
                loss = model(x)
            loss.backward()
            del loss
        return forward["peak"], step["peak"]

    peaks(True)  # warm: the pinned pool's slabs and the allocator's blocks exist before the measured steps
    peaks(False)
    fwd_plain, step_plain = peaks(False)
    fwd_off, step_off = peaks(True)
    _figure("device_memory_freed", hidden_mib=hidden_bytes / MiB, layers=layers,
            forward_peak_mib=[fwd_plain / MiB, fwd_off / MiB], step_peak_mib=[step_plain / MiB, step_off / MiB],
            forward_freed_hidden=(fwd_plain - fwd_off) / hidden_bytes, step_freed_hidden=(step_plain - step_off) / hidden_bytes)
    assert fwd_plain - fwd_off >= 0.99 * (layers - 1) * hidden_bytes, (fwd_plain, fwd_off, hidden_bytes)
    assert step_plain - step_off >= 0.99 * (layers - 2) * hidden_bytes, (step_plain, step_off, hidden_bytes)


def test_pinned_pool_is_reused_across_steps():
    model = Stack(256, 4).cuda()
    x = torch.randn(2, 512, 256, device="cuda", requires_grad=True)
    _step(model, x, True)
    allocations = hsoffload.pool_stats().allocations
    for _ in range(5):
        _step(model, x, True)
    assert hsoffload.pool_stats().allocations == allocations
    assert hsoffload.pool_stats().in_use_bytes == 0


def test_retain_graph_on_gpu():
    torch.manual_seed(0)
    ref = Stack(256, 3).cuda()
    off = copy.deepcopy(ref)
    x = torch.randn(2, 256, 256, device="cuda", requires_grad=True)
    loss = ref(x)
    loss.backward(retain_graph=True)
    loss.backward()
    with OffloadScope(min_offload_size=0) as scope:
        loss2 = off(x)
        loss2.backward(retain_graph=True)
        loss2.backward()
    torch.cuda.synchronize()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), off.parameters()))
    assert scope.stats.offloaded_tensors == 3
    assert scope.stats.restored_tensors == 6  # each backward unpacks every layer input once


def _cuda_llama_pair(hidden: int, intermediate: int, max_positions: int, attn: str = "eager"):
    """Two identical 4-layer Llamas on CUDA (vocab 256). Eager attention for the bitwise comparisons: on CUDA, fp32
    SDPA runs memory-efficient attention, whose backward splits the keys and accumulates dQ with atomics
    (non-deterministic by default), so two runs of the *same* model could differ in the last bit; eager attention
    (matmul + softmax) is deterministic. Memory is measured with SDPA (linear in the length, as the suite runs)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        attn_implementation=attn, use_cache=False,
    )
    ref = transformers.LlamaForCausalLM(cfg).cuda().train()
    return ref, copy.deepcopy(ref)


def test_transformers_llama_on_gpu():
    ref, off = _cuda_llama_pair(128, 256, 512)
    for m in (ref, off):
        enable_checkpointing(m, {"use_reentrant": False})
    ids = torch.randint(0, 256, (2, 256), device="cuda")
    la = ref(input_ids=ids, labels=ids).loss
    la.backward()
    with hsoffload.offload_hidden_states(off, min_offload_size=0) as scope:
        lb = off(input_ids=ids, labels=ids).loss
        lb.backward()
    torch.cuda.synchronize()
    assert torch.equal(la, lb)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), off.parameters()))
    assert scope.stats.offloaded_tensors == 4 and scope.stats.restored_tensors == 4


def test_policy_auto_on_gpu_keeps_the_budget_and_the_gradients():
    """policy auto on CUDA (issue 39): a budget half-way between the leanest choice's peak and no checkpointing's;
    every step's peak under it, the decision mixing choices, gradients bit for bit plain checkpointing's (eager
    attention: deterministic)."""
    from hsoffload.offload import auto

    ref, off = _cuda_llama_pair(1024, 4096, 4096)
    for m in (ref, off):
        enable_checkpointing(m, {"use_reentrant": False})
    ids = torch.randint(0, 256, (1, 2048), device="cuda")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.0)  # lr 0: the weights stay, every step compares alike
    opt_off = torch.optim.SGD(off.parameters(), lr=0.0)

    def peak_of(step) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    def plain(model, flags: bool):
        for layer in model.model.layers:
            layer.gradient_checkpointing = flags
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        for layer in model.model.layers:
            layer.gradient_checkpointing = True

    none_peak = peak_of(lambda: plain(ref, False))
    lean_peak = peak_of(lambda: _lean(off))
    budget = (lean_peak + none_peak) // 2
    peaks, decided = [], None
    for step in range(5):
        ref(input_ids=ids, labels=ids).loss.backward()

        def run():
            with hsoffload.offload_hidden_states(off, policy="auto", device_budget=budget, min_offload_size=0):
                off(input_ids=ids, labels=ids).loss.backward()

        peaks.append(peak_of(run))
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), off.parameters())), step
        for opt in (opt_ref, opt_off):
            opt.step()
            opt.zero_grad(set_to_none=True)
        decided = auto.controller(off).decision
    _figure("policy_auto", budget_mib=budget / MiB, lean_mib=lean_peak / MiB, none_mib=none_peak / MiB,
            peaks_mib=[p / MiB for p in peaks], choices=[str(c) for c in decided.choices],
            predicted_peak_mib=decided.peak_bytes / MiB, predicted_step_ms=decided.step_s * 1e3,
            measured_step_ms=[round(r.measured_step_s * 1e3, 2) for r in auto.controller(off).history],
            reserved_mib=[round((r.measured_reserved_bytes or 0) / MiB, 1) for r in auto.controller(off).history],
            allocator_gap_mib=auto.controller(off).allocator_gap / MiB,
            sac_mib_per_layer=[round(c.sac_bytes / MiB, 1) for c in auto.controller(off).costs],
            prefetch_depth=decided.prefetch_depth, decisions=auto.controller(off).decisions,
            reason=auto.controller(off).reason,
            sac_learned_ms=[round(c.sac_extra_s * 1e3, 2) for c in auto.controller(off).costs])
    assert max(peaks) <= budget, (peaks, budget)
    assert decided is not None and decided.fits and decided.counts()["none"] >= 1


def _lean(model) -> None:
    with hsoffload.offload_hidden_states(model, min_offload_size=0):
        model(input_ids=torch.randint(0, 256, (1, 2048), device="cuda"),
              labels=torch.randint(0, 256, (1, 2048), device="cuda")).loss.backward()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("policy", ["sac", "all"])
def test_policies_on_gpu_bitwise_and_free_memory(policy):
    """Policies "sac" (selective checkpointing) and "all" (no checkpointing) with real streams: bitwise equal to the
    same training without offload (eager attention, see _cuda_llama_pair), and, with SDPA at a longer length, the
    peak of allocated memory lower than without offload, around the forward and around the whole step."""
    from support import hf_tiny

    def setup(pair):
        if policy == "sac":
            for m in pair:
                hf_tiny.enable_sac(m)
        return pair

    def run(model, ids, ctx):
        with ctx, _peak() as step:
            with _peak() as forward:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        return loss.detach(), forward["peak"], step["peak"]

    # Bitwise: eager attention, 1024 tokens within 2048 positions.
    ref, off = setup(_cuda_llama_pair(256, 512, 2048))
    ids = torch.randint(0, 256, (2, 1024), device="cuda")
    la, _, _ = run(ref, ids, contextlib.nullcontext())
    scope = hsoffload.offload_hidden_states(off, policy=policy, min_offload_size=0)
    lb, _, _ = run(off, ids, scope)
    assert torch.equal(la, lb)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), off.parameters()))
    assert scope.stats.offloaded_tensors > 4 * ref.config.num_hidden_layers, scope.stats
    del ref, off, scope
    gc.collect()

    # Memory: SDPA, 4096 tokens within 4096 positions; one warm step each, then the measured one.
    ref, off = setup(_cuda_llama_pair(256, 512, 4096, attn="sdpa"))
    ids = torch.randint(0, 256, (2, 4096), device="cuda")
    peaks = {}
    for name, model in (("plain", ref), ("offload", off)):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            ctx = hsoffload.offload_hidden_states(model, policy=policy, min_offload_size=0) if name == "offload" \
                else contextlib.nullcontext()
            _, fwd, step = run(model, ids, ctx)
        peaks[name] = (fwd, step)
    _figure(f"policy_{policy}_peaks_sdpa_4096", forward_peak_mib=[peaks["plain"][0] / MiB, peaks["offload"][0] / MiB],
            step_peak_mib=[peaks["plain"][1] / MiB, peaks["offload"][1] / MiB])
    assert peaks["offload"][0] < peaks["plain"][0], peaks
    assert peaks["offload"][1] < peaks["plain"][1], peaks


def test_spill_tier_on_gpu_bitwise(tmp_path: Path):
    """The disk tier with real streams: a host budget of a quarter of the hidden states, the rest spilled to files
    in spill_dir and read back (prefetched) in backward, bit for bit, nothing left behind."""
    torch.manual_seed(0)
    layers = 6
    ref = Stack(256, layers).cuda()
    off = copy.deepcopy(ref)
    x = torch.randn(2, 2048, 256, device="cuda", requires_grad=True)
    hidden_bytes = x.numel() * x.element_size()
    a = _step(ref, x, False)
    try:
        for _ in range(2):
            off.zero_grad(set_to_none=True)
            with OffloadScope(min_offload_size=0, max_host_bytes=layers * hidden_bytes // 4,
                              spill_dir=str(tmp_path)) as scope:
                loss = off(x)
                loss.backward()
            torch.cuda.synchronize()
            s = scope.stats
            _figure("spill_on_gpu", spilled_mib=s.spilled_bytes / MiB, offloaded_mib=s.offloaded_bytes / MiB,
                    restored_tensors=s.restored_tensors, spill=scope.spill_stats())
            assert torch.equal(a[0], loss.detach())
            assert all(torch.equal(g, p.grad) for g, p in zip(a[1], off.parameters()))
            assert s.spilled_tensors > 0 and s.spilled_bytes > 0, s
            assert s.spilled_from_device_tensors == 0, s  # host first, then disk
            assert scope.spill_stats()["bytes_read"] > 0, scope.spill_stats()  # some came back from files
            assert s.offloaded_tensors == layers and s.restored_tensors == layers, s
        gc.collect()
        assert list(tmp_path.iterdir()) == []  # anonymous files: never a name on disk
    finally:
        gc.collect()
        hsoffload.set_host_budget("auto")


def test_spill_frees_device_memory_at_copy_speed_while_the_disk_lags(tmp_path: Path, monkeypatch):
    """Spill from host: with every disk write made to take 200 ms, the device holds after forward exactly what it
    holds when the budget has room for everything (the hidden states left at PCIe speed); written from device memory
    (no host room at all), it holds the unwritten ones. Gradients bitwise in all three."""
    monkeypatch.setenv("HSOFFLOAD_TEST_SPILL_WRITE_DELAY_MS", "200")
    torch.manual_seed(0)
    layers = 6
    ref = Stack(256, layers).cuda()
    off = copy.deepcopy(ref)
    x = torch.randn(2, 4096, 256, device="cuda", requires_grad=True)
    state = x.numel() * x.element_size()
    want = _step(ref, x, False)
    held: dict[str, int] = {}
    try:
        for name, budget in (("roomy", 4 * layers * state), ("lagging", 2 * state), ("from_device", 0)):
            d = tmp_path / name  # a store of its own: it reads the delay knob when created
            d.mkdir()
            hsoffload.set_host_budget(budget)
            off.zero_grad(set_to_none=True)
            with OffloadScope(min_offload_size=0, max_host_bytes=budget, spill_dir=str(d)) as scope:
                loss = off(x)
                torch.cuda.synchronize()
                held[name] = torch.cuda.memory_allocated()
                written = scope.spill_stats()["bytes_written"]
                loss.backward()
            torch.cuda.synchronize()
            s = scope.stats
            assert torch.equal(want[0], loss.detach())
            assert all(torch.equal(g, p.grad) for g, p in zip(want[1], off.parameters()))
            if name != "roomy":
                assert written < s.spilled_bytes, (name, written, s)  # the disk lagged behind forward
        _figure("spill_from_host_on_gpu", held_after_forward_mib={k: v / MiB for k, v in held.items()},
                state_mib=state / MiB)
        assert held["lagging"] == held["roomy"], held
        assert held["from_device"] >= held["roomy"] + 2 * state, held
    finally:
        gc.collect()
        hsoffload.set_host_budget("auto")


def test_pack_and_unpack_make_no_host_sync():
    """One offloaded step under torch.cuda.set_sync_debug_mode("error"): any host-device synchronization inside
    forward and backward (packs, copies, unpacks, prefetches) raises. The pinned pool is warm (a step before), as in
    training; the scope is entered and left outside the checked region."""
    torch.manual_seed(0)
    ref = Stack(256, 4).cuda()
    off = copy.deepcopy(ref)
    x = torch.randn(2, 512, 256, device="cuda", requires_grad=True)
    a = _step(ref, x, False)
    _step(off, x, True)  # warm
    off.zero_grad(set_to_none=True)
    with OffloadScope(min_offload_size=0) as scope:
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = off(x)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert scope.stats.offloaded_tensors == 4 and scope.stats.restored_tensors == 4, scope.stats
    assert torch.equal(a[0], loss.detach())
    assert all(torch.equal(g, p.grad) for g, p in zip(a[1], off.parameters()))
