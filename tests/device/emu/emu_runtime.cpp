// hsemu runtime: streams, events, allocators. See emu_runtime.h for the semantics.
#include "emu_runtime.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace hsemu {
namespace {

constexpr size_t kAlign = 512;

size_t round_up(size_t n) { return (std::max<size_t>(n, 1) + kAlign - 1) / kAlign * kAlign; }

// ---- counters ------------------------------------------------------------------

std::mutex& counters_mutex() {
  static std::mutex m;
  return m;
}
Counters& counters_locked() {
  static Counters c;
  return c;
}

// ---- streams -------------------------------------------------------------------

// One stream: a thread that runs queued jobs in order.
class Worker {
 public:
  Worker() : thread_([this] { run(); }) {}
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  uint64_t enqueue(std::function<void()> job) {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(job));
    ++enqueued_;
    cv_.notify_all();
    return enqueued_;
  }
  uint64_t enqueued() {
    std::lock_guard<std::mutex> lock(mutex_);
    return enqueued_;
  }
  bool done(uint64_t ticket) {
    std::lock_guard<std::mutex> lock(mutex_);
    return completed_ >= ticket;
  }
  void wait(uint64_t ticket) {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return completed_ >= ticket; });
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return !queue_.empty(); });
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        job();
      } catch (const std::exception& e) {
        count(&Counters::job_errors);
        std::fprintf(stderr, "hsemu: a queued job failed: %s\n", e.what());
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++completed_;
      }
      cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t enqueued_ = 0;
  uint64_t completed_ = 0;
  std::thread thread_;  // last: starts after the members it uses exist; never joined (see streams())
};

struct Streams {
  std::mutex mutex;
  std::unordered_map<c10::StreamId, std::unique_ptr<Worker>> workers;
};

// Never destroyed, on purpose: worker threads run until the process ends, and
// tensor deleters (which queue poison jobs) may run during static destruction.
Streams& streams() {
  static Streams* s = new Streams();  // intentionally leaked, see above
  return *s;
}

Worker& worker(c10::StreamId id) {
  TORCH_CHECK(id >= 0, "hsemu: invalid stream id ", id);
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto& slot = s.workers[id];
  if (!slot) {
    slot = std::make_unique<Worker>();
  }
  return *slot;
}

thread_local c10::StreamId tls_stream = 0;  // CUDA keeps the current stream per thread too
std::atomic<c10::StreamId> next_pool{0};
std::atomic<c10::StreamId> next_high_pool{0};
std::atomic<c10::StreamId> next_new{kFirstNewStream};

// ---- delays ---------------------------------------------------------------------

int64_t delay_from_env() {
  const char* v = std::getenv("HSOFFLOAD_EMU_COPY_DELAY_US");
  return v ? std::max<int64_t>(0, std::atoll(v)) : 0;
}
std::atomic<int64_t>* delays() {
  static std::atomic<int64_t> d[3] = {delay_from_env(), delay_from_env(), delay_from_env()};
  return d;
}

// Process-wide like the delays: the emulated bus every stream's copies share; atomics, set by the test thread and
// read by whichever thread queues a copy.
std::atomic<int64_t>* rates() {
  static std::atomic<int64_t> r[3] = {0, 0, 0};
  return r;
}

// ---- device allocator -------------------------------------------------------------

struct Block {
  void* ptr = nullptr;
  size_t size = 0;
  size_t handed_out = 0;                 // the rounded request it serves now (<= size when a larger block is reused)
  c10::StreamId stream = 0;              // allocation stream: owns the block
  std::vector<c10::StreamId> uses;       // other streams recorded by record_stream
};

void free_device(void* ptr);

class DeviceAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const c10::Device device(c10::DeviceType::PrivateUse1, 0);
    if (n == 0) {
      return {nullptr, nullptr, &free_device, device};
    }
    const size_t size = round_up(n);
    const c10::StreamId stream = current_stream();
    const int64_t capacity = device_capacity();
    if (capacity > 0) {
      const int64_t in_use = counters().allocated_bytes;
      TORCH_CHECK_WITH(OutOfMemoryError, in_use + static_cast<int64_t>(size) <= capacity,
                       "hsemu: out of device memory: tried to allocate ", size, " bytes with ", in_use, " of ",
                       capacity, " bytes in use (emulated capacity, set_device_capacity)");
    }
    Block block;
    bool reused = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      reclaim_locked();
      // Most recently freed first, so a freed block is reused as soon as possible.
      for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
        if (it->stream == stream && it->size >= size && it->size <= 2 * size) {
          block = std::move(*it);
          free_.erase(std::next(it).base());
          reused = true;
          break;
        }
      }
      if (!reused) {
        block.ptr = std::aligned_alloc(kAlign, size);
        TORCH_CHECK(block.ptr != nullptr, "hsemu: out of host memory allocating ", size, " bytes");
        std::memset(block.ptr, kPoison, size);
        block.size = size;
      }
      block.stream = stream;
      block.handed_out = size;
      block.uses.clear();
      live_.emplace(block.ptr, block);
    }
    count(&Counters::device_allocs);
    count_allocated(static_cast<int64_t>(size));
    if (reused) {
      count(&Counters::device_reuses);
    }
    return {block.ptr, block.ptr, &free_device, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_device; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  void free(void* ptr) {
    if (ptr == nullptr) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(ptr);
    TORCH_INTERNAL_ASSERT(it != live_.end(), "hsemu: freeing a block the device allocator does not own");
    // As CUDA's caching allocator does (insert_events): a block other streams were recorded on gets an event
    // recorded on each of them, which raises on a dead context (a sticky error) -- here, from the DataPtr's
    // deleter inside a noexcept destructor: std::terminate, as on a GPU.
    const bool foreign_use = std::any_of(it->second.uses.begin(), it->second.uses.end(),
                                         [&](c10::StreamId use) { return use != it->second.stream; });
    TORCH_CHECK(!(foreign_use && event_fault()), "hsemu: device-side assert triggered (emulated sticky error, "
                "set_event_fault): recording the stream uses of a freed block");
    Block block = std::move(it->second);
    live_.erase(it);
    count_allocated(-static_cast<int64_t>(block.handed_out));
    Pending pending;
    for (c10::StreamId use : block.uses) {
      const bool seen = std::any_of(pending.waits.begin(), pending.waits.end(),
                                    [&](const auto& w) { return w.first == use; });
      if (use != block.stream && !seen) {
        pending.waits.emplace_back(use, enqueued(use));  // the work that stream had queued at the free
      }
    }
    if (pending.waits.empty()) {
      release_locked(std::move(block));
    } else {
      pending.block = std::move(block);
      pending_.push_back(std::move(pending));
      count(&Counters::deferred_frees);
    }
  }

  void record_stream(const void* ptr, c10::StreamId id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(const_cast<void*>(ptr));
    TORCH_CHECK(it != live_.end(), "hsemu: record_stream on a pointer that is not the start of a live device block");
    it->second.uses.push_back(id);
  }

 private:
  struct Pending {
    Block block;
    std::vector<std::pair<c10::StreamId, uint64_t>> waits;
  };

  // Poisons the block after the work its stream has queued so far, then makes
  // it reusable by that stream.
  void release_locked(Block block) {
    void* ptr = block.ptr;
    const size_t size = block.size;
    enqueue(block.stream, [ptr, size] { std::memset(ptr, kPoison, size); });
    free_.push_back(std::move(block));
  }

  void reclaim_locked() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      const bool ready = std::all_of(it->waits.begin(), it->waits.end(),
                                     [](const auto& w) { return done(w.first, w.second); });
      if (ready) {
        release_locked(std::move(it->block));
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
  }

  std::mutex mutex_;
  std::unordered_map<void*, Block> live_;
  // Freed blocks, oldest first. Device memory is never returned to the system:
  // a test process is short and its working set small.
  std::vector<Block> free_;
  std::vector<Pending> pending_;
};

