"""Pinned memory out of the hot path, and one account of it (issue 21 item 3), on the CPU.

`hsoffload.reserve_host(bytes)` fills the pool before the first step, so the first step's packs allocate nothing and
run no slower than later ones; `reserve_host_bytes` does it at scope entry; pool_stats() and budget_stats() report
the same host bytes (unpooled blocks included). That packs never allocate under a lock is tested in C++
(tests/engine/cpp/test_engine.cpp, test_reserve_allocates_outside_the_locks); on a GPU, tests/device/test_gpu_engine.py.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time

import pytest
import torch

import hsoffload
from hsoffload import OffloadScope
from support.device_model import LinearStack

LAYERS = 6
TOKENS, DIM = 2048, 512  # 4 MiB per hidden state


def Stack() -> LinearStack:  # noqa: N802  (the model's name in these tests)
    return LinearStack(DIM, LAYERS)


@pytest.fixture
def fresh_pool():
    # The pool limit follows the host budget, whatever a test before this one in the process set (test_core's
    # max_pool_bytes test restores the number it read, which is explicit from then on).
    hsoffload.set_pool_limit(-1)
    hsoffload.empty_pool()
    yield
    hsoffload.set_pool_limit(-1)  # follow the host budget again, as by default
    hsoffload.empty_pool()


def _step(model: Stack, x: torch.Tensor, **kwargs) -> tuple[float, hsoffload.OffloadStats]:
    model.zero_grad(set_to_none=True)
    t0 = time.process_time()  # CPU time of this process: robust to other processes on a shared machine
    with OffloadScope(offload_cpu_tensors=True, min_offload_size=0, **kwargs) as scope:
        model(x).backward()
    return time.process_time() - t0, scope.stats


@pytest.fixture
def one_thread():
    """Step times as CPU time of one thread: intra-op worker threads spinning on a shared 2-core machine made wall
    and process times vary by 3x from step to step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow  # a timing comparison over many steps (tests/durations.json)
def test_first_step_after_reserve_host_allocates_nothing_and_is_no_slower(fresh_pool, one_thread) -> None:
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(TOKENS, DIM)
    _step(model, x)  # torch's and the shim's first-call costs, outside the comparison
    need = LAYERS * TOKENS * DIM * 4
    firsts: list[float] = []
    times: list[float] = []
    # Three rounds of (empty pool, reserve, 4 steps): the first step of each round against the later steps of all of
    # them, the fastest first step (one CPU-time spike of a shared machine is not the pool's doing).
    for _ in range(3):
        hsoffload.empty_pool()
        assert hsoffload.reserve_host(need, pinned=False) >= need
        before = hsoffload.pool_stats()
        for step in range(4):
            seconds, stats = _step(model, x)
            assert stats.offloaded_tensors == LAYERS
            if step == 0:
                assert hsoffload.pool_stats().allocations == before.allocations  # the first step allocated nothing
                firsts.append(seconds)
            else:
                times.append(seconds)
    later = statistics.median(times)
    print(f"first step {min(firsts) * 1e3:.1f} ms (fastest of {len(firsts)} rounds), later steps median "
          f"{later * 1e3:.1f} ms, slowest {max(times) * 1e3:.1f} ms (CPU, pageable pool)")
    assert min(firsts) <= 1.25 * max(times) + 0.01, (firsts, times)


def test_scope_option_reserves_at_entry(fresh_pool) -> None:
    need = LAYERS * TOKENS * DIM * 4
    before = hsoffload.pool_stats()
    scope = OffloadScope(offload_cpu_tensors=True, min_offload_size=0, reserve_host_bytes=need, pin_memory=False)
    with scope:
        pass
    held = hsoffload.pool_stats()
    assert held.held_bytes >= need > before.held_bytes
    assert hsoffload.OffloadConfig(reserve_host_bytes="8MiB").reserve_host_bytes == 8 << 20
    with pytest.raises(ValueError, match="reserve_host_bytes"):
        hsoffload.OffloadConfig(reserve_host_bytes="auto")


