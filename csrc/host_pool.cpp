// The host pool (host_pool.h): slabs of host memory, sub-allocated into blocks of granule-rounded extents.
#include "hsoffload/host_pool.h"

#include "hsoffload/cpu_meter.h"
#include "hsoffload/events.h"
#include "hsoffload/host_budget.h"

#include <ATen/DeviceAccelerator.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>


#include <algorithm>
#include <utility>

namespace hsoffload {

namespace {
int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
int64_t pow2_floor(int64_t n) {
  int64_t p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}
int64_t pow2_ceil(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}
// A free-range node of its own (allocates; never on a give-back).
FreeRanges::node_type new_free_node() {
  FreeRanges one;
  one.emplace(0, 0);
  return one.extract(one.begin());
}
}  // namespace

at::Tensor default_host_alloc(int64_t bytes, bool pinned) {
  const HostAllocation host;  // offloaded copies: the CPU meter does not count them as the device's
  return at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCPU).pinned_memory(pinned));
}

// ---------------------------------------------------------------------------
// HostBlock

HostBlock::HostBlock(HostBlock&& other) noexcept
    : extents_(std::move(other.extents_)),
      places_(std::move(other.places_)),
      bytes_(other.bytes_),
      pinned_(other.pinned_),
      last_use_(std::move(other.last_use_)),
      pool_(std::move(other.pool_)) {
  other.extents_.clear();
  other.places_.clear();
  other.bytes_ = 0;
}

HostBlock& HostBlock::operator=(HostBlock&& other) noexcept {
  if (this != &other) {
    release();
    extents_ = std::move(other.extents_);
    places_ = std::move(other.places_);
    bytes_ = other.bytes_;
    pinned_ = other.pinned_;
    last_use_ = std::move(other.last_use_);
    pool_ = std::move(other.pool_);
    other.extents_.clear();
    other.places_.clear();
    other.bytes_ = 0;
  }
  return *this;
}

HostBlock::~HostBlock() { release(); }

void HostBlock::record_use(std::shared_ptr<c10::Event> event) { last_use_ = std::move(event); }

void HostBlock::release() {
  if (places_.empty()) {
    extents_.clear();
    return;
  }
  if (auto pool = pool_.lock()) {
    pool->give_back(std::move(places_), std::move(last_use_), pinned_);
  }
  extents_.clear();  // after give_back: an unpooled buffer is freed here, a slab lives on in the pool
  places_.clear();
  last_use_.reset();
  bytes_ = 0;
}

// ---------------------------------------------------------------------------
// HostPool

std::shared_ptr<HostPool> HostPool::create(int64_t limit, HostAllocFn alloc) {
  TORCH_CHECK_VALUE(limit >= 0, "HostPool: limit must be >= 0 bytes, got ", limit);
  return std::shared_ptr<HostPool>(new HostPool(limit, std::move(alloc)));  // private ctor
}

HostPool::HostPool(int64_t limit, HostAllocFn alloc) : limit_(limit), alloc_(std::move(alloc)) {}

int64_t HostPool::slab_size(int64_t held, int64_t need) {
  return std::clamp(pow2_floor(std::max<int64_t>(held + need, 1) / 32), kMinSlab, kMaxSlab);
}

void HostPool::take_locked(Slab& slab, int64_t slab_id, int64_t offset, int64_t length, HostBlock& block) {
  auto it = slab.free.find(offset);
  TORCH_INTERNAL_ASSERT(it != slab.free.end() && it->second >= length);
  const int64_t rest = it->second - length;
  int64_t lent = 0;
  for (const auto& p : block.extents_) lent += p.numel();
  const int64_t used = std::min(length, block.bytes_ - lent);  // the last extent ends at bytes(), not at the granule
  // Everything that may throw first (the new extent's tensor, room in the block, a spare node): the free ranges
  // change only after.
  at::Tensor extent = slab.buffer.narrow(0, offset, used);
  block.extents_.reserve(block.extents_.size() + 1);
  block.places_.reserve(block.places_.size() + 1);
  FreeRanges::node_type spare = rest > 0 ? new_free_node() : FreeRanges::node_type();
  FreeRanges::node_type node = slab.free.extract(it);
  if (rest > 0) {
    node.key() = offset + length;  // the range's node keeps its remainder
    node.mapped() = rest;
    slab.free.insert(std::move(node));
  } else {
    spare = std::move(node);  // the whole range is lent: its node is the extent's spare
  }
  slab.free_bytes -= length;
  stats_.in_use_bytes += length;  // per extent: a serve that throws half way is given back exactly
  stats_.cached_bytes -= length;
  block.extents_.push_back(std::move(extent));
  block.places_.push_back(HostBlock::Place{slab_id, offset, length, std::move(spare)});
}

