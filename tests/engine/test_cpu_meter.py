"""The CPU meter (csrc/cpu_meter.cpp): a counting allocator in front of the CPU allocator, what policy "auto" reads
when the device is the CPU. Installed once per process and never removed (the suite's other tests run over it)."""

from __future__ import annotations

import gc

import torch

import hsoffload
from hsoffload.offload.auto import DeviceMemory
from hsoffload.stats import CpuMeterStats, from_engine


def _stats() -> CpuMeterStats:
    return from_engine(CpuMeterStats, torch.classes.hsoffload.OffloadScope.cpu_meter_stats())


def test_counts_what_the_cpu_allocator_lends_and_gets_back() -> None:
    gc.disable()  # the counts are the process's: nothing else may free CPU tensors in between
    try:
        _count_one_and_two_mib()
    finally:
        gc.enable()


def _count_one_and_two_mib() -> None:
    meter = DeviceMemory(torch.device("cpu"))
    assert _stats().installed
    before = meter.allocated()
    x = torch.empty(1 << 18, dtype=torch.float32)  # 1 MiB
    assert meter.allocated() - before == x.nbytes
    meter.reset_peak()
    y = torch.empty(1 << 19, dtype=torch.float32)  # 2 MiB
    del y
    assert meter.peak() >= meter.allocated() + (2 << 20) - 64
    del x
    assert meter.allocated() == before
    meter.reset_peak()
    assert meter.peak() == meter.allocated()


def test_kernels_that_ask_for_raw_blocks_run_over_it() -> None:
    """c10's raw_allocate (oneDNN / BLAS workspaces, reached by a linear layer's backward) asserts that blocks are
    their own context: such kernels run over the meter."""
    DeviceMemory(torch.device("cpu"))
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 80)
    x = torch.randn(4, 33, 96, requires_grad=True)
    out = lin(x)
    out.sum().backward()
    assert out.shape == (4, 33, 80) and x.grad is not None and torch.isfinite(x.grad).all()


def test_offloaded_copies_are_host_memory_not_the_devices() -> None:
    """Under an offload scope on the CPU (offload_cpu_tensors), a hidden state's copy goes to the host pool: counted
    as host bytes, and the device's count drops by what was freed."""
    meter = DeviceMemory(torch.device("cpu"))
    torch.classes.hsoffload.OffloadScope.empty_pool()  # the copy's slab is allocated now, over the meter
    x = torch.randn(1 << 18, requires_grad=True)  # 1 MiB
    host_before = _stats().host_bytes
    allocated_before = meter.allocated()
    with hsoffload.OffloadScope(offload_cpu_tensors=True, min_offload_size=0) as scope:
        h = hsoffload.mark_hidden_state(x * 2)
        y = h.sin()
        del h
    assert scope.stats.offloaded_bytes == 1 << 20
    assert _stats().host_bytes - host_before >= 1 << 20  # the pool's slab (kept by the pool: it caches)
    # y (1 MiB) lives on the device; the saved input's storage went to the host
    assert meter.allocated() - allocated_before < 2 << 20
    y.sum().backward()
    assert torch.equal(x.grad, 2 * torch.cos(2 * x.detach()))
