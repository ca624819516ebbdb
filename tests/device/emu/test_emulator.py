"""The emulated device itself keeps the promises the offload tests rely on.

If the emulator were synchronous or forgiving, the offload race tests could not fail; each test here shows one
asynchronous behaviour is real: copies return before they run, streams are unordered without events, events order
them, freed memory is poisoned and reused at once unless record_stream says otherwise, compute waits for its stream.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import hsemu

DELAY = 100_000  # us: so long that the host certainly looks before a delayed copy has run, even on a loaded machine


def _poisoned(t: torch.Tensor) -> bool:
    return bool(torch.isnan(t).all())


def test_device_is_registered(dev):
    x = torch.arange(6.0).to(dev)
    assert x.device.type == "hsemu"
    assert torch.equal((x * 2).cpu(), torch.arange(6.0) * 2)
    assert torch.empty(4).pin_memory().is_pinned()
    assert not torch.empty(4).is_pinned()


def test_non_blocking_copy_to_pinned_host_returns_before_it_ran(dev):
    src = torch.ones(1024, device=dev)
    host = torch.zeros(1024).pin_memory()
    with hsemu.copy_delay(d2h_us=DELAY):
        host.copy_(src, non_blocking=True)
        early = host.clone()  # a CPU op: does not wait for the device
        hsemu.synchronize()
    assert torch.equal(early, torch.zeros(1024)), "the copy had already run: the emulator is not asynchronous"
    assert torch.equal(host, torch.ones(1024))


def test_copy_to_pageable_host_waits(dev):
    src = torch.ones(1024, device=dev)
    host = torch.empty(1024)
    with hsemu.copy_delay(d2h_us=DELAY):
        host.copy_(src, non_blocking=True)  # pageable: synchronous, as on CUDA
        assert torch.equal(host, torch.ones(1024))


def test_copy_rate_makes_copy_time_proportional_to_bytes(dev):
    """The bandwidth knob: at 100 MB/s a copy of 4 MB sleeps 40 ms and one of 1 MB 10 ms (sleeps are lower bounds,
    so the test checks each copy took at least its bytes' time and the large one took longer than the small)."""
    rate = 100_000_000
    taken = {}
    with hsemu.copy_delay(), hsemu.copy_rate(d2h_bytes_per_s=rate):
        assert list(torch.ops.hsemu.copy_rate()) == [0, rate, 0]
        for numel in (250_000, 1_000_000):  # float32: 1 MB, 4 MB
            src = torch.ones(numel, device=dev)
            host = torch.empty(numel).pin_memory()
            hsemu.synchronize()
            t0 = time.perf_counter()
            host.copy_(src, non_blocking=True)
            hsemu.synchronize()
            taken[numel] = time.perf_counter() - t0
            assert torch.equal(host, torch.ones(numel))
    assert list(torch.ops.hsemu.copy_rate()) == [0, 0, 0], "the block restores the rates"
    assert taken[250_000] >= 0.010 and taken[1_000_000] >= 0.040, taken
    assert taken[1_000_000] > taken[250_000], taken
    with pytest.raises(ValueError, match="copy rate must be >= 0"):
        hsemu.set_copy_rate(-1, 0, 0)


def test_streams_are_unordered_without_an_event_and_ordered_with_one(dev):
    host = torch.full((256,), 3.0).pin_memory()
    side = hsemu.new_stream()
    for use_event in (False, True):
        d = torch.zeros(256, device=dev)
        hsemu.synchronize()
        with hsemu.copy_delay(h2d_us=DELAY):
            d.copy_(host, non_blocking=True)  # queued on stream 0, lands after DELAY
            event = torch.Event(device=dev)
            event.record()
            with hsemu.stream(side):
                if use_event:
                    event.wait()
                out = torch.empty(256)
                out.copy_(d)  # synchronous read on the side stream
        hsemu.synchronize()
        assert torch.equal(out, host) == use_event


def test_compute_waits_for_its_stream_only(dev):
    host = torch.full((256,), 5.0).pin_memory()
    d = torch.zeros(256, device=dev)
    with hsemu.copy_delay(h2d_us=DELAY):
        d.copy_(host, non_blocking=True)
        assert torch.equal((d + 0).cpu(), host)  # same stream: compute waits for the queued copy
    d2 = torch.zeros(256, device=dev)
    hsemu.synchronize()
    side = hsemu.new_stream()
    with hsemu.copy_delay(h2d_us=DELAY):
        with hsemu.stream(side):
            d2.copy_(host, non_blocking=True)
        seen = (d2 + 0).cpu()  # stream 0 was not told to wait
    hsemu.synchronize()
    assert torch.equal(seen, torch.zeros(256))


def test_freed_block_is_poisoned_and_reused_first(dev):
    a = torch.ones(1000, device=dev)
    ptr = a.data_ptr()
    del a
    b = torch.empty(1000, device=dev)
    assert b.data_ptr() == ptr
    assert _poisoned(b.cpu())


def test_record_stream_defers_reuse_until_that_stream_ran(dev):
    side = torch.Stream(device=dev)  # a new stream of the emulated device
    a = torch.ones(1000, device=dev)
    ptr = a.data_ptr()
    with hsemu.stream(side.stream_id):
        hsemu.sleep(DELAY)
    a.record_stream(side)
    before = hsemu.stats()["deferred_frees"]
    del a
    assert hsemu.stats()["deferred_frees"] == before + 1
    b = torch.empty(1000, device=dev)
    assert b.data_ptr() != ptr, "a block still used by another stream was handed out"
    hsemu.synchronize()
    c = torch.empty(1000, device=dev)
    assert c.data_ptr() == ptr


def test_pinned_block_is_not_reused_before_its_copy_ran(dev):
    src = torch.ones(4096, device=dev)
    host = torch.empty(4096).pin_memory()
    ptr = host.data_ptr()
    with hsemu.copy_delay(d2h_us=DELAY):
        host.copy_(src, non_blocking=True)
        del host
        again = torch.empty(4096).pin_memory()
        assert again.data_ptr() != ptr
    hsemu.synchronize()


def test_autograd_runs_on_the_device_with_streams(dev):
    w = torch.randn(16, 16, device=dev, requires_grad=True)
    x = torch.randn(4, 16, device=dev)
    (x @ w).tanh().sum().backward()
    w_cpu = w.detach().cpu().requires_grad_()
    (x.cpu() @ w_cpu).tanh().sum().backward()
    assert torch.equal(w.grad.cpu(), w_cpu.grad)


def test_current_stream_is_per_thread(dev):
    side = hsemu.new_stream()
    seen = []
    with hsemu.stream(side):
        t = threading.Thread(target=lambda: seen.append(int(torch.ops.hsemu.current_stream())))
        t.start()
        t.join()
        assert int(torch.ops.hsemu.current_stream()) == side
    assert seen == [0]
