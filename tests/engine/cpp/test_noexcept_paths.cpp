// C++ tests of the engine's noexcept paths (docs/design.md, "What must not throw"): with `operator new` replaced
// by one that fails from a switch on, each path -- KeepAlive's release calls, the SourceReaper's thread, a host
// block's give-back (destructor and move-assignment) with its pending list, coalescing and trim, a host lease's
// release, a saved handle's and a scope's destructors -- must complete with its blocks let go and without asking
// for memory at all. An allocation put back on one of them throws std::bad_alloc inside a noexcept function:
// std::terminate, a red ctest (and the count of attempts says where, when it is caught).
//
// The accelerator is a fake one registered as PrivateUse1 for this process only: events whose completion the test
// decides (or whose queries raise, as on a dead context) and device blocks whose frees are counted.
#include "hsoffload/events.h"
#include "hsoffload/host_budget.h"
#include "hsoffload/host_pool.h"
#include "hsoffload/keepalive.h"
#include "hsoffload/scope.h"

#include "test_expect.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Storage.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <new>
#include <thread>
#include <vector>

// ---------------------------------------------------------------------------
// operator new with a fail-from-now switch (every thread of the process: the reaper's too)

namespace {
std::atomic<bool> g_fail{false};
std::atomic<int64_t> g_attempts{0};  // allocations asked for while failing

void* allocate(std::size_t n, std::size_t align) {
  if (g_fail.load(std::memory_order_relaxed)) {
    g_attempts.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  if (n == 0) n = 1;
  if (align <= alignof(std::max_align_t)) return std::malloc(n);
  void* p = nullptr;
  return posix_memalign(&p, align, n) == 0 ? p : nullptr;
}
void* allocate_or_throw(std::size_t n, std::size_t align) {
  if (void* p = allocate(n, align)) return p;
  throw std::bad_alloc();
}
}  // namespace

void* operator new(std::size_t n) { return allocate_or_throw(n, 0); }
void* operator new[](std::size_t n) { return allocate_or_throw(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return allocate_or_throw(n, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return allocate_or_throw(n, static_cast<std::size_t>(a)); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return allocate(n, 0); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return allocate(n, 0); }
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace {

// From construction on, every allocation fails (and is counted) until destruction.
class FailFromNow {
 public:
  FailFromNow() {
    g_attempts.store(0);
    g_fail.store(true);
  }
  ~FailFromNow() { g_fail.store(false); }
  FailFromNow(const FailFromNow&) = delete;
  FailFromNow& operator=(const FailFromNow&) = delete;
  static int64_t attempts() { return g_attempts.load(); }
};

// ---------------------------------------------------------------------------
// A fake accelerator (PrivateUse1): events the test completes, blocks whose frees it counts

constexpr c10::DeviceType kFake = c10::DeviceType::PrivateUse1;
const c10::Device kFakeDevice(kFake, 0);

struct FakeEvent {
  std::atomic<bool> done{true};
  std::atomic<int> queries_left{-1};  // >= 0: completes after that many more queries
  std::atomic<bool> fail{false};      // its queries raise (a dead context)
  std::atomic<int> records{0};
};
std::atomic<int> g_blocks{0};   // cross-stream waits queued (Event::block)

struct FakeGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kFake; }
  c10::Device exchangeDevice(c10::Device) const override { return kFakeDevice; }
  c10::Device getDevice() const override { return kFakeDevice; }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const override { return c10::Stream(c10::Stream::DEFAULT, kFakeDevice); }
  c10::Stream exchangeStream(c10::Stream) const override { return c10::Stream(c10::Stream::DEFAULT, kFakeDevice); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    std::unique_ptr<FakeEvent> owned(static_cast<FakeEvent*>(event));
  }
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) *event = std::make_unique<FakeEvent>().release();  // owned by the c10::Event
    auto* e = static_cast<FakeEvent*>(*event);
    e->done = false;  // a new use: completes when the test says
    e->records += 1;
  }
  void block(void*, const c10::Stream&) const override { g_blocks += 1; }
  bool queryEvent(void* event) const override {
    auto* e = static_cast<FakeEvent*>(event);
    if (e == nullptr) return true;
    TORCH_CHECK(!e->fail.load(), "fake device: device-side assert triggered (a dead context)");
    if (e->queries_left.load() >= 0 && e->queries_left-- == 0) e->done = true;
    return e->done.load();
  }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, FakeGuard);

FakeEvent& fake(const c10::Event& event) { return *static_cast<FakeEvent*>(event.eventId()); }

c10::Stream stream(c10::StreamId id) { return c10::Stream(c10::Stream::UNSAFE, kFakeDevice, id); }

