// Offload scopes: marks, saved-tensor handles, copies and prefetch.
//
// The engine knows tensors, devices, streams and events; it knows nothing of
// Python, autograd hooks or transformers. The Python shim installs
// `saved_tensors_hooks` whose pack/unpack callables call `OffloadScope::pack`
// and `SavedHandle::unpack` through the hsoffload ops.
//
// Thread-safety: an OffloadScope may be used from several threads at once
// (forward on the caller's thread, backward on autograd's device threads);
// one mutex per scope guards its marks, records and counters. The stack of
// *current* scopes is per thread (see `current_scope`).
#pragma once

#include "hsoffload/host_budget.h"
#include "hsoffload/host_pool.h"
#include "hsoffload/spill.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/util/intrusive_ptr.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace hsoffload {

// All knobs of one scope. Validated by `validate()`.
struct OffloadConfig {
  // Marked tensors smaller than this many bytes stay where they are.
  int64_t min_offload_size = 1024;
  // Copy marked CPU tensors into the host pool too (exercises the whole path
  // on machines without an accelerator). Off: marked CPU tensors are skipped.
  bool offload_cpu_tensors = false;
  // Use pinned host memory for accelerator tensors (required for async copies).
  bool pin_memory = true;
  // Copy on side streams ordered by events. Off: copies run on the compute stream.
  bool use_streams = true;
  // How many offloaded tensors to bring back ahead of their unpack in backward.
  int64_t prefetch_depth = 1;
  // Where packs that do not fit the host budget go ("": they stay on the
  // device). Checked when the scope is entered.
  std::string spill_dir;
  // How many spilled tensors to read back ahead of their unpack in backward.
  int64_t spill_prefetch_depth = 2;

  void validate() const;
};

// Counters. Per scope, and cumulative over the process (`cumulative_stats`).
struct OffloadStats {
  int64_t saved_tensors_seen = 0;      // every tensor that reached pack
  int64_t marked_tensors = 0;          // marks whose tensor reached pack (each mark once, however often it is saved)
  int64_t offloaded_tensors = 0;       // marked tensors whose data went to host (dedup: shared storage counts once)
  int64_t restored_tensors = 0;        // unpacks of offloaded tensors
  int64_t skipped_marked_tensors = 0;  // marked but kept in place (CPU, too small, empty, not plain storage)
  int64_t offloaded_bytes = 0;         // bytes copied device -> host
  int64_t restored_bytes = 0;          // bytes copied host -> device
  int64_t prefetch_hits = 0;           // restores served by a prefetch issued earlier
  int64_t wait_ns = 0;                 // host time spent inside unpack for restores that were not prefetched
  int64_t pool_bytes = 0;              // host pool bytes held (snapshot when stats are read)
  int64_t spilled_tensors = 0;         // offloaded tensors that went to spill_dir (over the host budget)
  int64_t spilled_bytes = 0;           // their bytes (included in offloaded_bytes)
  int64_t spill_read_wait_ns = 0;      // host time unpack waited for spilled tensors to be read back
  int64_t kept_on_device_tensors = 0;  // marked tensors over the host budget with no spill_dir: left in place

  void add(const OffloadStats& other);
};

class OffloadScope;
struct OffloadRecord;

// What pack returns: either the original tensor (passthrough) or a host copy.
// Immutable after construction except for the prefetch state in its record.
class SavedHandle {
 public:
  // Returns a tensor bit-identical to the packed one (dtype, device, sizes,
  // strides, values). May be called more than once. Raises if the original
  // tensor was modified in place after it was packed.
  at::Tensor unpack() const;
  bool offloaded() const { return record_ != nullptr; }
  // A handle that keeps `x` itself (no scope involved): what pack returns when
  // no offload scope applies.
  static std::shared_ptr<SavedHandle> passthrough(const at::Tensor& x);

 private:
  friend class OffloadScope;
  SavedHandle() = default;
  void check_version() const;