DeviceAllocator& device_allocator_impl() {
  static DeviceAllocator* a = new DeviceAllocator();  // intentionally leaked: deleters run at exit
  return *a;
}

void free_device(void* ptr) { device_allocator_impl().free(ptr); }

// ---- pinned host allocator ---------------------------------------------------------

void free_pinned(void* ptr);

class PinnedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) {
      return {nullptr, nullptr, &free_pinned, cpu};
    }
    const size_t size = round_up(n);
    if (any_capturing()) {
      capture_violation("pinned host allocation of " + std::to_string(n) + " bytes");
    }
    TORCH_CHECK(!pinned_alloc_fault(), "hsemu: pinned host allocation of ", n,
                " bytes failed (emulated: out of pinnable memory, set_pinned_alloc_fault)");
    std::lock_guard<std::mutex> lock(mutex_);
    void* ptr = nullptr;
    for (auto it = idle_.rbegin(); it != idle_.rend(); ++it) {
      Entry& e = blocks_.at(*it);
      if (e.size >= size && e.size <= 2 * size && uses_done(e)) {
        ptr = reinterpret_cast<void*>(*it);
        idle_.erase(std::next(it).base());
        break;
      }
    }
    if (ptr == nullptr) {
      ptr = std::aligned_alloc(kAlign, size);
      TORCH_CHECK(ptr != nullptr, "hsemu: out of host memory allocating ", size, " pinned bytes");
      blocks_[reinterpret_cast<uintptr_t>(ptr)] = Entry{size, {}, true};
    }
    Entry& e = blocks_.at(reinterpret_cast<uintptr_t>(ptr));
    e.live = true;
    e.uses.clear();
    std::memset(ptr, kPoison, e.size);  // memory nobody wrote is garbage
    return {ptr, ptr, &free_pinned, cpu};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  void free(void* ptr) {
    if (ptr == nullptr) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    Entry& e = blocks_.at(reinterpret_cast<uintptr_t>(ptr));
    e.live = false;
    if (!uses_done(e)) {
      count(&Counters::pinned_deferred_frees);
    }
    idle_.push_back(reinterpret_cast<uintptr_t>(ptr));
  }

  bool contains(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    return find_locked(ptr) != nullptr;
  }

  void record_use(const void* ptr, c10::StreamId id, uint64_t ticket) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (Entry* e = find_locked(ptr)) {
      e->uses.emplace_back(id, ticket);
    }
  }

  void empty_cache() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = idle_.begin(); it != idle_.end();) {
      auto b = blocks_.find(*it);
      if (uses_done(b->second)) {
        std::free(reinterpret_cast<void*>(b->first));
        blocks_.erase(b);
        it = idle_.erase(it);
      } else {
        ++it;
      }
    }
  }

 private:
  struct Entry {
    size_t size = 0;
    std::vector<std::pair<c10::StreamId, uint64_t>> uses;  // queued copies that touch the block
    bool live = false;
  };

  static bool uses_done(const Entry& e) {
    return std::all_of(e.uses.begin(), e.uses.end(), [](const auto& u) { return done(u.first, u.second); });
  }

  // The live block containing `ptr`, or null.
  Entry* find_locked(const void* ptr) {
    const auto p = reinterpret_cast<uintptr_t>(ptr);
    auto it = blocks_.upper_bound(p);
    if (it == blocks_.begin()) {
      return nullptr;
    }
    --it;
    return (it->second.live && p < it->first + it->second.size) ? &it->second : nullptr;
  }

  std::mutex mutex_;
  std::map<uintptr_t, Entry> blocks_;  // every block owned, by address (for is_pinned lookups)
  std::vector<uintptr_t> idle_;        // freed blocks, oldest first
};

PinnedAllocator& pinned_allocator_impl() {
  static PinnedAllocator* a = new PinnedAllocator();  // intentionally leaked: deleters run at exit
  return *a;
}