// An event recorded on stream `id`: running until the test completes it.
std::shared_ptr<c10::Event> running_event(c10::StreamId id = 1) {
  auto e = std::make_shared<c10::Event>(kFake);
  e->record(stream(id));
  return e;
}

std::atomic<int> g_freed{0};  // fake device blocks let go
void free_block(void* ctx) {
  std::free(ctx);
  g_freed += 1;
}
c10::Storage fake_block(size_t bytes = 256) {
  void* p = std::malloc(bytes);
  at::DataPtr data(p, p, &free_block, kFakeDevice);
  return c10::Storage(c10::Storage::use_byte_size_t(), static_cast<int64_t>(bytes), std::move(data), nullptr, false);
}

const hsoffload::KeepAlive::Capturing kNoCapture = [](c10::Device) { return false; };

// The switch sees our allocations and torch's: a test below that passes proves something.
void test_the_switch_fails_allocations() {
  int64_t ours = 0, torchs = 0;
  {
    FailFromNow failing;
    try {
      std::vector<int> v;
      v.push_back(1);
    } catch (const std::bad_alloc&) {
      ours = FailFromNow::attempts();
    }
    try {
      auto e = std::make_shared<c10::Event>(kFake);
    } catch (const std::bad_alloc&) {
    }
    try {
      c10::Storage s = fake_block();  // torch's make_intrusive<StorageImpl>
    } catch (const std::bad_alloc&) {
      torchs = FailFromNow::attempts() - ours - 1;
    }
  }
  EXPECT(ours == 1);
  EXPECT(torchs >= 1);
}

// ---------------------------------------------------------------------------
// KeepAlive

void test_reap_allocates_nothing() {
  hsoffload::KeepAlive uses;
  auto copied = running_event();
  auto written = running_event();
  for (int i = 0; i < 3; ++i) {
    uses.reserve_hold();
    uses.hold_source(fake_block(), copied);
  }
  uses.reserve_hold();
  uses.hold_restore(fake_block(), written, stream(0));
  uses.reserve_hold();
  uses.hold_consumer(fake_block(), stream(2), stream(0));  // nothing else references it: reap marks its use
  const int freed = g_freed;
  fake(*copied).done = true;
  fake(*written).done = true;
  {
    FailFromNow failing;
    uses.reap();  // 3 sources and the restore go; the consumer's use is marked (recorded on stream 2), not done
    EXPECT(FailFromNow::attempts() == 0);
  }
  EXPECT(g_freed - freed == 4);
  EXPECT(uses.size() == 1);
  // The consumer's event, made at its hold, is recorded again (no new one) and completes.
  uses.reap();
  EXPECT(uses.size() == 1);
}

void test_release_calls_allocate_nothing() {
  hsoffload::KeepAlive uses;
  for (int i = 0; i < 4; ++i) {
    uses.reserve_hold();
    uses.hold_restore(fake_block(), running_event(), stream(0));
    uses.reserve_hold();
    uses.hold_consumer(fake_block(), stream(2), stream(0));
    uses.reserve_hold();
    uses.hold_source(fake_block(), running_event());
  }
  const int freed = g_freed;
  const int blocks = g_blocks;
  {
    FailFromNow failing;
    uses.release_restores(kNoCapture);  // each: the owner waits for the copy on the device
    EXPECT(FailFromNow::attempts() == 0);
  }
  EXPECT(g_freed - freed == 4 && uses.size() == 8);
  EXPECT(g_blocks - blocks == 4);
  {
    FailFromNow failing;
    uses.release_consumers(kNoCapture);  // each: marked on its consumer stream now, the owner waits for it
    EXPECT(FailFromNow::attempts() == 0);
  }
  EXPECT(g_freed - freed == 8 && uses.size() == 4);
  EXPECT(g_blocks - blocks == 8);
}

void test_drop_failed_allocates_nothing() {
  hsoffload::KeepAlive uses;
  auto dead = running_event();
  auto alive = running_event();
  fake(*dead).fail = true;
  for (int i = 0; i < 3; ++i) {
    uses.reserve_hold();
    uses.hold_source(fake_block(), dead);
  }
  uses.reserve_hold();
  uses.hold_source(fake_block(), alive);
  const int freed = g_freed;
  {
    FailFromNow failing;
    uses.drop_failed();  // a raising query: c10::Error's message allocates inside torch; none of ours does
    // The dead context's exception itself is torch's (its message): caught in events.h. What is counted here is
    // therefore at most torch's, and never terminates; the KeepAlive adds nothing.
  }
  EXPECT(g_freed - freed == 3 && uses.size() == 1);
  fake(*alive).done = true;
  uses.reap();
  EXPECT(uses.empty());
}

