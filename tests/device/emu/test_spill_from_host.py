"""The spill tier writes host copies, not device memory (docs/design.md, "Host budget and spill tier").

A pack copies device -> host at copy speed; the I/O threads write the oldest host copies to disk and give their host
memory back. So a spilled tensor's device memory is freed when its device->host copy completes, whatever the disk
does. These tests make the disk lag ($HSOFFLOAD_TEST_SPILL_WRITE_DELAY_MS: every write sleeps first) and read the
emulated device's allocator counter.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import hsemu
import hsoffload
from hsoffload import OffloadScope
from support.device_model import LinearStack  # the checkpointed stack the device tests share
from support.waits import until

DIM, ROWS, LAYERS = 128, 512, 6
STATE = ROWS * DIM * 4  # bytes of one layer's input (float32): 256 KiB
WRITE_DELAY_MS = 150  # each spill write: far slower than the emulated copies (0.3 ms)


@pytest.fixture(autouse=True)
def _budget_back_to_auto():
    yield
    gc.collect()
    hsoffload.set_host_budget("auto")


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().cpu().clone() for p in model.parameters()]


def _step(model: LinearStack, x: torch.Tensor, scope: OffloadScope | None) -> dict:
    """One forward and backward; what the device held after forward (copies landed, disk still busy)."""
    model.zero_grad(set_to_none=True)
    if scope is None:
        loss = model(x)
        loss.backward()
        return {"grads": _grads(model)}
    with scope:
        loss = model(x)
        hsemu.synchronize()  # every device->host copy has landed; spill writes may still be running
        # The engine lets go of a copied source at the next pack (or unpack) that finds its copy done: one more save.
        probe = torch.ones(1, device=x.device, requires_grad=True)
        _ = probe * probe
        held = hsemu.stats()["allocated_bytes"]
        written = scope.spill_stats()["bytes_written"]
        loss.backward()
    return {"grads": _grads(model), "held": held, "written_after_forward": written, "stats": scope.stats}


@pytest.fixture
def setup(dev, monkeypatch, tmp_path: Path):
    monkeypatch.setenv("HSOFFLOAD_TEST_SPILL_WRITE_DELAY_MS", str(WRITE_DELAY_MS))
    torch.manual_seed(3)
    model = LinearStack(DIM, LAYERS).to(dev)
    x = torch.randn(ROWS, DIM).to(dev)
    reference = _step(model, x, None)["grads"]
    counter = iter(range(100))

    def scope(**kwargs) -> OffloadScope:
        d = tmp_path / f"spill{next(counter)}"  # a directory of its own: a new store reads the delay knob
        d.mkdir()
        return OffloadScope(min_offload_size=0, spill_dir=str(d), **kwargs)

    return model, x, reference, scope


def test_device_memory_is_freed_at_copy_speed_while_the_disk_lags(setup):
    model, x, reference, scope = setup
    # No spill: the budget holds every layer. What the device holds after forward without any hidden state.
    roomy = _step(model, x, scope(max_host_bytes=LAYERS * STATE * 2))
    assert roomy["stats"].spilled_tensors == 0
    # A budget of two layers and a disk 500x slower than the copies: every layer still leaves the device at copy
    # speed (host first, then disk), so the device holds exactly what it holds without spill.
    hsoffload.set_host_budget(2 * STATE)
    unpooled = hsoffload.pool_stats().unpooled
    lagging = _step(model, x, scope(max_host_bytes=2 * STATE))
    s = lagging["stats"]
    assert hsoffload.pool_stats().unpooled == unpooled  # host copies came from the pool's slabs
    assert s.offloaded_tensors == LAYERS and s.spilled_tensors >= LAYERS - 2, s
    assert s.spilled_from_device_tensors == 0 and s.kept_on_device_tensors == 0, s
    # The disk lagged: packs outran it and waited for room. (Whether its last write is still running when forward
    # ends depends on how the I/O threads and forward's tail interleave: under load the writes catch up, and a fifth
    # copy may or may not be spilled; it was asserted here and flaked on a loaded CI machine.)
    assert s.pack_wait_ns > 0 and s.wait_ns >= s.pack_wait_ns, s
    assert lagging["written_after_forward"] <= s.spilled_bytes, s
    assert lagging["held"] == roomy["held"], (lagging["held"], roomy["held"])
    assert hsoffload.budget_stats().peak <= 2 * STATE  # never more host memory than the budget
    # The same lagging disk written from device memory (no host room at all, the path for copies larger than the
    # budget): the device keeps the unwritten tensors. The counter tells the two apart.
    direct = _step(model, x, scope(max_host_bytes=0))
    d = direct["stats"]
    assert d.spilled_from_device_tensors == LAYERS and direct["written_after_forward"] < d.spilled_bytes, d
    assert direct["held"] >= roomy["held"] + 2 * STATE, (direct["held"], roomy["held"])
    print(f"\ndevice bytes held after forward (emulated device, {LAYERS} layers of {STATE >> 10} KiB, writes "
          f"{WRITE_DELAY_MS} ms each): no spill {roomy['held']}, spill from host {lagging['held']} (written by then "
          f"{lagging['written_after_forward']} of {s.spilled_bytes}, packs waited {s.pack_wait_ns / 1e6:.0f} ms), "
          f"spill from device {direct['held']} (written {direct['written_after_forward']} of {d.spilled_bytes})")
    for got in (roomy, lagging, direct):
        assert all(torch.equal(g, r) for g, r in zip(got["grads"], reference))


def test_keep_on_device_when_the_user_will_not_wait(setup):
    model, x, reference, scope = setup
    hsoffload.set_host_budget(2 * STATE)
    got = _step(model, x, scope(max_host_bytes=2 * STATE, spill_wait_ms=0))
    s = got["stats"]
    assert s.kept_on_device_tensors > 0 and s.pack_wait_ns == 0, s  # no room at once: stays where it is
    assert s.offloaded_tensors + s.kept_on_device_tensors == LAYERS and s.spilled_from_device_tensors == 0, s
    assert all(torch.equal(g, r) for g, r in zip(got["grads"], reference))


def test_a_bounded_wait_then_keep_on_device(setup):
    model, x, reference, scope = setup
    hsoffload.set_host_budget(2 * STATE)
    got = _step(model, x, scope(max_host_bytes=2 * STATE, spill_wait_ms=5))  # far shorter than one write
    s = got["stats"]
    assert s.kept_on_device_tensors > 0 and s.pack_wait_ns > 0, s
    assert all(torch.equal(g, r) for g, r in zip(got["grads"], reference))
    gc.collect()
    # A write running when the graph went holds its copy until it ends.
    until(lambda: hsoffload.budget_stats().in_flight == 0, hsoffload.budget_stats, timeout=10)


def test_spill_staging_is_in_the_one_pinned_account(dev, tmp_path: Path):
    """The spill tier's staging chunks are pinned here (an accelerator is present): they count in the pool's account
    (pool_stats, the pool's limit) and in budget_stats().host_bytes, and leave it with their store."""
    before = hsoffload.pool_stats()
    d = tmp_path / "staging"
    d.mkdir()
    scope = OffloadScope(min_offload_size=0, spill_dir=str(d))
    with scope:
        staging = scope.spill_stats()["staging_bytes"]
        pool = hsoffload.pool_stats()
        assert staging > 0 and pool.staging_bytes - before.staging_bytes == staging, (staging, pool)
        assert pool.pinned_bytes - before.pinned_bytes == staging, (staging, pool)
        assert hsoffload.budget_stats().host_bytes == pool.held_bytes + pool.unpooled_bytes + pool.staging_bytes
    del scope
    gc.collect()
    after = hsoffload.pool_stats()
    assert after.staging_bytes == before.staging_bytes and after.pinned_bytes == before.pinned_bytes, after