int64_t HostPool::free_bytes_locked(bool pinned) const {
  int64_t total = 0;
  for (const auto& [id, slab] : slabs_) {
    if (slab.pinned == pinned) total += slab.free_bytes;
  }
  return total;
}

bool HostPool::serve_locked(int64_t need, bool pinned, HostBlock& block) {
  // One extent if a free range is large enough (best fit: the smallest such range).
  Slab* best = nullptr;
  int64_t best_id = -1, best_offset = 0, best_length = 0;
  for (auto& [id, slab] : slabs_) {
    if (slab.pinned != pinned) continue;
    for (const auto& [offset, length] : slab.free) {
      if (length >= need && (best == nullptr || length < best_length)) {
        best = &slab, best_id = id, best_offset = offset, best_length = length;
      }
    }
  }
  if (best != nullptr) {
    take_locked(*best, best_id, best_offset, need, block);
  } else {
    if (free_bytes_locked(pinned) < need) {
      return false;
    }
    // Otherwise the largest ranges first (fewest extents).
    struct Range {
      int64_t length, slab, offset;
    };
    std::vector<Range> ranges;
    for (auto& [id, slab] : slabs_) {
      if (slab.pinned != pinned) continue;
      for (const auto& [offset, length] : slab.free) ranges.push_back(Range{length, id, offset});
    }
    std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.length > b.length; });
    int64_t left = need;
    for (const auto& r : ranges) {
      if (left == 0) break;
      const int64_t take = std::min(left, r.length);
      take_locked(slabs_.at(r.slab), r.slab, r.offset, take, block);
      left -= take;
    }
    TORCH_INTERNAL_ASSERT(left == 0);
  }
  return true;
}

void HostPool::add_staging(int64_t bytes, bool pinned) {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.staging_bytes += bytes;
  if (pinned) {
    stats_.pinned_bytes += bytes;
    pinned_staging_bytes_ += bytes;
  }
}

std::vector<int64_t> HostPool::grow_sizes_locked(int64_t deficit, bool pinned) {
  std::vector<int64_t> sizes;
  const int64_t unit = slab_size(stats_.held_bytes, deficit);
  for (int64_t left = deficit; left > 0; left -= sizes.back()) {
    sizes.push_back(left >= unit ? unit : std::min(unit, std::max(kMinSlab, pow2_ceil(left))));
  }
  int64_t new_bytes = 0;
  for (int64_t s : sizes) new_bytes += s;
  // Pinned spill staging shares an explicit limit; a limit that follows the budget leaves the budget's room to
  // slabs and holds the staging on top (so a small budget is not served by unpooled blocks).
  const int64_t room = follows_budget_ ? limit_ : limit_ - pinned_staging_bytes_;
  if (stats_.held_bytes + new_bytes > room) {
    trim_locked(std::max<int64_t>(0, room - new_bytes), /*only_kind=*/!pinned);  // idle slabs of the other kind
  }
  if (stats_.held_bytes + new_bytes > room) {
    sizes.clear();  // over the bound
  }
  return sizes;
}

void HostPool::add_slabs_locked(std::vector<at::Tensor> buffers, bool pinned) {
  for (at::Tensor& buffer : buffers) {
    const int64_t s = buffer.numel();
    Slab slab;
    slab.buffer = std::move(buffer);
    slab.pinned = pinned;
    slab.free.emplace(0, s);
    slab.free_bytes = s;
    slabs_.emplace(next_slab_id_++, std::move(slab));
    stats_.allocations += 1;
    stats_.slabs += 1;
    stats_.held_bytes += s;
    stats_.cached_bytes += s;
    if (pinned) stats_.pinned_bytes += s;
  }
  stats_.peak_held_bytes = std::max(stats_.peak_held_bytes, stats_.held_bytes);
}

std::vector<at::Tensor> HostPool::allocate_unlocked(std::unique_lock<std::mutex>& lock,
                                                    const std::vector<int64_t>& sizes, bool pinned, bool touch) {
  // Pinned allocation costs ~0.1-0.3 s per GiB and serialises the device's streams: never under the pool's lock
  // (docs/design.md, "Pinned memory out of the hot path"). Another thread may use the new slabs first; callers loop.
  lock.unlock();
  std::vector<at::Tensor> buffers;
  buffers.reserve(sizes.size());
  try {
    for (int64_t s : sizes) {
      buffers.push_back(alloc_(s, pinned));
      // Pageable memory is committed at first touch (page faults during the first copies); pinned memory is
      // committed by the pinning itself.
      if (touch && !pinned) buffers.back().zero_();
    }
  } catch (...) {
    lock.lock();
    throw;
  }
  lock.lock();
  return buffers;
}