  at::Tensor passthrough_;                  // defined iff not offloaded
  std::shared_ptr<OffloadRecord> record_;   // defined iff offloaded
  // Metadata to rebuild the tensor from the record's span.
  at::ScalarType dtype_ = at::kFloat;
  std::vector<int64_t> sizes_;
  std::vector<int64_t> strides_;
  int64_t offset_in_span_ = 0;  // elements from the start of the copied span
  bool conj_ = false;           // conjugate and negative views are bits on the tensor, restored with it
  bool neg_ = false;
  // Autograd skips its version check once saved-tensor hooks are installed; we
  // keep the tensor's shared version counter (not the tensor) to check it.
  std::optional<c10::VariableVersion> version_counter_;
  uint32_t version_at_pack_ = 0;
  // Strong: the scope (records index, side streams, counters) must outlive the
  // Python object that created it while a graph can still unpack. The scope
  // never points back at handles, so this makes no cycle.
  std::shared_ptr<OffloadScope> scope_;
};

// One offload scope: owns marks, the index of live records, the side streams
// and the counters. Create with `OffloadScope::create`.
class OffloadScope : public std::enable_shared_from_this<OffloadScope> {
 public:
  static std::shared_ptr<OffloadScope> create(OffloadConfig config, std::shared_ptr<HostPool> pool,
                                              std::shared_ptr<HostBudget> budget = global_host_budget());
  ~OffloadScope();
  OffloadScope(const OffloadScope&) = delete;
  OffloadScope& operator=(const OffloadScope&) = delete;

  // Makes this scope the current one on the calling thread (scopes nest).
  // Raises if this scope is active already: nest a new scope instead, and if
  // spill_dir is set but is not a writable directory.
  void enter();
  // Removes this scope from the calling thread's stack and drops its marks,
  // prefetches and index. Handles still referenced by an autograd graph keep
  // their own host copies alive; they are freed with the graph.
  void exit();
  bool active() const;

  // Records that `x` (this TensorImpl at its current version) is to be
  // offloaded when packed while this scope is active.
  void mark(const at::Tensor& x);
  // True if packing `x` now would find a mark (the tensor itself or an alias, see Mark). Lets a caller that
  // unwraps tensor subclasses (DTensor) mark the inner tensor it will pack instead.
  bool is_marked(const at::Tensor& x);
  // The pack hook: decides passthrough or offload and starts the copy.
  std::shared_ptr<SavedHandle> pack(const at::Tensor& x);
  OffloadStats stats() const;
  // The counters of the spill store this scope writes to (zeros without spill_dir).
  SpillStats spill_stats() const;
  const OffloadConfig& config() const { return config_; }
  // Number of marks and records currently tracked (for leak tests).
  int64_t tracked_state() const;

  // Prefetch groups: packs between begin_group() and end_group() form one group (a decoder layer's saved tensors),
  // and prefetch_depth / spill_prefetch_depth count groups instead of single tensors: when backward restores a
  // tensor of group g, the rest of g and the groups g-1 .. g-depth are brought back. Outside a group every
  // offloaded tensor is a group of its own. begin_group() while a group is open starts the next one.
  void begin_group();
  void end_group();

  // The scope on top of this thread's stack, or null.
  static std::shared_ptr<OffloadScope> current();
  // Process-unique id of this scope (never reused), and the live scope with a
  // given id, or null. Lets hooks name their scope with a plain integer.
  int64_t id() const { return id_; }
  static std::shared_ptr<OffloadScope> find(int64_t id);

