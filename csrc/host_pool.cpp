#include "hsoffload/host_pool.h"

#include <ATen/DeviceAccelerator.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <unistd.h>

#include <algorithm>
#include <utility>

namespace hsoffload {

at::Tensor default_host_alloc(int64_t bytes, bool pinned) {
  return at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCPU).pinned_memory(pinned));
}

HostBlock& HostBlock::operator=(HostBlock&& other) noexcept {
  if (this != &other) {
    release();
    buffer_ = std::move(other.buffer_);
    pinned_ = other.pinned_;
    pooled_ = other.pooled_;
    last_use_ = std::move(other.last_use_);
    pool_ = std::move(other.pool_);
  }
  return *this;
}

HostBlock::~HostBlock() { release(); }

at::Tensor HostBlock::view(int64_t bytes) const {
  TORCH_INTERNAL_ASSERT(buffer_.defined() && bytes <= buffer_.numel());
  return buffer_.narrow(0, 0, bytes);
}

void HostBlock::record_use(std::shared_ptr<c10::Event> event) { last_use_ = std::move(event); }

void HostBlock::release() {
  if (!buffer_.defined()) {
    return;
  }
  if (auto pool = pool_.lock()) {
    pool->give_back(std::move(buffer_), pinned_, pooled_, std::move(last_use_));
  }
  buffer_ = at::Tensor();
  last_use_.reset();
}

std::shared_ptr<HostPool> HostPool::create(int64_t max_bytes, HostAllocFn alloc) {
  TORCH_CHECK_VALUE(max_bytes >= 0, "HostPool: max_bytes must be >= 0, got ", max_bytes);
  return std::shared_ptr<HostPool>(new HostPool(max_bytes, std::move(alloc)));  // private ctor
}

HostPool::HostPool(int64_t max_bytes, HostAllocFn alloc) : max_bytes_(max_bytes), alloc_(std::move(alloc)) {}

int64_t HostPool::round_size(int64_t bytes) {
  constexpr int64_t kMinGranule = 512;
  int64_t pow2 = 1;
  while (pow2 < bytes) {
    pow2 <<= 1;
  }
  const int64_t granule = std::max(kMinGranule, pow2 / 32);
  return std::max<int64_t>(granule, (bytes + granule - 1) / granule * granule);
}

HostBlock HostPool::acquire(int64_t bytes, bool pinned) {
  const int64_t rounded = round_size(bytes);
  HostBlock block;
  block.pinned_ = pinned;
  block.pool_ = weak_from_this();
  std::unique_lock<std::mutex> lock(mutex_);
  auto& idle = idle_[pinned ? 1 : 0];
  // Best fit among idle buffers at most 1/16 larger than needed whose last
  // device use has completed.
  const int64_t max_fit = rounded + rounded / 16;
  for (auto it = idle.lower_bound(rounded); it != idle.end() && it->first <= max_fit; ++it) {
    if (it->second.last_use && !it->second.last_use->query()) {
      continue;
    }
    block.buffer_ = std::move(it->second.buffer);
    block.pooled_ = true;
    idle.erase(it);
    stats_.cached_bytes -= block.buffer_.numel();
    stats_.in_use_bytes += block.buffer_.numel();
    stats_.reuses += 1;
    return block;
  }
  // Miss: drop one idle buffer (the largest whose device use has completed) so
  // that buffers sized for an older working set do not accumulate.
  for (auto it = idle.rbegin(); it != idle.rend(); ++it) {
    if (!it->second.last_use || it->second.last_use->query()) {
      stats_.cached_bytes -= it->first;
      stats_.held_bytes -= it->first;
      idle.erase(std::next(it).base());
      break;
    }
  }
  if (stats_.held_bytes + rounded > max_bytes_) {
    trim_locked(std::max<int64_t>(0, max_bytes_ - rounded));
  }
  const bool pooled = stats_.held_bytes + rounded <= max_bytes_;
  lock.unlock();
  // Allocation can take milliseconds for pinned memory: do it unlocked.
  block.buffer_ = alloc_(rounded, pinned);
  block.pooled_ = pooled;
  lock.lock();
  stats_.allocations += 1;
  if (pooled) {
    stats_.held_bytes += rounded;
    stats_.in_use_bytes += rounded;
    stats_.peak_held_bytes = std::max(stats_.peak_held_bytes, stats_.held_bytes);
  } else {
    stats_.unpooled += 1;
  }
  return block;
}

void HostPool::give_back(at::Tensor buffer, bool pinned, bool pooled, std::shared_ptr<c10::Event> last_use) {
  if (!pooled) {
    return;  // an over-the-limit buffer: freed here (the allocator keeps pending copies safe)
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t size = buffer.numel();
  stats_.in_use_bytes -= size;
  stats_.cached_bytes += size;
  idle_[pinned ? 1 : 0].emplace(size, Idle{std::move(buffer), std::move(last_use)});
  if (stats_.held_bytes > max_bytes_) {
    trim_locked(max_bytes_);
  }
}

// Frees idle buffers without waiting for their last device use: safe because
// pinned buffers come from the accelerator's caching host allocator, which
// records an event for every non-blocking copy and does not reuse a block
// before that event completes; pageable buffers are only copied synchronously.
void HostPool::trim_locked(int64_t target_bytes) {
  for (auto& idle : idle_) {
    while (stats_.held_bytes > target_bytes && !idle.empty()) {
      auto it = std::prev(idle.end());  // largest first: fewest frees
      stats_.cached_bytes -= it->first;
      stats_.held_bytes -= it->first;
      idle.erase(it);
    }
  }
}

PoolStats HostPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

int64_t HostPool::max_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return max_bytes_;
}

void HostPool::set_max_bytes(int64_t max_bytes) {
  TORCH_CHECK_VALUE(max_bytes >= 0, "set_max_bytes: max_bytes must be >= 0, got ", max_bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  max_bytes_ = max_bytes;
  trim_locked(max_bytes_);
}

void HostPool::empty_cache() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    trim_locked(stats_.in_use_bytes);
  }
  // Our pinned buffers come from the accelerator's caching host allocator,
  // which keeps freed blocks cached; hand them back to the system too.
  if (const auto accelerator = at::getAccelerator(/*checked=*/false)) {
    if (auto* host = at::getHostAllocator(*accelerator)) {
      host->empty_cache();
    }
  }
}

namespace {
int64_t default_pool_limit() {
  // Half of physical memory: enough for any realistic working set, and it
  // leaves room for the data loader and the rest of the process.
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) {
    return int64_t{16} << 30;
  }
  return static_cast<int64_t>(pages) * page_size / 2;
}
}  // namespace

std::shared_ptr<HostPool> global_host_pool() {
  // Function-local static: created once, thread-safe initialisation (C++11).
  static const std::shared_ptr<HostPool> pool = HostPool::create(default_pool_limit());
  return pool;
}

}  // namespace hsoffload