HostBlock HostPool::acquire(int64_t bytes, bool pinned) {
  TORCH_CHECK_VALUE(bytes > 0, "HostPool.acquire: bytes must be > 0, got ", bytes);
  const int64_t need = round_up(bytes, kGranule);
  HostBlock block;
  block.bytes_ = bytes;
  block.pinned_ = pinned;
  block.pool_ = weak_from_this();
  std::unique_lock<std::mutex> lock(mutex_);
  stats_.acquires += 1;
  bool grew = false;
  for (;;) {
    reap_pending_locked();
    // Room for this block in the pending list, should it come back while its copy runs: give_back allocates nothing.
    pending_.reserve(pending_.size() + static_cast<size_t>(lent_) + 1);
    ++lent_;  // before any extent is taken: a serve that throws half way gives its extents back (and this) in ~block
    if (serve_locked(need, pinned, block)) {
      if (!grew) stats_.reuses += 1;
      return block;
    }
    --lent_;
    // New slabs for what the free ranges cannot cover.
    const std::vector<int64_t> sizes = grow_sizes_locked(need - free_bytes_locked(pinned), pinned);
    if (sizes.empty()) {
      // Over the bound: a buffer of its own, freed on return. A pinned one is asked for as the power of two the
      // accelerator's caching host allocator would round it to anyway, so unpooled_bytes counts what it holds.
      const int64_t own_bytes = pinned ? pow2_ceil(need) : need;
      std::vector<at::Tensor> own = allocate_unlocked(lock, {own_bytes}, pinned, /*touch=*/false);
      block.extents_.push_back(own.front().narrow(0, 0, bytes));
      block.places_.push_back(HostBlock::Place{-1, 0, own_bytes, {}});
      stats_.allocations += 1;
      stats_.unpooled += 1;
      stats_.unpooled_bytes += own_bytes;
      if (pinned) stats_.pinned_bytes += own_bytes;
      return block;
    }
    add_slabs_locked(allocate_unlocked(lock, sizes, pinned, /*touch=*/false), pinned);
    grew = true;
  }
}

int64_t HostPool::free_bytes(bool pinned) {
  std::lock_guard<std::mutex> lock(mutex_);
  reap_pending_locked();
  return free_bytes_locked(pinned);
}

int64_t HostPool::reserve(int64_t bytes, bool pinned) {
  TORCH_CHECK_VALUE(bytes >= 0, "reserve_host: bytes must be >= 0, got ", bytes);
  const int64_t want = round_up(bytes, kGranule);
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    reap_pending_locked();
    const int64_t have = free_bytes_locked(pinned);
    if (have >= want) return have;
    const std::vector<int64_t> sizes = grow_sizes_locked(want - have, pinned);
    if (sizes.empty()) return have;  // the pool's bound: what it could hold
    add_slabs_locked(allocate_unlocked(lock, sizes, pinned, /*touch=*/true), pinned);
  }
}

void HostPool::free_place_locked(HostBlock::Place& e) noexcept {
  auto found = slabs_.find(e.slab);
  if (found == slabs_.end()) return;  // cannot happen: a slab with lent extents is never freed
  Slab& slab = found->second;
  int64_t offset = e.offset, length = e.length;
  // The merged range reuses a node: the previous range's, else the extent's spare. Erasing frees a node; nothing
  // here allocates one.
  FreeRanges::node_type node = std::move(e.spare);
  auto next = slab.free.lower_bound(offset);
  if (next != slab.free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      length += prev->second;
      node = slab.free.extract(prev);
    }
  }
  if (next != slab.free.end() && offset + length == next->first) {
    length += next->second;
    slab.free.erase(next);
  }
  if (node.empty()) {
    slab.free.emplace(offset, length);  // never taken: every pooled extent is lent with its spare node
  } else {
    node.key() = offset;
    node.mapped() = length;
    slab.free.insert(std::move(node));
  }
  slab.free_bytes += e.length;
}

void HostPool::give_back(std::vector<HostBlock::Place> places, std::shared_ptr<c10::Event> last_use,
                         bool pinned) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  if (places.size() == 1 && places[0].slab < 0) {
    // Unpooled: the caller drops the buffer (the host allocator keeps pending copies safe).
    stats_.unpooled_bytes -= places[0].length;
    if (pinned) stats_.pinned_bytes -= places[0].length;
    return;
  }
  int64_t total = 0;
  for (const auto& e : places) total += e.length;
  stats_.in_use_bytes -= total;
  stats_.cached_bytes += total;
  --lent_;
  if (last_use && !event_completed(*last_use)) {  // never throws: reached from destructors (events.h)
    pending_.push_back(Pending{std::move(places), std::move(last_use)});  // within the room acquire reserved
    return;
  }
  for (auto& e : places) free_place_locked(e);
  if (stats_.held_bytes > limit_) {
    trim_locked(limit_);
  }
}

