// The CPU meter (cpu_meter.h).
#include "hsoffload/cpu_meter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace hsoffload {
namespace {

// The counters (process-wide: there is one CPU allocator). Atomics: allocations and frees come from every thread.
struct Counters {
  std::atomic<bool> installed{false};
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

// What each counted block is uncounted by at its free: its bytes, and whether they were host memory. Keyed by the
// data pointer, since the CPU allocator's blocks must be their own context (raw_allocate asserts it).
struct Lent {
  int64_t bytes;
  bool host;
};

struct Ledger {
  std::mutex mutex;
  std::unordered_map<void*, Lent> blocks;  // guarded by mutex
  c10::DeleterFnPtr inner_free = nullptr;  // the inner allocator's raw deleter (set once, before any block)
};

Ledger& ledger() {
  static Ledger l;  // process-wide, like the allocator it serves
  return l;
}

void give_back(void* data) {
  Ledger& l = ledger();
  Lent lent{0, false};
  {
    const std::lock_guard<std::mutex> lock(l.mutex);
    const auto it = l.blocks.find(data);
    if (it != l.blocks.end()) {
      lent = it->second;
      l.blocks.erase(it);
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
    const c10::Device device = inner.device();
    if (data == nullptr) {
      return inner;  // nothing lent (n == 0)
    }
    inner.release_context();  // the block is its own context: from here on give_back frees it
    const auto bytes = static_cast<int64_t>(n);
    const bool host = t_host_allocation;
    {
      const std::lock_guard<std::mutex> lock(ledger().mutex);
      ledger().blocks[data] = Lent{bytes, host};
    }
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
    // Function-local static: outlives every allocation made before exit, and no storage ever points at it (frees go
    // through give_back).
    c10::Allocator* inner = c10::GetAllocator(c10::DeviceType::CPU);
    if (inner->raw_deleter() == nullptr) {
      return;  // blocks that are not their own context cannot be counted by pointer: not installed
    }
    ledger().inner_free = inner->raw_deleter();
    static CountingAllocator meter(inner);
    c10::SetAllocator(c10::DeviceType::CPU, &meter, /*priority=*/0);
    counters().installed = c10::GetAllocator(c10::DeviceType::CPU) == &meter;
  });
  return counters().installed;
}

CpuMeterStats cpu_meter_stats() {
  const Counters& c = counters();
  CpuMeterStats s;
  s.installed = c.installed ? 1 : 0;
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
