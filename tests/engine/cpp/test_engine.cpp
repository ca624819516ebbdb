// C++ unit tests of the engine (no Python): host pool policy and scope
// bookkeeping on CPU, with an injected allocator that counts allocations.
#include "hsoffload/host_budget.h"
#include "hsoffload/host_pool.h"
#include "hsoffload/scope.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <future>
#include <cstdlib>
#include <vector>

namespace {

int failures = 0;

#define EXPECT(cond)                                                   \
  do {                                                                 \
    if (!(cond)) {                                                     \
      std::fprintf(stderr, "%s:%d: EXPECT failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                      \
    }                                                                  \
  } while (0)

using hsoffload::HostPool;

std::shared_ptr<HostPool> counting_pool(int64_t limit, int* allocs) {
  return HostPool::create(limit, [allocs](int64_t bytes, bool pinned) {
    ++*allocs;
    return at::empty({bytes}, at::kByte);
  });
}

void test_slab_size() {
  EXPECT(HostPool::slab_size(0, 1) == HostPool::kMinSlab);
  EXPECT(HostPool::slab_size(int64_t{8} << 30, 0) == int64_t{256} << 20);  // 1/32 of the total
  EXPECT(HostPool::slab_size(int64_t{1} << 40, 0) == HostPool::kMaxSlab);
  for (int64_t held : {int64_t{0}, int64_t{12345678}, int64_t{3} << 30}) {
    const int64_t s = HostPool::slab_size(held, 1000);
    EXPECT((s & (s - 1)) == 0);  // a power of two: no rounding in the accelerators' host allocators
  }
}

int64_t total(const hsoffload::HostBlock& b) {
  int64_t n = 0;
  for (const auto& p : b.extents()) n += p.numel();
  return n;
}

void test_reuse_and_stats() {
  int allocs = 0;
  auto pool = counting_pool(int64_t{1} << 30, &allocs);
  {
    auto a = pool->acquire(10000, false);
    auto b = pool->acquire(10000, false);
    EXPECT(total(a) == 10000 && total(b) == 10000 && a.bytes() == 10000);
    EXPECT(allocs == 1);  // one slab serves both
    EXPECT(pool->stats().in_use_bytes == 2 * 10240);
    // The two blocks do not overlap.
    a.extents()[0].fill_(1);
    b.extents()[0].fill_(2);
    EXPECT(a.extents()[0].eq(1).all().item<bool>());
  }
  EXPECT(pool->stats().in_use_bytes == 0);
  EXPECT(pool->stats().cached_bytes == pool->stats().held_bytes);
  {
    auto a = pool->acquire(600, false);
    auto b = pool->acquire(900000, false);
    EXPECT(allocs == 1);
    EXPECT(pool->stats().reuses == 3 && pool->stats().acquires == 4);  // only the first needed a slab
  }
}

void test_multi_extent_and_coalescing() {
  int allocs = 0;
  auto pool = counting_pool(int64_t{1} << 30, &allocs);
  const int64_t slab = HostPool::kMinSlab;
  std::vector<hsoffload::HostBlock> quarters;
  for (int i = 0; i < 4; ++i) quarters.push_back(pool->acquire(slab / 4, false));
  EXPECT(allocs == 1);
  // Free the 1st and 3rd quarter: 1/2 slab free, no contiguous half. A half-slab block takes two extents.
  quarters[0] = hsoffload::HostBlock();
  quarters[2] = hsoffload::HostBlock();
  {
    auto half = pool->acquire(slab / 2, false);
    EXPECT(allocs == 1);
    EXPECT(half.extents().size() == 2 && total(half) == slab / 2);
  }
  // Everything back: the ranges coalesce into one, so a whole-slab block is one extent.
  quarters.clear();
  auto whole = pool->acquire(slab, false);
  EXPECT(allocs == 1 && whole.extents().size() == 1);
  // Nothing free: new slabs for the whole request, the remainder in one of the smallest size.
  auto more = pool->acquire(slab + 4096, false);
  EXPECT(total(more) == slab + 4096 && more.extents().size() == 2);
  EXPECT(pool->stats().held_bytes == 3 * slab);
}

void test_converges_with_changing_sizes() {
  int allocs = 0;
  auto pool = counting_pool(int64_t{1} << 34, &allocs);
  const int layers = 8;
  int64_t peak_in_flight = 0;
  uint32_t seed = 12345;
  int64_t acquires_after_first = 0, reuses_after_first = 0;
  for (int step = 0; step < 100; ++step) {
    seed = seed * 1103515245u + 12345u;
    const int64_t seq = 4096 + (seed >> 8) % 4096;  // uniform in [L/2, L)
    if (step == 1) {
      acquires_after_first = pool->stats().acquires;
      reuses_after_first = pool->stats().reuses;
    }
    std::vector<hsoffload::HostBlock> step_blocks;
    int64_t in_flight = 0;
    for (int i = 0; i < layers; ++i) {
      step_blocks.push_back(pool->acquire(seq * 8192, false));
      in_flight += seq * 8192;
    }
    peak_in_flight = std::max(peak_in_flight, in_flight);
  }
  const auto s = pool->stats();
  EXPECT(s.peak_held_bytes * 100 <= peak_in_flight * 105);
  const int64_t later = s.acquires - acquires_after_first;
  EXPECT((s.reuses - reuses_after_first) * 100 >= later * 95);
}

void test_limit() {
  int allocs = 0;
  auto pool = counting_pool(HostPool::kMinSlab, &allocs);
  auto a = pool->acquire(3000, false);
  auto b = pool->acquire(HostPool::kMinSlab, false);  // over the limit: unpooled
  EXPECT(pool->stats().unpooled == 1);
  EXPECT(pool->stats().unpooled_bytes == HostPool::kMinSlab);  // counted while lent
  EXPECT(pool->stats().held_bytes <= HostPool::kMinSlab);
  b = hsoffload::HostBlock();
  EXPECT(pool->stats().unpooled_bytes == 0);
  EXPECT(pool->stats().held_bytes <= HostPool::kMinSlab);
  pool->set_limit(0);  // `a` is still lent: its slab stays
  EXPECT(pool->stats().held_bytes == HostPool::kMinSlab);
  a = hsoffload::HostBlock();
  EXPECT(pool->stats().held_bytes == 0);
}

void test_budget() {
  auto budget = hsoffload::HostBudget::create(1000);
  hsoffload::HostLease a, b, c;
  EXPECT(budget->try_reserve(600, a));
  EXPECT(!budget->try_reserve(600, b));
  EXPECT(budget->try_reserve(400, c));
  EXPECT(budget->stats().in_flight == 1000 && budget->stats().refused == 1);
  a = hsoffload::HostLease();
  EXPECT(budget->stats().in_flight == 400 && budget->stats().peak == 1000);
  auto automatic = hsoffload::HostBudget::create(-1);
  const auto s = automatic->stats();
  EXPECT(s.is_auto && s.limit > 0 && s.limit <= s.mem_available);
}

void test_scope_roundtrip() {
  int allocs = 0;
  auto pool = counting_pool(int64_t{1} << 30, &allocs);
  hsoffload::OffloadConfig config;
  config.offload_cpu_tensors = true;
  config.min_offload_size = 0;
  auto scope = hsoffload::OffloadScope::create(config, pool, hsoffload::HostBudget::create(int64_t{1} << 30));
  scope->enter();
  EXPECT(hsoffload::OffloadScope::current() == scope);
  at::Tensor x = at::randn({16, 8}).slice(1, 2);
  scope->mark(x);
  auto handle = scope->pack(x);
  auto passthrough = scope->pack(at::randn({4}));
  EXPECT(handle->offloaded());
  EXPECT(!passthrough->offloaded());
  at::Tensor y = handle->unpack();
  EXPECT(at::equal(x, y));
  EXPECT(y.strides() == x.strides());
  const auto s = scope->stats();
  EXPECT(s.saved_tensors_seen == 2 && s.offloaded_tensors == 1 && s.restored_tensors == 1);
  scope->exit();
  EXPECT(hsoffload::OffloadScope::current() == nullptr);
  handle.reset();
  y = at::Tensor();
  EXPECT(scope->tracked_state() == 0);
  EXPECT(pool->stats().in_use_bytes == 0);
}

void test_version_check() {
  auto pool = hsoffload::HostPool::create(int64_t{1} << 20);
  auto scope = hsoffload::OffloadScope::create(hsoffload::OffloadConfig{}, pool);
  at::Tensor x = at::randn({4});
  auto handle = scope->pack(x);
  x.add_(1);
  bool raised = false;
  try {
    handle->unpack();
  } catch (const c10::Error& e) {
    raised = std::string(e.what()).find("modified by an inplace operation") != std::string::npos;
  }
  EXPECT(raised);
}

void test_pinned_accounting() {
  std::vector<int64_t> asked;
  auto pool = HostPool::create(HostPool::kMinSlab, [&](int64_t bytes, bool pinned) {
    asked.push_back(bytes);
    return at::empty({bytes}, at::kByte);  // "pinned" in name only: the bookkeeping is what is tested
  });
  auto slab_block = pool->acquire(1000, /*pinned=*/true);
  EXPECT(pool->stats().pinned_bytes == HostPool::kMinSlab);
  // Over the bound: an unpooled pinned buffer is asked for as a power of two (what a caching host allocator would
  // hold anyway), and counted as such while lent.
  const int64_t need = 3 * HostPool::kMinSlab / 2;
  auto own = pool->acquire(need, /*pinned=*/true);
  EXPECT(asked.back() == 2 * HostPool::kMinSlab);
  EXPECT(pool->stats().unpooled_bytes == 2 * HostPool::kMinSlab);
  EXPECT(pool->stats().pinned_bytes == 3 * HostPool::kMinSlab);
  own = hsoffload::HostBlock();
  slab_block = hsoffload::HostBlock();
  EXPECT(pool->stats().unpooled_bytes == 0 && pool->stats().pinned_bytes == HostPool::kMinSlab);
  pool->set_limit(0);  // trimmed: nothing pinned is held any more
  EXPECT(pool->stats().pinned_bytes == 0 && pool->stats().held_bytes == 0);
}

// True if `probe` can run on another thread within a second: the lock it takes is not held by the caller.
template <class F>
bool runs_elsewhere(F probe) {
  auto done = std::async(std::launch::async, probe);
  return done.wait_for(std::chrono::seconds(1)) == std::future_status::ready;
}

void test_reserve_allocates_outside_the_locks() {
  int allocs = 0;
  bool pool_lock_free = true, scope_lock_free = true;
  std::shared_ptr<HostPool> pool;
  std::shared_ptr<hsoffload::OffloadScope> scope;
  pool = HostPool::create(int64_t{1} << 30, [&](int64_t bytes, bool pinned) {
    ++allocs;
    pool_lock_free = pool_lock_free && runs_elsewhere([&] { pool->stats(); });
    if (scope) scope_lock_free = scope_lock_free && runs_elsewhere([&] { scope->stats(); });
    return at::empty({bytes}, at::kByte);
  });
  EXPECT(pool->reserve(5 << 20, false) >= (5 << 20));
  const int reserved_allocs = allocs;
  EXPECT(reserved_allocs > 0 && pool->stats().held_bytes >= (5 << 20));
  EXPECT(pool->reserve(1 << 20, false) >= (5 << 20) && allocs == reserved_allocs);  // already there: no-op
  { auto block = pool->acquire(4 << 20, false); }
  EXPECT(allocs == reserved_allocs);  // served by the reserved slabs
  // A pack that finds no room grows the pool holding neither the pool's nor the scope's lock.
  hsoffload::OffloadConfig config;
  config.offload_cpu_tensors = true;
  config.min_offload_size = 0;
  scope = hsoffload::OffloadScope::create(config, pool, hsoffload::HostBudget::create(int64_t{1} << 30));
  scope->enter();
  at::Tensor x = at::randn({int64_t{4} << 20});  // 16 MiB: more than the pool has free
  scope->mark(x);
  auto handle = scope->pack(x);
  EXPECT(handle->offloaded() && allocs > reserved_allocs);
  EXPECT(at::equal(handle->unpack(), x));
  EXPECT(scope->stats().saved_tensors_seen == 1);  // the retry after growing is not a second save
  scope->exit();
  EXPECT(pool_lock_free && scope_lock_free);
  handle.reset();
  scope.reset();
}

}  // namespace

int main() {
  test_slab_size();
  test_reuse_and_stats();
  test_multi_extent_and_coalescing();
  test_converges_with_changing_sizes();
  test_limit();
  test_budget();
  test_scope_roundtrip();
  test_version_check();
  test_reserve_allocates_outside_the_locks();
  test_pinned_accounting();
  if (failures) {
    std::fprintf(stderr, "%d expectation(s) failed\n", failures);
    return 1;
  }
  std::printf("test_engine: all passed\n");
  return 0;
}
