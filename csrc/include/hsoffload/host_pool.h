// Host memory pool for offloaded tensors.
//
// Thread-safety: every public method of HostPool may be called from any
// thread; one mutex guards the free list and the counters. HostBlock is not
// shared between threads without external synchronisation (the engine only
// touches a block under its scope's mutex).
#pragma once

#include <c10/core/Event.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

namespace hsoffload {

// Allocates raw host buffers (one uint8 tensor per buffer). Injected so the pool
// can be tested with pageable memory on machines without an accelerator.
using HostAllocFn = std::function<at::Tensor(int64_t bytes, bool pinned)>;

// Default allocator: at::empty on CPU, pinned through the current accelerator's
// host allocator when `pinned` is true.
at::Tensor default_host_alloc(int64_t bytes, bool pinned);

struct PoolStats {
  int64_t held_bytes = 0;       // bytes of buffers the pool owns (in use + cached)
  int64_t in_use_bytes = 0;     // bytes of buffers handed out and not yet returned
  int64_t cached_bytes = 0;     // bytes of idle buffers kept for reuse
  int64_t peak_held_bytes = 0;  // high-water mark of held_bytes
  int64_t allocations = 0;      // buffers obtained from the allocator
  int64_t reuses = 0;           // requests served from the cache
  int64_t unpooled = 0;         // requests served outside the byte limit
};

class HostPool;

// One host buffer on loan from a HostPool. Returned to the pool when destroyed.
// Move-only: exactly one owner can return the buffer.
class HostBlock {
 public:
  HostBlock() = default;
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;
  HostBlock(HostBlock&&) noexcept = default;
  HostBlock& operator=(HostBlock&& other) noexcept;
  ~HostBlock();

  // The first `bytes` bytes of the buffer, as a uint8 tensor.
  at::Tensor view(int64_t bytes) const;
  // Size of the whole buffer in bytes (>= the requested size).
  int64_t capacity() const { return buffer_.numel(); }
  bool pinned() const { return pinned_; }
  bool valid() const { return buffer_.defined(); }
  // Records that device work ending at `event` (already recorded on its
  // stream) reads or writes this buffer; the pool will not lend it again
  // before the event completes. Shared so the caller can wait on it too.
  void record_use(std::shared_ptr<c10::Event> event);

 private:
  friend class HostPool;
  void release();
  at::Tensor buffer_;
  bool pinned_ = false;
  bool pooled_ = false;
  std::shared_ptr<c10::Event> last_use_;
  std::weak_ptr<HostPool> pool_;
};

// A byte-bounded cache of host buffers that is reused across steps.
//
// Sizes are rounded up to a granule of 1/32 of the request's power of two
// (at least 512 bytes), so the rounding waste is below 3.2%. A cached buffer
// serves a request if it is at most 1/16 larger than the rounded request and no
// device work on it is still pending. On a miss one idle buffer that could not
// serve it is freed before a new one is allocated, so with changing sequence
// lengths the pool converges to the current working set instead of growing.
class HostPool : public std::enable_shared_from_this<HostPool> {
 public:
  // `max_bytes` bounds held_bytes; requests beyond it are served by buffers that
  // are freed on return instead of cached (counted in `unpooled`).
  static std::shared_ptr<HostPool> create(int64_t max_bytes, HostAllocFn alloc = default_host_alloc);

  // Lends a buffer of at least `bytes` bytes.
  HostBlock acquire(int64_t bytes, bool pinned);
  PoolStats stats() const;
  int64_t max_bytes() const;
  // Changes the bound; idle buffers above it are freed at once.
  void set_max_bytes(int64_t max_bytes);
  // Frees every idle buffer.
  void empty_cache();
  // Rounded size the pool allocates for a request of `bytes`.
  static int64_t round_size(int64_t bytes);

 private:
  HostPool(int64_t max_bytes, HostAllocFn alloc);
  friend class HostBlock;
  struct Idle {
    at::Tensor buffer;
    std::shared_ptr<c10::Event> last_use;
  };
  void give_back(at::Tensor buffer, bool pinned, bool pooled, std::shared_ptr<c10::Event> last_use);
  void trim_locked(int64_t target_bytes);

  mutable std::mutex mutex_;
  int64_t max_bytes_;
  HostAllocFn alloc_;
  // Idle buffers by capacity, separately for pinned and pageable memory.
  std::multimap<int64_t, Idle> idle_[2];
  PoolStats stats_;
};

// The process-wide pool used by offload scopes. A single pool exists because
// pinned memory is expensive to obtain (milliseconds per buffer) and must be
// reused across steps, i.e. across scopes; it is created on first use.
std::shared_ptr<HostPool> global_host_pool();

}  // namespace hsoffload