void free_pinned(void* ptr) { pinned_allocator_impl().free(ptr); }

}  // namespace

uint64_t enqueue(c10::StreamId id, std::function<void()> job) { return worker(id).enqueue(std::move(job)); }
uint64_t enqueued(c10::StreamId id) { return worker(id).enqueued(); }
bool done(c10::StreamId id, uint64_t ticket) { return worker(id).done(ticket); }
void wait(c10::StreamId id, uint64_t ticket) { worker(id).wait(ticket); }
void drain(c10::StreamId id) {
  Worker& w = worker(id);
  w.wait(w.enqueued());
}

void drain_all() {
  // Waiting on one stream can make another stream's queued waits finish, so
  // repeat until a pass finds every stream idle.
  for (;;) {
    std::vector<Worker*> all;
    {
      Streams& s = streams();
      std::lock_guard<std::mutex> lock(s.mutex);
      for (auto& entry : s.workers) all.push_back(entry.second.get());
    }
    bool idle = true;
    for (Worker* w : all) {
      const uint64_t n = w->enqueued();
      if (!w->done(n)) {
        idle = false;
        w->wait(n);
      }
    }
    if (idle) {
      return;
    }
  }
}

c10::StreamId current_stream() { return tls_stream; }
void set_current_stream(c10::StreamId id) {
  TORCH_CHECK_VALUE(id >= 0, "hsemu: stream ids are >= 0, got ", id);
  tls_stream = id;
}
c10::StreamId next_pool_stream(bool high_priority) {
  if (high_priority) return kHighPriorityPool + (next_high_pool++ % kPoolStreams);
  return 1 + (next_pool++ % kPoolStreams);
}
bool is_high_priority(c10::StreamId id) { return id >= kHighPriorityPool && id < kHighPriorityPool + kPoolStreams; }

namespace {
std::atomic<bool> event_fault_on{false};
std::atomic<int64_t> capacity_bytes{0};
}  // namespace
std::atomic<bool> pinned_fault_on{false};
void set_pinned_alloc_fault(bool on) { pinned_fault_on.store(on); }
bool pinned_alloc_fault() { return pinned_fault_on.load(); }
void set_event_fault(bool on) { event_fault_on.store(on); }
bool event_fault() { return event_fault_on.load(); }
void set_device_capacity(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes >= 0, "hsemu: device capacity must be >= 0 bytes (0: unlimited), got ", bytes);
  capacity_bytes.store(bytes);
}
int64_t device_capacity() { return capacity_bytes.load(); }
c10::StreamId new_stream() { return next_new++; }

int64_t copy_delay_us(CopyKind kind) { return delays()[static_cast<int>(kind)].load(); }
void set_copy_delay_us(CopyKind kind, int64_t us) {
  TORCH_CHECK_VALUE(us >= 0, "hsemu: a copy delay must be >= 0 microseconds, got ", us);
  delays()[static_cast<int>(kind)].store(us);
}
int64_t copy_rate_bytes_per_s(CopyKind kind) { return rates()[static_cast<int>(kind)].load(); }
void set_copy_rate_bytes_per_s(CopyKind kind, int64_t bytes_per_s) {
  TORCH_CHECK_VALUE(bytes_per_s >= 0, "hsemu: a copy rate must be >= 0 bytes/s (0: unlimited), got ", bytes_per_s);
  rates()[static_cast<int>(kind)].store(bytes_per_s);
}
int64_t copy_sleep_us(CopyKind kind, int64_t nbytes) {
  const int64_t rate = copy_rate_bytes_per_s(kind);
  const int64_t by_rate = rate > 0 ? static_cast<int64_t>(static_cast<double>(nbytes) * 1e6 / static_cast<double>(rate))
                                   : 0;
  return copy_delay_us(kind) + by_rate;
}

c10::Allocator* device_allocator() { return &device_allocator_impl(); }
void record_stream(const void* ptr, c10::StreamId id) { device_allocator_impl().record_stream(ptr, id); }

