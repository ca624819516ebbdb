"""Graph capture on the emulated device: while the current stream captures, the scope neither copies nor allocates
(saved tensors pass through, counted in captured_passthrough), and a capture that starts with copies in flight still
succeeds.

`hsemu.capture()` raises at its end if anything inside did what CUDA forbids during a capture (pinned allocation, a
fork of the capturing stream that is never joined back, queries of captured events, waits on events recorded
outside the capture, syncs). Without the engine's capture guard (M19 in scripts/mutation_check.py) the pack forks the
device->host side stream from the capturing stream and never joins it: these tests fail.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import hsemu
import hsoffload
from hsoffload import OffloadScope
from support.device_model import Block  # the model every device test shares

mark = torch.ops.hsoffload.mark_hidden_state
LAYERS = 3


class Stack(torch.nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1
        for block in self.blocks:
            h = checkpoint(block, mark(h), use_reentrant=False)
        return h.float().pow(2).mean()


def _models(dev: torch.device) -> tuple[Stack, Stack]:
    torch.manual_seed(0)
    ref = Stack().to(dev)
    return ref, copy.deepcopy(ref)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().cpu().clone() for p in model.parameters()]


def _reference(model: Stack, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).backward()
    return _grads(model)


def test_emulated_capture_refuses_what_cuda_refuses(dev: torch.device) -> None:
    # The emulator's own rules: a pinned allocation and an unjoined fork inside a capture fail it.
    with pytest.raises(RuntimeError, match="pinned host allocation"):
        with hsemu.capture():
            torch.empty(1024, dtype=torch.uint8).pin_memory()
    side = hsemu.new_stream()
    with pytest.raises(RuntimeError, match="unjoined fork"):
        with hsemu.capture():
            event = torch.Event(device=dev)
            event.record()
            with hsemu.stream(side):
                event.wait()
    assert not torch.hsemu.is_current_stream_capturing()


def test_capture_passes_marked_tensors_through(dev: torch.device) -> None:
    ref, model = _models(dev)
    x = torch.randn(4, 32, device=dev)
    expected = _reference(ref, x)
    scope = OffloadScope(min_offload_size=0)
    acquires = hsoffload.pool_stats().acquires
    with scope:
        with hsemu.capture():
            assert torch.hsemu.is_current_stream_capturing()
            model(x).backward()
    grads = _grads(model)
    stats = scope.stats
    assert stats.captured_passthrough == LAYERS and stats.offloaded_tensors == 0, stats
    assert hsoffload.pool_stats().acquires == acquires  # no host block asked for, none pinned
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


def test_capture_that_starts_with_copies_in_flight_succeeds(dev: torch.device) -> None:
    ref, model = _models(dev)
    x1, x2 = torch.randn(4, 32, device=dev), torch.randn(4, 32, device=dev)
    expected1, expected2 = _reference(ref, x1), _reference(ref, x2)
    twin = copy.deepcopy(model)
    scope = OffloadScope(min_offload_size=0)
    with hsemu.copy_delay(h2d_us=2000, d2h_us=20000):
        with scope:
            loss1 = model(x1)  # its device->host copies are still queued when the capture begins
            assert scope.stats.offloaded_tensors == LAYERS
            with hsemu.capture():
                twin(x2).backward()
            loss1.backward()
    assert scope.stats.captured_passthrough == LAYERS
    assert scope.stats.restored_tensors == LAYERS
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), expected1))
    assert all(torch.equal(a, b) for a, b in zip(_grads(twin), expected2))


def test_unpack_of_a_host_copy_inside_a_capture_raises(dev: torch.device) -> None:
    if not bool(torch.classes.hsoffload.OffloadScope.engine_detects_capture()):
        pytest.skip("this torch (< 2.13) has no device-generic capture query: unpack cannot tell it is captured")
    _, model = _models(dev)
    x = torch.randn(4, 32, device=dev)
    scope = OffloadScope(min_offload_size=0)
    with scope:
        loss = model(x)
        with pytest.raises(RuntimeError, match="offload_unpack: this tensor was offloaded to host memory before the "
                           "graph capture"):
            with hsemu.capture():
                loss.backward()
    hsemu.synchronize()
