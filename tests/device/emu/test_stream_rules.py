"""One test per stream/event rule of docs/design.md, on the emulated accelerator.

Each test builds the exact interleaving the rule guards against: a delayed copy, a stalled stream, a freed block
that the allocator hands out again at once, filled with poison (NaN). With the rule's line in csrc/ present, the
values come back exactly; with it deleted, the test fails. scripts/mutation_check.py deletes each line in turn and
checks that the test named next to it in docs/design.md goes red.
"""

from __future__ import annotations

import pytest
import torch

import hsemu
import hsoffload
from hsoffload import OffloadScope
from support.waits import until

DELAY = 20_000  # us: a copy or stall that the host certainly overtakes
SHORT = 2_000
N = 4096  # floats per tensor (16 KiB): every tensor of a test has the same size, so freed blocks are reused

pack_op = torch.ops.hsoffload.offload_pack
unpack_op = torch.ops.hsoffload.offload_unpack


def _scope(**kwargs) -> OffloadScope:
    return OffloadScope(min_offload_size=0, **kwargs)


def _pack(scope: OffloadScope, x: torch.Tensor) -> torch.Tensor:
    """Marks and packs `x` in `scope` (must be entered), as the saved-tensor hook would."""
    scope.mark(x)
    return pack_op(x, scope.id)


def _full(value: float, dev: torch.device, n: int = N) -> torch.Tensor:
    return torch.full((n,), value, device=dev)


def _expect(t: torch.Tensor, value: float) -> None:
    host = t.cpu()
    assert torch.equal(host, torch.full_like(host, value)), (
        f"expected all {value}, got {host.unique()[:8].tolist()} (NaN = poisoned memory)"
    )


def test_d2h_copy_waits_for_the_producing_stream(dev):
    """Pack: the side-stream copy reads x only after the stream that produced x (e_prod)."""
    host = torch.full((N,), 7.0).pin_memory()
    scope = _scope()
    with hsemu.copy_delay(h2d_us=DELAY):
        with scope:
            x = host.to(dev, non_blocking=True)  # produced by a copy still queued on stream 0
            handle = _pack(scope, x)
    del x
    _expect(unpack_op(handle), 7.0)
    assert scope.stats.offloaded_tensors == 1


def test_device_block_is_not_reused_before_the_d2h_copy_read_it(dev):
    """Pack: recordDataPtrOnStream(x, D) keeps x's block from the allocator until the copy ran."""
    scope = _scope()
    with hsemu.copy_delay(d2h_us=DELAY):
        with scope:
            x = _full(3.0, dev)
            handle = _pack(scope, x)
            del x  # the last reference: the block is free as far as the host knows
            sentinel = _full(-1.0, dev)  # same size: gets x's block if the allocator allows it
    _expect(unpack_op(handle), 3.0)
    _expect(sentinel, -1.0)


def test_restore_waits_for_the_d2h_copy(dev):
    """Restore: the host-to-device copy reads the host buffer only after d2h_done."""
    scope = _scope()
    x = _full(11.0, dev)
    with hsemu.copy_delay(d2h_us=DELAY):
        with scope:
            handle = _pack(scope, x)
        restored = unpack_op(handle)  # at once: the D2H copy has not run yet
    _expect(restored, 11.0)


def test_restore_waits_for_the_allocation_point_on_the_compute_stream(dev):
    """Restore: the side stream writes the new block only after the compute stream's earlier users of it (e_alloc)."""
    scope = _scope()
    x = _full(3.0, dev)
    with scope:
        handle = _pack(scope, x)
    hsemu.synchronize()
    old = _full(5.0, dev)
    keep = torch.empty(N, device=dev)
    with hsemu.copy_delay(h2d_us=SHORT, d2d_us=0):
        hsemu.sleep(DELAY)  # stream 0 lags the host
        keep.copy_(old)  # queued after the stall: still reads old's block
        del old  # freed on the host: its block is reused by the restore below
        restored = unpack_op(handle)
    _expect(keep, 5.0)
    _expect(restored, 3.0)


