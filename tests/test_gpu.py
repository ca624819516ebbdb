"""GPU-only checks: streams, pinned memory, memory actually freed, and race amplification.

Skipped (with a reason) without CUDA; run on a GPU machine by scripts/gpu_check.sh.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import hsoffload
from hsoffload import OffloadScope

pytestmark = pytest.mark.gpu
mark = torch.ops.hsoffload.mark_hidden_state


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(dim, 2 * dim)
        self.fc2 = torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


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
    torch.manual_seed(0)
    layers, dim = 8, 1024
    model = Stack(dim, layers).cuda()
    x = torch.randn(1, 8192, dim, device="cuda", requires_grad=True)
    hidden_bytes = x.numel() * x.element_size()

    def forward_peak(offload: bool) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if offload:
            with OffloadScope(min_offload_size=0):
                loss = model(x)
                torch.cuda.synchronize()
                held = torch.cuda.memory_allocated() - base
                loss.backward()
        else:
            loss = model(x)
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - base
            loss.backward()
        return held

    plain = forward_peak(False)
    offloaded = forward_peak(True)
    # Layer inputs 1..layers-1 are kept by checkpointing without offload (the first is x itself).
    freed = plain - offloaded
    assert freed >= 0.99 * (layers - 1) * hidden_bytes, (plain, offloaded, hidden_bytes)


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


def _cuda_llama_pair(hidden: int, intermediate: int, max_positions: int):
    """Two identical 4-layer Llamas on CUDA (vocab 256). Eager attention: on CUDA, fp32 SDPA runs memory-efficient
    attention, whose backward splits the keys and accumulates dQ with atomics (non-deterministic by default), so two
    runs of the *same* model could differ in the last bit; eager attention (matmul + softmax) is deterministic."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        attn_implementation="eager",
    )
    ref = transformers.LlamaForCausalLM(cfg).cuda().train()
    return ref, copy.deepcopy(ref)


def test_transformers_llama_on_gpu():
    ref, off = _cuda_llama_pair(128, 256, 512)
    for m in (ref, off):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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


@pytest.mark.parametrize("policy", ["sac", "all"])
def test_policies_on_gpu_bitwise_and_free_memory(policy):
    """Policies "sac" (selective checkpointing) and "all" (no checkpointing) with real streams: bitwise equal to the
    same training without offload, and the forward's peak of allocated memory lower than without offload."""
    import hf_tiny

    ref, off = _cuda_llama_pair(256, 512, 2048)
    if policy == "sac":
        for m in (ref, off):
            hf_tiny.enable_sac(m)
    ids = torch.randint(0, 256, (2, 1024), device="cuda")

    def forward_peak(model, ctx):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with ctx:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            loss.backward()
        return loss, peak

    import contextlib

    la, peak_ref = forward_peak(ref, contextlib.nullcontext())
    scope = hsoffload.offload_hidden_states(off, policy=policy, min_offload_size=0)
    lb, peak_off = forward_peak(off, scope)
    torch.cuda.synchronize()
    assert torch.equal(la, lb)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), off.parameters()))
    assert scope.stats.offloaded_tensors > 4 * ref.config.num_hidden_layers, scope.stats
    assert peak_off < peak_ref, (peak_off, peak_ref)