c10::Allocator* pinned_allocator() { return &pinned_allocator_impl(); }
bool is_pinned(const void* ptr) { return ptr != nullptr && pinned_allocator_impl().contains(ptr); }
void record_pinned_use(const void* ptr, c10::StreamId id, uint64_t ticket) {
  pinned_allocator_impl().record_use(ptr, id, ticket);
}
void empty_pinned_cache() { pinned_allocator_impl().empty_cache(); }

namespace {
struct CaptureState {
  std::mutex mutex;
  c10::StreamId origin = -1;        // the capturing stream, -1: none
  std::vector<c10::StreamId> joined;  // streams that joined the capture and were not joined back
  std::vector<std::string> violations;
};
CaptureState& capture_state() {
  static CaptureState s;
  return s;
}
}  // namespace

void begin_capture(c10::StreamId id) {
  CaptureState& c = capture_state();
  std::lock_guard<std::mutex> lock(c.mutex);
  TORCH_CHECK(c.origin < 0, "hsemu.begin_capture: stream ", c.origin, " is capturing already (one at a time)");
  c.origin = id;
  c.joined.clear();
  c.violations.clear();
}

std::vector<std::string> end_capture(c10::StreamId id) {
  CaptureState& c = capture_state();
  std::lock_guard<std::mutex> lock(c.mutex);
  TORCH_CHECK(c.origin == id, "hsemu.end_capture: stream ", id, " is not capturing");
  std::vector<std::string> out = std::move(c.violations);
  for (c10::StreamId s : c.joined) {
    out.push_back("stream " + std::to_string(s) + " joined the capture and was never joined back (unjoined fork)");
  }
  c.origin = -1;
  c.joined.clear();
  c.violations.clear();
  return out;
}

bool is_capturing(c10::StreamId id) {
  CaptureState& c = capture_state();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.origin >= 0 && (id == c.origin || std::find(c.joined.begin(), c.joined.end(), id) != c.joined.end());
}

bool any_capturing() {
  CaptureState& c = capture_state();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.origin >= 0;
}

void capture_violation(const std::string& what) {
  CaptureState& c = capture_state();
  std::lock_guard<std::mutex> lock(c.mutex);
  if (c.origin >= 0) {
    c.violations.push_back(what);
  }
}

void capture_wait(const Event& e, c10::StreamId to) {
  CaptureState& c = capture_state();
  std::lock_guard<std::mutex> lock(c.mutex);
  if (c.origin < 0 || e.stream < 0) {
    return;
  }
  const auto joined = [&](c10::StreamId s) {
    return s == c.origin || std::find(c.joined.begin(), c.joined.end(), s) != c.joined.end();
  };
  if (e.captured && !joined(to)) {
    c.joined.push_back(to);  // fork: `to` now belongs to the capture and must be joined back
  } else if (!e.captured && joined(to)) {
    c.violations.push_back("capturing stream " + std::to_string(to) + " waited on an event recorded outside the "
                           "capture (on stream " + std::to_string(e.stream) + ")");
  } else if (e.captured && to == c.origin && e.stream != c.origin) {
    c.joined.erase(std::remove(c.joined.begin(), c.joined.end(), e.stream), c.joined.end());  // joined back
  }
}

Counters counters() {
  std::lock_guard<std::mutex> lock(counters_mutex());
  return counters_locked();
}
void count(int64_t Counters::*field, int64_t n) {
  std::lock_guard<std::mutex> lock(counters_mutex());
  counters_locked().*field += n;
}
void count_allocated(int64_t delta) {
  std::lock_guard<std::mutex> lock(counters_mutex());
  Counters& c = counters_locked();
  c.allocated_bytes += delta;
  c.peak_allocated_bytes = std::max(c.peak_allocated_bytes, c.allocated_bytes);
}
void reset_peak_allocated() {
  std::lock_guard<std::mutex> lock(counters_mutex());
  Counters& c = counters_locked();
  c.peak_allocated_bytes = c.allocated_bytes;
}

}  // namespace hsemu