def test_prefetched_block_freed_early_is_not_reused_before_its_copy(dev):
    """Restore: recordDataPtrOnStream(dev, H): a prefetch dropped with its graph keeps its block until written."""
    scope = _scope(prefetch_depth=1)
    a, b = _full(1.0, dev), _full(2.0, dev)
    with scope:
        handle_a = _pack(scope, a)
        handle_b = _pack(scope, b)
    hsemu.synchronize()
    with hsemu.copy_delay(h2d_us=DELAY):
        restored_b = unpack_op(handle_b)  # restores b on demand and prefetches a
        del handle_a  # a's graph is gone: its prefetched block is dropped while the copy into it is queued
        sentinel = _full(9.0, dev)
    hsemu.synchronize()  # let the delayed side-stream copy land wherever it writes
    _expect(sentinel, 9.0)
    _expect(restored_b, 2.0)
    assert scope.stats.restored_tensors == 1


def test_consumer_waits_for_the_restore(dev):
    """Unpack: the consumer's stream waits on h2d_done before it reads the restored tensor."""
    scope = _scope(prefetch_depth=0)
    x = _full(4.0, dev)
    with scope:
        handle = _pack(scope, x)
    hsemu.synchronize()
    with hsemu.copy_delay(h2d_us=DELAY):
        restored = unpack_op(handle)
        seen = (restored + 0).cpu()  # compute on stream 0 right away
    assert torch.equal(seen, torch.full((N,), 4.0))


def test_consumer_on_a_second_stream_is_known_to_the_allocator(dev):
    """Unpack on another stream than the restore allocated on: that stream's use is recorded (record_stream)."""
    scope = _scope(prefetch_depth=1)
    a, b = _full(6.0, dev), _full(7.0, dev)
    with scope:
        handle_a = _pack(scope, a)
        handle_b = _pack(scope, b)
    restored_b = unpack_op(handle_b)  # prefetches a: its block belongs to stream 0's pool
    hsemu.synchronize()
    side = hsemu.new_stream()
    keep = torch.empty(N, device=dev)
    with hsemu.stream(side):
        restored_a = unpack_op(handle_a)
        hsemu.sleep(DELAY)
        keep.copy_(restored_a)  # queued on the side stream, after the stall
    del restored_a, handle_a  # freed on the host while the side stream still has to read it
    sentinel = _full(9.0, dev)  # stream 0 must not get that block yet
    hsemu.synchronize()  # keep was written on the side stream
    _expect(keep, 6.0)
    _expect(sentinel, 9.0)
    _expect(restored_b, 7.0)
    assert scope.stats.prefetch_hits == 1


def test_host_buffer_is_not_lent_again_while_a_restore_reads_it(dev):
    """Pool: a buffer returns to service only after its last recorded use (the H2D copy) completed."""
    hsoffload.empty_pool()
    n = 3000  # a size no other test uses: the pool has exactly one idle buffer of it below
    a = _full(1.0, dev, n)
    first = _scope()
    with first:
        handle_a = _pack(first, a)
    hsemu.synchronize()
    with hsemu.copy_delay(h2d_us=DELAY, d2h_us=0):
        restored_a = unpack_op(handle_a)  # reads a's host buffer after DELAY
        del handle_a  # the record goes: its host buffer is idle in the pool, the read still pending
        side = hsemu.new_stream()  # stream 0 waits for a's restore; c's producer must not
        second = _scope()
        with hsemu.stream(side), second:
            c = _full(2.0, dev, n)
            handle_c = _pack(second, c)  # must not be given a's buffer
    _expect(restored_a, 1.0)
    _expect(unpack_op(handle_c), 2.0)


def test_host_buffer_is_not_lent_again_while_a_d2h_copy_writes_it(dev):
    """Pool: a buffer whose D2H copy is still queued (record dropped at once) is not lent to another pack.

    The late copy runs on the compute stream (`use_streams=False`): the process's one D2H side stream would order the
    second pack's copy after it, and hide the reuse."""
    hsoffload.empty_pool()
    n = 3500
    first = _scope(use_streams=False)
    with first:
        a = _full(1.0, dev, n)
        hsemu.sleep(DELAY)  # the D2H copy waits for stream 0, which lags
        handle_a = _pack(first, a)
    del handle_a  # graph dropped before its copy ran: the buffer goes back to the pool
    side = hsemu.new_stream()
    second = _scope()
    with hsemu.stream(side), second:
        c = _full(2.0, dev, n)  # produced on a stream that does not lag
        handle_c = _pack(second, c)
    hsemu.synchronize()  # every queued copy has landed, a's late one included
    _expect(unpack_op(handle_c), 2.0)


# --- the spill tier (max_host_bytes=0: every pack spills; the I/O threads copy on the side streams) ----------------