void HostPool::reap_pending_locked() {
  // Decide first, then free: the ranges of one returned block are freed exactly once, whatever a query says.
  // std::partition, not stable_partition: that one asks for a buffer (reached from give_back, which allocates nothing).
  auto done = std::partition(pending_.begin(), pending_.end(), [](const Pending& p) {
    return p.last_use && !event_completed(*p.last_use);  // still in use: stays pending
  });
  for (auto it = done; it != pending_.end(); ++it) {
    for (auto& e : it->places) free_place_locked(e);
  }
  pending_.erase(done, pending_.end());
}

// Frees slabs with nothing lent and nothing pending, largest first (fewest frees). Safe without waiting: pinned
// slabs come from the accelerator's caching host allocator, which records an event for every non-blocking copy
// and does not reuse a block before that event completes; pageable memory is only copied synchronously.
int64_t HostPool::trim_locked(int64_t target_bytes, std::optional<bool> only_kind) {
  reap_pending_locked();
  int64_t freed_pinned = 0;
  // The largest idle slab each time (a few dozen slabs at most), found without a list: no allocation.
  while (stats_.held_bytes > target_bytes) {
    auto largest = slabs_.end();
    for (auto it = slabs_.begin(); it != slabs_.end(); ++it) {
      const Slab& slab = it->second;
      const bool idle = slab.free_bytes == slab.buffer.numel() && (!only_kind || slab.pinned == *only_kind);
      if (idle && (largest == slabs_.end() || slab.buffer.numel() >= largest->second.buffer.numel())) largest = it;
    }
    if (largest == slabs_.end()) break;
    const int64_t size = largest->second.buffer.numel();
    if (largest->second.pinned) {
      stats_.pinned_bytes -= size;
      freed_pinned += size;
    }
    slabs_.erase(largest);
    stats_.held_bytes -= size;
    stats_.cached_bytes -= size;
    stats_.slabs -= 1;
  }
  return freed_pinned;
}

PoolStats HostPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

int64_t HostPool::limit() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return limit_;
}

int64_t HostPool::limit_for_budget(int64_t budget_limit) {
  return budget_limit + std::max(budget_limit / 16, kMinSlab);
}

void HostPool::follow_budget(int64_t budget_limit) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    follows_budget_ = true;
  }
  set_limit_impl(limit_for_budget(budget_limit), /*explicit_limit=*/false);
}

void HostPool::budget_changed(int64_t budget_limit) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!follows_budget_) return;
  }
  set_limit_impl(limit_for_budget(budget_limit), /*explicit_limit=*/false);
}

void HostPool::set_limit(int64_t limit) {
  TORCH_CHECK_VALUE(limit >= 0, "HostPool.set_limit: limit must be >= 0 bytes, got ", limit);
  set_limit_impl(limit, /*explicit_limit=*/true);
}

void HostPool::set_limit_impl(int64_t limit, bool explicit_limit) {
  int64_t freed_pinned = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (explicit_limit) follows_budget_ = false;
    limit_ = limit;
    freed_pinned = trim_locked(limit_);
  }
  if (freed_pinned > 0) {
    empty_host_cache();  // trimmed pinned slabs go back to the system, not into torch's host cache
  }
}

void HostPool::empty_host_cache() {
  // Pinned slabs come from the accelerator's caching host allocator, which keeps freed blocks cached; hand them
  // back to the system too. Never in a hook: freeing pinned memory (cudaFreeHost) synchronises the device.
  if (const auto accelerator = at::getAccelerator(/*checked=*/false)) {
    if (auto* host = at::getHostAllocator(*accelerator)) {
      host->empty_cache();
    }
  }
}

void HostPool::empty() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    trim_locked(0);
  }
  empty_host_cache();
}

std::shared_ptr<HostPool> global_host_pool() {
  // Function-local static: created once, thread-safe initialisation (C++11). Its limit follows the process's host
  // budget (one limit for every host byte held for offload) until set_limit fixes one.
  static const std::shared_ptr<HostPool> pool = [] {
    auto p = HostPool::create(0);
    p->follow_budget(global_host_budget()->stats().limit);
    return p;
  }();
  return pool;
}

}  // namespace hsoffload
