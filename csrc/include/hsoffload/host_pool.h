// Host memory pool for offloaded tensors: slabs, sub-allocated.
//
// Host memory is obtained in large slabs whose sizes are powers of two (the
// accelerators' caching host allocators round every request up to a power of
// two, so a power-of-two slab wastes nothing there) and sub-allocated in
// 512-byte granules. A block lent by the pool (HostBlock) is one or more
// extents: one when a free range is large enough, several when the request is
// larger than any free range, so sizes that change from step to step reuse the space freed by
// the previous step instead of needing new buffers. Returned extents are
// coalesced with their free neighbours; an extent whose last device use has
// not completed is kept aside until its event completes.
//
// Thread-safety: every public method of HostPool may be called from any
// thread; one mutex guards the slabs, the free ranges and the counters, and is
// released while new buffers are allocated (pinning is slow and must not
// block other threads' acquires and returns). A
// HostBlock is not shared between threads without external synchronisation
// (the engine only touches a block under its scope's mutex).
#pragma once

#include "hsoffload/stats.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace hsoffload {

// Allocates raw host buffers (one uint8 tensor per buffer). Injected so the pool
// can be tested with pageable memory on machines without an accelerator.
using HostAllocFn = std::function<at::Tensor(int64_t bytes, bool pinned)>;

// Default allocator: at::empty on CPU, pinned through the current accelerator's
// host allocator when `pinned` is true.
at::Tensor default_host_alloc(int64_t bytes, bool pinned);

class HostPool;

// A slab's free ranges: offset -> length, coalesced. Its nodes travel with the blocks lent from it
// (HostBlock::Place::spare), so that giving a block back allocates nothing (a give-back runs in destructors).
using FreeRanges = std::map<int64_t, int64_t>;

// A block of host memory lent by a HostPool: `bytes()` bytes in one or more
// extents. Returned to the pool when destroyed. Move-only: exactly one owner
// can return it.
class HostBlock {
 public:
  HostBlock() = default;
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;
  HostBlock(HostBlock&& other) noexcept;
  HostBlock& operator=(HostBlock&& other) noexcept;
  ~HostBlock();

  // The extents in order, as uint8 tensors; their sizes sum to bytes().
  const std::vector<at::Tensor>& extents() const { return extents_; }
  int64_t bytes() const { return bytes_; }
  bool pinned() const { return pinned_; }
  bool valid() const { return !extents_.empty(); }
  // Records that device work ending at `event` (already recorded on its
  // stream) reads or writes this block; the pool will not lend its memory
  // again before the event completes.
  void record_use(std::shared_ptr<c10::Event> event);

 private:
  friend class HostPool;
  // Where one extent lies in the pool.
  struct Place {
    int64_t slab = -1;  // slab id; -1: an unpooled buffer
    int64_t offset = 0;
    int64_t length = 0;  // granule-rounded
    FreeRanges::node_type spare;  // pooled: the free-range node this extent becomes when it is given back
  };
  void release();
  std::vector<at::Tensor> extents_;  // the extents' bytes
  std::vector<Place> places_;        // where each of them lies, same order
  int64_t bytes_ = 0;
  bool pinned_ = false;
  std::shared_ptr<c10::Event> last_use_;
  std::weak_ptr<HostPool> pool_;
};

// A byte-bounded slab allocator of host memory, reused across steps.
class HostPool : public std::enable_shared_from_this<HostPool> {
 public:
  static constexpr int64_t kGranule = 512;
  static constexpr int64_t kMinSlab = int64_t{1} << 20;
  static constexpr int64_t kMaxSlab = int64_t{1} << 30;

  // `limit` bounds held_bytes (bytes); a block that does not fit is served
  // by a buffer of its own that is freed on return (counted in `unpooled`).
  static std::shared_ptr<HostPool> create(int64_t limit, HostAllocFn alloc = default_host_alloc);

