"""GPU checks of the engine's newer rules (skipped without CUDA; tests/conftest.py gives the reason): CUDA graph
capture under an active scope, and `reserve_host` (pinned slabs before the first step).

The same behaviours are proved without a GPU on the emulated device (tests/device/emu/test_capture_emu.py) and on the
CPU (tests/engine/test_capture.py, tests/engine/test_reserve.py); here they meet real CUDA graphs and cudaHostAlloc.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import hsoffload
from hsoffload import OffloadScope
from support.device_model import Block  # the model every device test shares

pytestmark = pytest.mark.gpu
mark = torch.ops.hsoffload.mark_hidden_state


def _layer_step(layer: Block, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A checkpointed layer, forward and backward, as a captured layer runs it (inputs and params' grads out)."""
    h = x * 1  # a non-leaf input, like a hidden state
    out = checkpoint(layer, mark(h), use_reentrant=False, preserve_rng_state=False)
    grads = torch.autograd.grad(out.float().pow(2).sum(), (x, *layer.parameters()))
    return (out.detach(), *grads)


def test_capture_and_replay_a_checkpointed_layer_under_an_active_scope() -> None:
    torch.manual_seed(0)
    layer = Block(256).cuda()
    eager_layer = copy.deepcopy(layer)
    static_x = torch.randn(4, 128, 256, device="cuda", requires_grad=True)
    scope = OffloadScope(min_offload_size=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graph requires
        for _ in range(3):
            with scope:
                _layer_step(layer, static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with scope:
        # An eager forward whose device->host copies are still in flight when the capture begins.
        torch.cuda._sleep(50_000_000)
        pending = checkpoint(layer, mark(static_x * 1), use_reentrant=False, preserve_rng_state=False)
        offloaded_before = scope.stats.offloaded_tensors
        assert offloaded_before > 0
        with torch.cuda.graph(graph):
            static_out = _layer_step(layer, static_x)
        assert scope.stats.offloaded_tensors == offloaded_before  # nothing offloaded inside the capture
        assert scope.stats.captured_passthrough >= 1
        pending.float().sum().backward()  # the eager graph from before the capture still restores
    for _ in range(2):
        with torch.no_grad():
            static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        torch.cuda.synchronize()
        expected = _layer_step(eager_layer, static_x.detach().clone().requires_grad_(True))
        for got, want in zip(static_out, expected):
            assert torch.equal(got, want)


def test_reserve_host_pins_before_the_first_step_and_the_step_pins_nothing() -> None:
    hsoffload.empty_pool()
    need = 4 * 2048 * 1024 * 4  # one float32 hidden state of the layer below
    assert hsoffload.reserve_host(need) >= need  # pinned: an accelerator is available
    before = hsoffload.pool_stats()
    assert before.pinned_bytes >= need
    torch.manual_seed(0)
    layer = Block(1024).cuda()
    x = torch.randn(4, 2048, 1024, device="cuda", requires_grad=True)
    with OffloadScope(min_offload_size=0) as scope:
        h = checkpoint(layer, mark(x * 1), use_reentrant=False)
        h.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    after = hsoffload.pool_stats()
    assert scope.stats.offloaded_tensors >= 1
    assert after.allocations == before.allocations  # the step took reserved slabs and pinned nothing new
    assert hsoffload.budget_stats().host_bytes == after.held_bytes + after.unpooled_bytes