 private:
  friend class SavedHandle;
  OffloadScope(OffloadConfig config, std::shared_ptr<HostPool> pool, std::shared_ptr<HostBudget> budget);
  bool is_marked_locked(const at::Tensor& x);
  struct Mark;
  Mark* find_mark_locked(const at::Tensor& x);
  void prune_locked();
  void maybe_prune_locked();
  std::shared_ptr<OffloadRecord> find_record_locked(const c10::StorageImpl* storage, int64_t begin, int64_t end);
  std::shared_ptr<OffloadRecord> offload_locked(const at::Tensor& x, int64_t begin, int64_t end);
  at::Tensor restore(const SavedHandle& handle);
  void prefetch_before_locked(const OffloadRecord& current);
  void start_restore_locked(OffloadRecord& record);
  void copy_to_host_locked(OffloadRecord& record, const at::Tensor& x);
  void spill_locked(OffloadRecord& record, const at::Tensor& x);
  c10::Stream side_stream_locked(c10::Device device, int which);

  const OffloadConfig config_;
  const std::shared_ptr<HostPool> pool_;
  const std::shared_ptr<HostBudget> budget_;
  std::shared_ptr<SpillStore> spill_;  // opened by enter() when config_.spill_dir is set
  const std::shared_ptr<SpillErrors> spill_errors_ = std::make_shared<SpillErrors>();
  const int64_t id_;
  // Shared with this scope's records so a handle can restore after the scope object is gone.
  const std::shared_ptr<std::mutex> mutex_;
  bool active_ = false;
  std::thread::id owner_;  // the thread that entered the scope while active_
  // A mark matches the marked TensorImpl, or an alias of it (not a leaf that requires grad): the same live storage
  // viewed with the same dtype, storage offset, sizes and strides at the same version. TorchScript's profiling
  // executor, detach() inside custom Functions and functionalization hand autograd such aliases instead of the
  // marked tensor. Weak references only: a mark never keeps memory alive, and a new storage at a reused address
  // never matches (an empty `storage` locks to null, so a mark without plain storage matches only itself).
  struct Mark {
    c10::weak_intrusive_ptr<c10::TensorImpl> impl{c10::intrusive_ptr<c10::TensorImpl>()};
    c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
    uint32_t version = 0;
    at::ScalarType dtype = at::kByte;
    int64_t storage_offset = 0;
    std::vector<int64_t> sizes;
    std::vector<int64_t> strides;
    bool counted = false;  // marked_tensors counts a mark once, however often autograd saves its tensor
    // Addresses at mark time, for a quick reject without touching the weak references' atomics (a match needs the
    // same TensorImpl or the same StorageImpl; equal addresses alone prove nothing, the weak references decide).
    const void* impl_address = nullptr;
    const void* storage_address = nullptr;
    bool matches(const at::Tensor& x, uint32_t x_version) const;
    bool expired() const { return impl.expired() && storage.expired(); }
  };
  std::vector<Mark> marks_;
  // Live records in pack order (weak: a record lives as long as its handles).
  std::vector<std::weak_ptr<OffloadRecord>> records_;
  // The same records by source storage, for dedup lookups in O(1). The key is
  // only compared, never dereferenced; a hit is confirmed through the record's
  // weak reference to its storage, so an address reused by a new storage never
  // matches.
  std::unordered_multimap<const c10::StorageImpl*, std::weak_ptr<OffloadRecord>> by_storage_;
  int64_t next_seq_ = 0;
  int64_t next_group_ = 0;  // groups in pack order (see begin_group)
  int64_t open_group_ = -1;  // the group new records join, or -1: each record its own group
  // Incremented by enter(): prefetch stays within the records of one entry, so
  // one graph's backward does not pull another graph's tensors onto the device.
  int64_t epoch_ = 0;
  // Expired marks/records are pruned when the lists reach this size (amortised O(1)).
  size_t prune_at_ = 64;
  // Side streams per device index: [0] device->host, [1] host->device.
  std::vector<std::pair<c10::Device, std::array<c10::Stream, 2>>> streams_;
  OffloadStats stats_;
};

// Process-wide sum of the counters of every scope (atomic snapshot).
OffloadStats cumulative_stats();

}  // namespace hsoffload