  // Lends `bytes` bytes of host memory (pinned or pageable). New slabs, if needed, are allocated without holding
  // the pool's lock (the caller's own locks are its business: the scope grows the pool through `reserve` first).
  HostBlock acquire(int64_t bytes, bool pinned);
  // Makes at least `bytes` bytes of that kind free in slabs, allocating (and committing) slabs outside the pool's
  // lock, within the limit; returns the free bytes of that kind now (less than `bytes` only where the limit stops it). The op
  // `reserve_host`: pins before the first step, so packs do not.
  int64_t reserve(int64_t bytes, bool pinned);
  // Host memory that is not the pool's but is reported in its stats (one account for every pinned byte held for
  // offload): the spill tier's staging chunks (`bytes` > 0 when a store allocates them, < 0 when it frees them).
  // Pinned staging counts against an explicit limit (set_limit); a limit that follows the budget holds it on top.
  void add_staging(int64_t bytes, bool pinned);
  // Free bytes of that kind in slabs now (returned blocks whose device use completed included).
  int64_t free_bytes(bool pinned);
  PoolStats stats() const;
  // The bound on held_bytes (the op `pool_limit`, Python `max_pool_bytes`).
  int64_t limit() const;
  // Changes the bound; slabs with nothing lent above it are freed at once, and pinned ones returned to the system
  // (not kept in torch's host cache). An explicit bound: the pool stops following the budget.
  void set_limit(int64_t limit);
  // One limit: the bound becomes limit_for_budget(budget_limit) now and follows every later budget_changed() (the
  // process-wide pool does from its creation), until set_limit fixes one.
  void follow_budget(int64_t budget_limit);
  void budget_changed(int64_t budget_limit);
  // The budget plus the slab granularity's slack (1/16, at least one minimal slab): the pool never holds much more
  // host memory than the budget lets records reserve.
  static int64_t limit_for_budget(int64_t budget_limit);
  // Frees every slab with nothing lent, and the accelerator's cached pinned blocks (the op `empty_pool`).
  void empty();
  // Size of the slabs the pool allocates next when it holds `held` bytes and
  // must find `need` more: a power of two near 1/32 of the total, so the
  // last, partly used slab wastes at most about 3 %.
  static int64_t slab_size(int64_t held, int64_t need);

 private:
  HostPool(int64_t limit, HostAllocFn alloc);
  friend class HostBlock;
  struct Slab {
    at::Tensor buffer;
    bool pinned = false;
    FreeRanges free;
    int64_t free_bytes = 0;
  };
  struct Pending {
    std::vector<HostBlock::Place> places;
    std::shared_ptr<c10::Event> last_use;
  };
  // A lent block comes back (HostBlock's destructor and move-assignment: noexcept). Allocates nothing: its ranges
  // go back through their spare nodes, and `pending_` has room for every lent block (reserved by acquire).
  void give_back(std::vector<HostBlock::Place> places, std::shared_ptr<c10::Event> last_use, bool pinned) noexcept;
  void set_limit_impl(int64_t limit, bool explicit_limit);
  int64_t free_bytes_locked(bool pinned) const;
  // Lends `need` bytes from free ranges (false: not enough free bytes of that kind).
  bool serve_locked(int64_t need, bool pinned, HostBlock& block);
  // Slab sizes that cover `deficit` within the limit (idle slabs of the other kind trimmed first); empty: over it.
  std::vector<int64_t> grow_sizes_locked(int64_t deficit, bool pinned);
  // Allocates `sizes` with the lock released (re-taken before returning, also on an exception); `touch`: commit
  // pageable pages now (reserve), not at the first copy.
  std::vector<at::Tensor> allocate_unlocked(std::unique_lock<std::mutex>& lock, const std::vector<int64_t>& sizes,
                                            bool pinned, bool touch);
  void add_slabs_locked(std::vector<at::Tensor> buffers, bool pinned);
  // Returns an extent's range to its slab's free ranges, coalesced; allocates nothing (the extent's spare node).
  void free_place_locked(HostBlock::Place& p) noexcept;
  void reap_pending_locked();
  // Frees idle slabs (of one kind, pinned or not, if given) until held_bytes <= target_bytes; returns the pinned
  // bytes it freed. Allocates nothing (reached from give_back).
  int64_t trim_locked(int64_t target_bytes, std::optional<bool> only_kind = std::nullopt);
  // Hands the accelerator's cached pinned blocks back to the system (outside the pool's lock; not in a hook).
  static void empty_host_cache();
  void take_locked(Slab& slab, int64_t slab_id, int64_t offset, int64_t length, HostBlock& block);

  mutable std::mutex mutex_;
  int64_t limit_;
  bool follows_budget_ = false;
  HostAllocFn alloc_;
  std::map<int64_t, Slab> slabs_;  // by id
  int64_t next_slab_id_ = 0;
  std::vector<Pending> pending_;  // returned extents whose last device use may still run
  int64_t lent_ = 0;  // pooled blocks lent now; pending_.capacity() >= pending_.size() + lent_ (acquire reserves)
  int64_t pinned_staging_bytes_ = 0;  // the pinned part of stats_.staging_bytes
  PoolStats stats_;
};

// The process-wide pool used by offload scopes. A single pool exists because
// pinned memory is expensive to obtain (milliseconds per buffer) and must be
// reused across steps, i.e. across scopes; it is created on first use.
std::shared_ptr<HostPool> global_host_pool();

}  // namespace hsoffload
