// C++ unit tests of the engine (no Python): host pool policy and scope
// bookkeeping on CPU, with an injected allocator that counts allocations.
#include "hsoffload/host_pool.h"
#include "hsoffload/scope.h"

#include <ATen/ATen.h>

#include <cstdio>
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

void test_rounding() {
  EXPECT(HostPool::round_size(1) == 512);
  EXPECT(HostPool::round_size(512) == 512);
  EXPECT(HostPool::round_size(513) == 1024);
  // Waste stays below 1/32 for large sizes.
  for (int64_t n : {int64_t{100000}, int64_t{12345678}, int64_t{3} << 30}) {
    const int64_t r = HostPool::round_size(n);
    EXPECT(r >= n);
    EXPECT((r - n) * 32 <= n + 512 * 32);
  }
}

void test_reuse_and_stats() {
  int allocs = 0;
  auto pool = counting_pool(int64_t{1} << 30, &allocs);
  {
    auto a = pool->acquire(10000, false);
    auto b = pool->acquire(10000, false);
    EXPECT(a.capacity() >= 10000 && b.capacity() >= 10000);
    EXPECT(pool->stats().in_use_bytes == a.capacity() + b.capacity());
  }
  EXPECT(pool->stats().in_use_bytes == 0);
  EXPECT(pool->stats().cached_bytes == pool->stats().held_bytes);
  {
    auto a = pool->acquire(10000, false);
    auto b = pool->acquire(9900, false);  // same rounded class: reused
    EXPECT(allocs == 2);
    EXPECT(pool->stats().reuses == 2);
  }
  // A much smaller request does not take a big buffer, and evicts one idle buffer.
  {
    auto small = pool->acquire(600, false);
    EXPECT(allocs == 3);
    EXPECT(pool->stats().held_bytes == HostPool::round_size(10000) + HostPool::round_size(600));
  }
}

void test_converges_with_changing_sizes() {
  int allocs = 0;
  auto pool = counting_pool(int64_t{1} << 30, &allocs);
  const int layers = 8;
  int64_t peak_in_flight = 0;
  for (int64_t seq : {1000, 1500, 900, 2000, 2000, 1200}) {
    std::vector<hsoffload::HostBlock> step;
    int64_t in_flight = 0;
    for (int i = 0; i < layers; ++i) {
      step.push_back(pool->acquire(seq * 4096, false));
      in_flight += seq * 4096;
    }
    peak_in_flight = std::max(peak_in_flight, in_flight);
  }
  const auto s = pool->stats();
  // Held never exceeds the largest working set by more than rounding.
  EXPECT(s.peak_held_bytes * 100 <= peak_in_flight * 105);
}

void test_limit() {
  int allocs = 0;
  auto pool = counting_pool(4096, &allocs);
  auto a = pool->acquire(3000, false);
  auto b = pool->acquire(3000, false);  // over the limit: unpooled
  EXPECT(pool->stats().unpooled == 1);
  EXPECT(pool->stats().held_bytes <= 4096);
  b = hsoffload::HostBlock();
  EXPECT(pool->stats().held_bytes <= 4096);
  pool->set_max_bytes(0);
  a = hsoffload::HostBlock();
  EXPECT(pool->stats().held_bytes == 0);
}

void test_scope_roundtrip() {
  int allocs = 0;
  auto pool = counting_pool(int64_t{1} << 30, &allocs);
  hsoffload::OffloadConfig config;
  config.offload_cpu_tensors = true;
  config.min_offload_size = 0;
  auto scope = hsoffload::OffloadScope::create(config, pool);
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

}  // namespace

int main() {
  test_rounding();
  test_reuse_and_stats();
  test_converges_with_changing_sizes();
  test_limit();
  test_scope_roundtrip();
  test_version_check();
  if (failures) {
    std::fprintf(stderr, "%d expectation(s) failed\n", failures);
    return 1;
  }
  std::printf("test_engine: all passed\n");
  return 0;
}
