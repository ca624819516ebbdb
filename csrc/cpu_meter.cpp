// The CPU meter (cpu_meter.h).
#include "hsoffload/cpu_meter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>

namespace hsoffload {
namespace {

// The counters (process-wide: there is one CPU allocator). Atomics: allocations and frees come from every thread.
struct Counters {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> host{0};
};

Counters& counters() {
  static Counters c;  // trivially destructible: frees after exit's destructors still find it
  return c;
}

thread_local bool t_host_allocation = false;  // this thread is inside a HostAllocation

void raise_peak(Counters& c, int64_t now) {
  int64_t seen = c.peak.load();
  while (now > seen && !c.peak.compare_exchange_weak(seen, now)) {
  }
}

// Storage for an object built once and never destroyed: blocks the meter lent are freed until the process's very
// end (other libraries' static destructors, the host pool's among them), after any static destructor of ours would
// have run. Placement new into static storage: no heap allocation, nothing to free.
template <typename T>
class NoDestructor {
 public:
  template <typename... Args>
  explicit NoDestructor(Args&&... args) {
    new (storage_) T(std::forward<Args>(args)...);
  }
  NoDestructor(const NoDestructor&) = delete;
  NoDestructor& operator=(const NoDestructor&) = delete;
  T& get() { return *std::launder(reinterpret_cast<T*>(storage_)); }

 private:
  alignas(T) unsigned char storage_[sizeof(T)];
};

// What each counted block is uncounted by at its free: its bytes, and whether they were host memory. Keyed by the
// data pointer, since the CPU allocator's blocks must be their own context (raw_allocate asserts it). Striped by
// pointer, so that threads allocating at once (intra-op workers) rarely share a lock.
struct Lent {
  int64_t bytes;
  bool host;
};

constexpr size_t kStripes = 16;

struct Stripe {
  std::mutex mutex;
  std::unordered_map<void*, Lent> blocks;  // guarded by mutex
};

struct Ledger {
  std::array<Stripe, kStripes> stripes;
  c10::DeleterFnPtr inner_free = nullptr;  // the inner allocator's raw deleter (set once, before any block)
  c10::Allocator* meter = nullptr;         // the counting allocator, once installed

  Stripe& stripe(void* data) { return stripes[(reinterpret_cast<uintptr_t>(data) >> 6) % kStripes]; }
};

Ledger& ledger() {
  static NoDestructor<Ledger> l;  // process-wide, like the allocator it serves; never destroyed (see NoDestructor)
  return l.get();
}

void give_back(void* data) {
  Ledger& l = ledger();
  Stripe& stripe = l.stripe(data);
  Lent lent{0, false};
  {
    const std::lock_guard<std::mutex> lock(stripe.mutex);
    const auto it = stripe.blocks.find(data);
    if (it != stripe.blocks.end()) {
      lent = it->second;
      stripe.blocks.erase(it);
    }
  }
  (lent.host ? counters().host : counters().allocated).fetch_sub(lent.bytes);
  l.inner_free(data);
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    if (data == nullptr || inner.get_context() != data || inner.get_deleter() != ledger().inner_free) {
      return inner;  // nothing lent (n == 0), or a block that is not its own context: passed on uncounted
    }
    const auto bytes = static_cast<int64_t>(n);
    const bool host = t_host_allocation;
    Stripe& stripe = ledger().stripe(data);
    {
      const std::lock_guard<std::mutex> lock(stripe.mutex);
      stripe.blocks[data] = Lent{bytes, host};  // before the block changes hands: a throw here leaves it with inner
    }
    const c10::Device device = inner.device();
    inner.release_context();  // the block is its own context: from here on give_back frees it
    Counters& c = counters();
    if (host) {
      c.host.fetch_add(bytes);
    } else {
      raise_peak(c, c.allocated.fetch_add(bytes) + bytes);
    }
    return {data, data, &give_back, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &give_back; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

 private:
  c10::Allocator* inner_;  // the CPU allocator this one stands in front of (c10's: lives as long as the process)
};

}  // namespace

bool install_cpu_meter() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::Allocator* inner = c10::GetAllocator(c10::DeviceType::CPU);
    if (inner->raw_deleter() == nullptr) {
      return;  // blocks that are not their own context cannot be counted by pointer: not installed
    }
    ledger().inner_free = inner->raw_deleter();
    // Never destroyed: c10 keeps pointing at it until the process ends.
    static NoDestructor<CountingAllocator> meter(inner);
    ledger().meter = &meter.get();
    c10::SetAllocator(c10::DeviceType::CPU, &meter.get(), /*priority=*/0);
  });
  return cpu_meter_stats().installed != 0;
}

CpuMeterStats cpu_meter_stats() {
  const Counters& c = counters();
  CpuMeterStats s;
  // Installed, and still the CPU allocator (another library's SetAllocator would leave these counts frozen).
  s.installed = ledger().meter != nullptr && c10::GetAllocator(c10::DeviceType::CPU) == ledger().meter ? 1 : 0;
  s.allocated_bytes = c.allocated.load();
  s.peak_allocated_bytes = c.peak.load();
  s.host_bytes = c.host.load();
  return s;
}

void reset_cpu_meter_peak() {
  Counters& c = counters();
  c.peak = c.allocated.load();
}

HostAllocation::HostAllocation() : previous_(t_host_allocation) { t_host_allocation = true; }
HostAllocation::~HostAllocation() { t_host_allocation = previous_; }

}  // namespace hsoffload