@pytest.fixture
def spill_scope(tmp_path):
    made: list[OffloadScope] = []

    def make(**kwargs) -> OffloadScope:
        made.append(_scope(max_host_bytes=0, spill_dir=str(tmp_path), **kwargs))
        return made[-1]

    yield make
    hsoffload.set_host_budget("auto")
    for s in made:
        assert s.stats.kept_on_device_tensors == 0


def _written(scope: OffloadScope, nbytes: int) -> None:
    """Waits until the I/O threads have written `nbytes` more than when the scope was entered."""
    until(lambda: scope.spill_stats()["bytes_written"] >= nbytes, scope.spill_stats)


def test_spill_write_waits_for_the_producing_stream(dev, spill_scope):
    """Spill write: the I/O thread's device->staging copy runs only after the stream that produced x (e_prod)."""
    host = torch.full((N,), 7.0).pin_memory()
    scope = spill_scope()
    with hsemu.copy_delay(h2d_us=DELAY):
        with scope:
            x = host.to(dev, non_blocking=True)  # produced by a copy still queued on stream 0
            handle = _pack(scope, x)
    del x
    _expect(unpack_op(handle), 7.0)
    assert scope.stats.spilled_tensors == 1


def test_spill_write_waits_for_its_staging_copy(dev, spill_scope):
    """Spill write: pwrite reads the staging chunk only after the device->staging copy into it has run."""
    scope = spill_scope()
    with hsemu.copy_delay(d2h_us=DELAY):
        with scope:
            handle = _pack(scope, _full(4.0, dev))
            _written(scope, N * 4)
    _expect(unpack_op(handle), 4.0)


def test_spill_read_waits_for_the_allocation_point(dev, spill_scope):
    """Spill read: the side stream writes the new block only after the compute stream's earlier users (e_alloc)."""
    scope = spill_scope()
    x = _full(3.0, dev)
    with scope:
        handle = _pack(scope, x)
        _written(scope, N * 4)
    hsemu.synchronize()
    old = _full(5.0, dev)
    keep = torch.empty(N, device=dev)
    with hsemu.copy_delay(h2d_us=SHORT, d2d_us=0):
        hsemu.sleep(DELAY)  # stream 0 lags the host
        keep.copy_(old)  # queued after the stall: still reads old's block
        del old  # freed on the host: the spill read's block reuses it
        restored = unpack_op(handle)
    _expect(keep, 5.0)
    _expect(restored, 3.0)


def test_spill_read_reuses_staging_only_after_its_copy(dev, spill_scope):
    """Spill read: a tensor of several 8 MiB chunks goes through one staging chunk; each chunk's staging->device copy
    must have run before the next pread overwrites the chunk."""
    n = (8 << 20) // 4 * 2 + N  # two full chunks and a bit
    x = torch.arange(n, dtype=torch.float32).remainder(1000.0).to(dev)
    scope = spill_scope()
    with scope:
        handle = _pack(scope, x)
        _written(scope, n * 4)
    hsemu.synchronize()
    with hsemu.copy_delay(h2d_us=DELAY):
        restored = unpack_op(handle)
        assert torch.equal(restored.cpu(), x.cpu())


def test_spill_from_host_waits_for_the_host_copy(dev, tmp_path):
    """Spill from host: the I/O thread writes a host copy to its file only after the device->host copy into that
    block has landed (d2h_done); the restore then reads the file."""
    scope = _scope(max_host_bytes=N * 4, spill_dir=str(tmp_path))  # room for this one copy: written out at once
    try:
        with hsemu.copy_delay(d2h_us=DELAY):
            with scope:
                handle = _pack(scope, _full(4.0, dev))
                _written(scope, N * 4)
        # The copy moved to the file and gave its host block back: the restore reads the file.
        until(lambda: hsoffload.budget_stats().in_flight == 0, hsoffload.budget_stats)
        assert scope.stats.spilled_tensors == 1 and scope.stats.spilled_from_device_tensors == 0, scope.stats
        _expect(unpack_op(handle), 4.0)
    finally:
        hsoffload.set_host_budget("auto")


def test_unpack_waits_for_the_spill_read(dev, spill_scope):
    """Unpack: the restored tensor is handed out only once the I/O thread has read it back."""
    scope = spill_scope()
    with scope:
        handle = _pack(scope, _full(6.0, dev))
        _written(scope, N * 4)
    hsemu.synchronize()
    with hsemu.copy_delay(h2d_us=DELAY):
        restored = unpack_op(handle)
    _expect(restored, 6.0)