def test_scope_entry_reserves_under_its_own_host_budget(fresh_pool, caplog) -> None:
    """reserve_host_bytes is pinned after the entry's max_host_bytes applies: a reservation larger than the entry's
    budget stops at the pool limit that budget gives (and says so), instead of pinning under the old limit first."""
    hsoffload.set_host_budget("auto")  # the process's budget before: most of the machine's RAM
    budget = 4 << 20
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        with OffloadScope(offload_cpu_tensors=True, min_offload_size=0, pin_memory=False, max_host_bytes=budget,
                          reserve_host_bytes=64 << 20):
            held = hsoffload.pool_stats().held_bytes
    hsoffload.set_host_budget("auto")
    assert held <= budget + budget // 8, held  # the pool follows the entry's budget (+1/16), slab rounding aside
    assert any("reserve_host(67108864)" in r.getMessage() for r in caplog.records), caplog.records


def test_pool_and_budget_tell_the_same_story_unpooled_blocks_included(fresh_pool) -> None:
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(TOKENS, DIM)
    hsoffload.set_pool_limit(0)  # every block unpooled: a buffer of its own, outside held_bytes
    model.zero_grad(set_to_none=True)
    with OffloadScope(offload_cpu_tensors=True, min_offload_size=0) as scope:
        loss = model(x)
        pool, budget = hsoffload.pool_stats(), hsoffload.budget_stats()
        assert pool.unpooled_bytes >= LAYERS * TOKENS * DIM * 4 and pool.held_bytes == 0
        assert budget.host_bytes == pool.held_bytes + pool.unpooled_bytes >= budget.in_flight > 0
        loss.backward()
    assert scope.stats.offloaded_tensors == LAYERS
    del loss
    assert hsoffload.pool_stats().unpooled_bytes == 0
    assert hsoffload.budget_stats().host_bytes == hsoffload.pool_stats().held_bytes


def test_reserve_host_beyond_the_pool_limit_says_so(fresh_pool, caplog) -> None:
    hsoffload.set_pool_limit(2 << 20)
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        got = hsoffload.reserve_host(64 << 20, pinned=False)
    assert got <= 2 << 20
    assert any("reserve_host" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="reserve_host"):
        hsoffload.reserve_host(-1)


def test_axolotl_key_reserves_the_planned_host_bytes() -> None:
    from hsoffload.integrations.axolotl_plugin import offload_config, validate_config

    cfg = {"activation_offloading": "hidden_states", "hsoffload_reserve_host_bytes": "24GiB"}
    validate_config(cfg)
    assert offload_config(cfg).reserve_host_bytes == 24 << 30
    with pytest.raises(ValueError, match="hsoffload_reserve_host_bytes"):
        validate_config({"hsoffload_reserve_host_bytes": "auto"})


def test_spill_staging_is_reported(tmp_path) -> None:
    chunk = 8 << 20
    with OffloadScope(offload_cpu_tensors=True, spill_dir=str(tmp_path)) as scope:
        staging = scope.spill_stats()["staging_bytes"]
    # Two I/O threads, one 8 MiB chunk each (pageable here: at most a 4096-byte pad for alignment; pinned chunks
    # are asked for as exactly 8 MiB, a power of two, so a caching host allocator holds no more).
    assert 2 * chunk <= staging <= 2 * (chunk + 4096)


def test_one_limit_the_pool_follows_the_host_budget(fresh_pool) -> None:
    engine = hsoffload.offload.host._engine()
    before = hsoffload.budget_stats()
    try:
        hsoffload.set_host_budget(64 << 20)
        assert engine.pool_limit() == (64 << 20) + (4 << 20)  # the budget plus 1/16 slab slack
        hsoffload.set_host_budget(1 << 30)
        assert engine.pool_limit() == (1 << 30) + (64 << 20)
        hsoffload.set_pool_limit(8 << 20)  # an explicit pool bound (max_pool_bytes) stops following
        hsoffload.set_host_budget(256 << 20)
        assert engine.pool_limit() == 8 << 20
        hsoffload.set_pool_limit(-1)
        assert engine.pool_limit() == (256 << 20) + (16 << 20)
    finally:
        hsoffload.set_host_budget("auto" if before.is_auto else before.limit)
    assert engine.pool_limit() == hsoffload.budget_stats().limit + max(hsoffload.budget_stats().limit // 16, 1 << 20)