void test_release_all_allocates_nothing() {
  hsoffload::KeepAlive uses;
  auto copied = running_event();
  fake(*copied).queries_left = 3;  // the host wait for a running source polls, sleeping, until done
  for (int i = 0; i < 2; ++i) {
    uses.reserve_hold();
    uses.hold_source(fake_block(), copied);
    uses.reserve_hold();
    uses.hold_restore(fake_block(), running_event(), stream(0));
    uses.reserve_hold();
    uses.hold_consumer(fake_block(), stream(2), stream(0));
  }
  const int freed = g_freed;
  {
    FailFromNow failing;
    uses.release_all(kNoCapture);
    EXPECT(FailFromNow::attempts() == 0);
  }
  EXPECT(g_freed - freed == 6 && uses.empty());
  EXPECT(fake(*copied).done.load());
}

// A device whose stream captures keeps its blocks held through the release calls (and the test's capturing
// function, like the scope's, allocates nothing either).
void test_capturing_device_keeps_its_blocks() {
  hsoffload::KeepAlive uses;
  uses.reserve_hold();
  uses.hold_restore(fake_block(), running_event(), stream(0));
  const hsoffload::KeepAlive::Capturing capturing = [](c10::Device) { return true; };
  const int freed = g_freed;
  {
    FailFromNow failing;
    uses.release_all(capturing);
    EXPECT(FailFromNow::attempts() == 0);
  }
  EXPECT(g_freed == freed && uses.size() == 1);
  uses.release_all(kNoCapture);
  EXPECT(uses.empty());
}

// Sources still copying at a scope's exit are let go by the reaper's thread once their copy is done, with no call
// into the engine; its thread allocates nothing meanwhile (it runs while every allocation fails).
void test_reaper_lets_go_at_copy_speed() {
  hsoffload::SourceReaper& reaper = hsoffload::SourceReaper::instance();
  hsoffload::KeepAlive uses;
  auto first = running_event();
  auto second = running_event();
  auto done = running_event();
  fake(*done).done = true;
  for (const auto& e : {first, first, second, done}) {
    uses.reserve_hold();
    uses.hold_source(fake_block(), e);
  }
  auto dead = running_event();
  fake(*dead).fail = true;
  uses.reserve_hold();
  uses.hold_source(fake_block(), dead);
  const int freed = g_freed;
  const int64_t released = reaper.released();
  const hsoffload::KeepAlive::Capturing capturing = [](c10::Device) { return false; };
  uses.hand_off_sources(reaper, capturing);  // may allocate (it is not a noexcept path)
  EXPECT(uses.size() == 1);                  // the failed one stays for the caller's drop_failed
  const auto wait_for = [&](int n) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (g_freed - freed < n && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };
  {
    FailFromNow failing;
    wait_for(1);  // the one done since the caller's reap goes at once
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT(g_freed - freed == 1);  // the others still copying: held
    fake(*first).done = true;
    wait_for(3);
    EXPECT(g_freed - freed == 3);
    EXPECT(FailFromNow::attempts() == 0);
  }
  fake(*second).fail = true;  // a failed query (its c10::Error allocates: outside the failing region) never lets go
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT(g_freed - freed == 3);
  {
    FailFromNow failing;
    fake(*second).fail = false;
    fake(*second).done = true;
    wait_for(4);  // asked again within 100 ms
    EXPECT(g_freed - freed == 4);
    EXPECT(FailFromNow::attempts() == 0);
  }
  EXPECT(reaper.pending() == 0 && reaper.released() - released == 4);
  uses.drop_failed();
  EXPECT(uses.empty());
}

// ---------------------------------------------------------------------------
// Host pool, budget, handle and scope

std::shared_ptr<hsoffload::HostPool> cpu_pool(int64_t limit) {
  return hsoffload::HostPool::create(limit, [](int64_t bytes, bool) { return at::empty({bytes}, at::kByte); });
}

