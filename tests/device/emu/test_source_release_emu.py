"""Sources let go at copy speed (issue 52, item 4): with a scope around forward only, a pack's source whose copy to
host still runs at the scope's exit goes back to the device allocator as soon as that copy is done -- not at the
next call into the engine or in the scope's destructor. On the emulated device with a slow copy rate."""

from __future__ import annotations

import time

import torch

import hsemu
from hsoffload import OffloadScope
from support.device_model import LinearStack

LAYERS = 4
ROWS, DIM = 512, 256


def _allocated() -> int:
    return hsemu.stats()["allocated_bytes"]


def test_sources_still_copying_at_exit_are_let_go_when_their_copies_finish(dev):
    torch.manual_seed(0)
    model = LinearStack(DIM, LAYERS).to(dev)
    x = torch.randn(ROWS, DIM, device=dev)
    reference = LinearStack(DIM, LAYERS).to(dev)
    reference.load_state_dict(model.state_dict())
    reference(x).backward()
    hsemu.synchronize()

    source_bytes = LAYERS * ROWS * DIM * 4  # every layer's marked input, 512 KiB each
    with hsemu.copy_rate(d2h_bytes_per_s=16 << 20):  # ~30 ms a copy: all of them still run at exit
        before = _allocated()
        with OffloadScope(min_offload_size=0) as scope:
            loss = model(x)
        at_exit = _allocated()
        assert at_exit - before >= source_bytes, "the sources were freed before their copies ran (or never held)"
        # From here on no call into the engine: the copies finish on the emulated device, nothing else happens.
        hsemu.synchronize()
        deadline = time.monotonic() + 2.0
        while _allocated() > at_exit - source_bytes and time.monotonic() < deadline:
            time.sleep(0.001)
        after_copies = _allocated()
    assert after_copies <= at_exit - source_bytes, (
        f"{at_exit - after_copies} of the sources' {source_bytes} bytes went back to the device once their copies "
        "were done; the rest waited for a later call into the engine")

    loss.backward()  # restored from host: the same gradients as without offload
    hsemu.synchronize()
    assert scope.stats.offloaded_tensors == LAYERS and scope.stats.restored_tensors == LAYERS
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad.cpu(), b.grad.cpu())
    del loss
    assert scope.tracked_state() == 0