void test_host_block_give_back_allocates_nothing() {
  auto pool = cpu_pool(int64_t{1} << 30);
  const int64_t k = 4096;
  std::vector<hsoffload::HostBlock> blocks;
  for (int i = 0; i < 6; ++i) blocks.push_back(pool->acquire(k, false));
  auto copying = running_event();
  blocks[1].record_use(copying);  // given back while its copy runs: pending
  blocks[4].record_use(running_event());
  {
    FailFromNow failing;
    // Out of order, so that each kind of coalescing happens: no free neighbour, a free next, a free previous, both.
    blocks[3] = hsoffload::HostBlock();  // move-assignment: gives the old block back
    blocks[1] = hsoffload::HostBlock();  // pending
    blocks[2] = hsoffload::HostBlock();
    blocks[0] = hsoffload::HostBlock();
    blocks[5] = hsoffload::HostBlock();
    blocks[4] = hsoffload::HostBlock();  // pending
    EXPECT(FailFromNow::attempts() == 0);
  }
  EXPECT(pool->stats().in_use_bytes == 0);
  fake(*copying).done = true;
  EXPECT(pool->free_bytes(false) == pool->stats().held_bytes - 2 * k + k);  // one still pending
  // Multi-extent blocks (fragments of several slabs) come back the same way.
  auto a = pool->acquire(k, false);
  auto b = pool->acquire(k, false);
  auto c = pool->acquire(k, false);
  b = hsoffload::HostBlock();
  auto big = pool->acquire(pool->free_bytes(false) - 512, false);  // every free range: several extents
  EXPECT(big.extents().size() >= 2);
  {
    FailFromNow failing;
    big = hsoffload::HostBlock();
    a = hsoffload::HostBlock();
    c = hsoffload::HostBlock();
    EXPECT(FailFromNow::attempts() == 0);
  }
  EXPECT(pool->stats().in_use_bytes == 0);
  blocks.clear();
}

void test_trim_on_give_back_allocates_nothing() {
  auto pool = cpu_pool(int64_t{1} << 30);
  auto a = pool->acquire(3000, false);
  auto b = pool->acquire(int64_t{3} << 20, false);  // a second slab
  auto c = pool->acquire(3000, false);
  auto copying = running_event();
  c.record_use(copying);
  c = hsoffload::HostBlock();  // pending while its copy runs
  pool->set_limit(0);          // lent or pending: their slabs stay
  fake(*copying).done = true;  // the trim of the give-back below reaps it first
  const int64_t held = pool->stats().held_bytes;
  EXPECT(held > 0);
  {
    FailFromNow failing;
    a = hsoffload::HostBlock();  // over the limit: its slab is freed by the give-back (trim)
    b = hsoffload::HostBlock();
    EXPECT(FailFromNow::attempts() == 0);
  }
  EXPECT(pool->stats().held_bytes == 0 && pool->stats().slabs == 0);
}

void test_lease_release_allocates_nothing() {
  auto budget = hsoffload::HostBudget::create(1000);
  hsoffload::HostLease a, b;
  EXPECT(budget->try_reserve(600, a));
  EXPECT(budget->try_reserve(300, b));
  {
    FailFromNow failing;
    a = hsoffload::HostLease();  // move-assignment
    { hsoffload::HostLease gone = std::move(b); }  // destructor
    EXPECT(FailFromNow::attempts() == 0);
  }
  EXPECT(budget->stats().in_flight == 0);
}

void test_handle_and_scope_destructors_allocate_nothing() {
  auto pool = cpu_pool(int64_t{1} << 30);
  auto budget = hsoffload::HostBudget::create(int64_t{1} << 30);
  hsoffload::OffloadConfig config;
  config.offload_cpu_tensors = true;
  config.min_offload_size = 0;
  auto scope = hsoffload::OffloadScope::create(config, pool, budget);
  scope->enter();
  at::Tensor x = at::randn({64, 64});
  scope->mark(x);
  auto handle = scope->pack(x);
  EXPECT(handle->offloaded());
  at::Tensor y = handle->unpack();
  EXPECT(at::equal(x, y));
  scope->exit();
  y = at::Tensor();
  EXPECT(pool->stats().in_use_bytes > 0 && budget->stats().in_flight > 0);
  std::weak_ptr<hsoffload::OffloadScope> weak = scope;
  {
    FailFromNow failing;
    handle.reset();  // the last handle: its record, host block and budget lease go
    EXPECT(FailFromNow::attempts() == 0);
  }
  EXPECT(pool->stats().in_use_bytes == 0 && budget->stats().in_flight == 0);
  {
    FailFromNow failing;
    scope.reset();  // ~OffloadScope: KeepAlive::release_all, the registry entry
    EXPECT(FailFromNow::attempts() == 0);
  }
  EXPECT(weak.expired());
}

}  // namespace

int main() {
  test_the_switch_fails_allocations();
  test_reap_allocates_nothing();
  test_release_calls_allocate_nothing();
  test_drop_failed_allocates_nothing();
  test_release_all_allocates_nothing();
  test_capturing_device_keeps_its_blocks();
  test_reaper_lets_go_at_copy_speed();
  test_host_block_give_back_allocates_nothing();
  test_trim_on_give_back_allocates_nothing();
  test_lease_release_allocates_nothing();
  test_handle_and_scope_destructors_allocate_nothing();
  EXPECT_DONE("test_noexcept_paths");
}
