// The offload scope: composes the mark set, the record index, prefetch scheduling and the transfer protocol into
// the pack/unpack pair that the saved-tensor hooks call.
//
// The engine knows tensors, devices, streams and events; it knows nothing of Python, autograd hooks or
// transformers. The Python shim installs `saved_tensors_hooks` whose pack/unpack callables call
// `OffloadScope::pack` and `SavedHandle::unpack` through the hsoffload ops.
//
// Thread-safety: an OffloadScope may be used from several threads at once (forward on the caller's thread,
// backward on autograd's device threads); one mutex per scope (shared with its records) guards its marks, records,
// side streams and counters. The stack of *current* scopes is per thread (see `current`). A SavedHandle is
// immutable after pack; unpack takes its record's mutex.
#pragma once

#include "hsoffload/host_budget.h"
#include "hsoffload/host_pool.h"
#include "hsoffload/marks.h"
#include "hsoffload/options.h"
#include "hsoffload/records.h"
#include "hsoffload/spill.h"
#include "hsoffload/stats.h"
#include "hsoffload/transfer.h"

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace hsoffload {

// The engine's knobs of one scope, validated by `validate()`: the fields, their defaults and doc lines are the
// engine options of the one table of knobs (python_shim/hsoffload/options.py), through the generated options.h.
// The Python `hsoffload.OffloadConfig` holds these (passed by name to the OffloadScope class's constructor;
// spill_dir None there is "" here) plus shim-only fields the engine never sees: policy, keep_last_layers,
// offload_fraction and offload_output_head (the shim decides what to mark), max_host_bytes (applied to the
// process-wide budget through `set_host_budget` at entry), max_pool_bytes (the process-wide pool's
// `set_pool_limit` at entry) and reserve_host_bytes.
struct OffloadConfig {
#define HSOFFLOAD_OPTION_FIELD(type, name, default_value) type name = default_value;
  HSOFFLOAD_ENGINE_OPTIONS(HSOFFLOAD_OPTION_FIELD)
#undef HSOFFLOAD_OPTION_FIELD

  void validate() const;
};

class OffloadScope;

// What pack returns: either the original tensor (passthrough) or a share of a record (a host or spill copy).
// Immutable after construction but for `round_`; the restore state lives in the record.
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
  // Leaves its record's round of unpacks (UnpackRound::drop_handle).
  ~SavedHandle();
  SavedHandle(const SavedHandle&) = delete;
  SavedHandle& operator=(const SavedHandle&) = delete;

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
  // The record's round in which this handle last unpacked, or -1 (UnpackRound::unpacked, under its mutex).
  mutable int64_t round_ = -1;
  // Autograd skips its version check once saved-tensor hooks are installed; we
  // keep the tensor's shared version counter (not the tensor) to check it.
  std::optional<c10::VariableVersion> version_counter_;
  uint32_t version_at_pack_ = 0;
  // Strong: the scope (records index, side streams, counters) must outlive the
  // Python object that created it while a graph can still unpack. The scope
  // never points back at handles, so this makes no cycle.
  std::shared_ptr<OffloadScope> scope_;
};

// One offload scope: owns the marks, the index of live records, the side streams and the counters.
// Create with `OffloadScope::create`.
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
  // Removes this scope from the calling thread's stack, drops its marks and prunes the index entries of records
  // no handle holds any more. Records still held by an autograd graph stay indexed and keep their copies (and
  // prefetches already started) until the graph frees them; their handles can still be unpacked after exit.
  void exit();
  bool active() const;

  // Records that `x` (this TensorImpl at its current version) is to be
  // offloaded when packed while this scope is active.
  void mark(const at::Tensor& x);
  // True if packing `x` now would find a mark (the tensor itself or an alias, see marks.h). Lets a caller that
  // unwraps tensor subclasses (DTensor) mark the inner tensor it will pack instead.
  bool is_marked(const at::Tensor& x);
  // The pack hook: decides passthrough or offload and starts the copy. While the current stream is capturing a
  // graph (`capturing`, the caller's knowledge, or `stream_capturing`) a marked tensor passes through untouched
  // (counted in captured_passthrough): nothing is copied, allocated, recorded or queried.
  std::shared_ptr<SavedHandle> pack(const at::Tensor& x, bool capturing = false);
  OffloadStats stats() const;
  // What the first failed host (pinned) allocation of this scope raised ("" when none failed): the warning that
  // counts host_alloc_failures quotes it.
  std::string first_host_alloc_error() const;
  // The counters of the spill store this scope writes to (zeros without spill_dir).
  SpillStats spill_stats() const;
  const OffloadConfig& config() const { return config_; }
  // Host-copy groups restored ahead of backward from now on (config().prefetch_depth until this is called): the
  // prefetches started after it use `depth`; those in flight finish. From any thread (takes the scope's mutex).
  void set_prefetch_depth(int64_t depth);
  int64_t prefetch_depth() const;
  // Number of marks and records currently tracked (for leak tests).
  int64_t tracked_state() const;

  // Prefetch groups: packs between begin_group() and end_group() form one group (a decoder layer's saved tensors),
  // and prefetch_depth / spill_prefetch_depth count groups instead of single tensors: when backward restores a
  // tensor of group g, the rest of g and the groups g-1 .. g-depth are brought back. Outside a group every
  // offloaded tensor is a group of its own. begin_group() while a group is open starts the next one.
  void begin_group();
  void end_group();

  // Gives back what restores hold for unpacks that may never come: blocks prefetched ahead of an unpack, and the
  // restored storage a record keeps for its handles that have not unpacked in this pass (UnpackRound::end_round);
  // a later unpack restores again. The next backward over a retained graph then prefetches as the first did. The
  // Python shim calls it when a backward graph task that unpacked from this scope ends (torch.autograd.grad on some
  // inputs, a partial backward end early), and exit() does. Counted in released_restores.
  void release_restores();

  // The scope on top of this thread's stack, or null.
  static std::shared_ptr<OffloadScope> current();
  // Process-unique id of this scope (never reused), and the live scope with a
  // given id, or null. Lets hooks name their scope with a plain integer.
  int64_t id() const { return id_; }
  static std::shared_ptr<OffloadScope> find(int64_t id);

 private:
  friend class SavedHandle;
  OffloadScope(OffloadConfig config, std::shared_ptr<HostPool> pool, std::shared_ptr<HostBudget> budget);
  void prune_locked();
  void maybe_prune_locked();
  // What a pack must wait for before it can go on, holding no lock: pool bytes to allocate (`bytes`, pinned or not),
  // or host budget that spill writes under way will free (`budget_bytes`).
  struct HostNeed {
    int64_t bytes = 0;
    bool pinned = false;
    int64_t budget_bytes = 0;
    bool any() const { return bytes > 0 || budget_bytes > 0; }
  };
  // Which waits pack may still ask for: each is done at most once per pack, so the retries end.
  struct MayDefer {
    bool pool = true;
    bool budget = true;
  };
  // pack's decision and copy, under the lock. May return a HostNeed (of a kind `may` allows) instead of allocating
  // or copying; pack() then waits for it holding no lock and calls again. `first`: count the save (once per pack).
  HostNeed pack_locked(const at::Tensor& x, bool capturing, SavedHandle& handle, bool first, MayDefer may);
  // Sets `need` and returns null instead of offloading when `may` allows it and the copy fits the budget but the
  // pool lacks the room (pool), or it does not fit but this scope's spill writes will make room (budget).
  std::shared_ptr<OffloadRecord> offload_locked(const at::Tensor& x, int64_t begin, int64_t end, MayDefer may,
                                                HostNeed& need);
  // The spill tier's order: queues writes of this scope's oldest host copies (pack order: backward needs them
  // last) until, once they finish, the budget has room for `need` bytes plus the headroom the next packs need.
  void spill_oldest_locked(int64_t need);
  // Queues the write of `copy` (`bytes` of data; `held`: its budget lease, counted in writing_bytes_ until done).
  void start_host_write_locked(const std::shared_ptr<CopyLocation>& copy, int64_t bytes, int64_t held);
  at::Tensor restore(const SavedHandle& handle);
  // The restore an unpack needs now. Out of device memory, it gives back the blocks prefetched ahead of their
  // unpacks and tries once more; raises only when none were held (the device is really full).
  void restore_now_locked(OffloadRecord& record);
  // Drops every block prefetched ahead of its unpack (counted in prefetch_dropped); returns how many.
  int64_t drop_prefetched_locked();
  // Counts a failed host allocation, stops further tries in this entry and keeps the first message.
  void note_host_alloc_failure_locked(const std::string& error);
  // Starts the prefetches that follow restoring `record`. The first that finds no device memory (prefetch_oom)
  // gives back every prefetched block and pauses prefetch for the rest of the pass: an out-of-memory prefetch
  // never fails a step, and from there the device holds what prefetch_depth 0 would.
  void prefetch_locked(const OffloadRecord& record);
  // The three transfers a record goes through (transfer.h does the stream work).
  void copy_to_host_locked(OffloadRecord& record, const at::Tensor& x, HostBlock host);
  // Grows the pool by `bytes` (holding no lock); false, counted in host_alloc_failures, when the host allocation
  // failed (pinned memory exhausted): the caller keeps the tensor on the device.
  bool reserve_or_keep(int64_t bytes, bool pinned);
  // Straight from the device to a file: only when no host copy of this scope can make room (a copy larger than the
  // whole budget, or a budget held by other scopes' copies or by failed writes).
  void spill_from_device_locked(OffloadRecord& record, const at::Tensor& x);
  void copy_to_device_locked(OffloadRecord& record);

  const OffloadConfig config_;
  const std::shared_ptr<HostPool> pool_;
  const std::shared_ptr<HostBudget> budget_;
  std::shared_ptr<SpillStore> spill_;  // opened by enter() when config_.spill_dir is set
  const std::shared_ptr<SpillErrors> spill_errors_ = std::make_shared<SpillErrors>();
  // Host bytes whose spill writes are queued or running (shared with those jobs, which may outlive the scope).
  const std::shared_ptr<std::atomic<int64_t>> writing_bytes_ = std::make_shared<std::atomic<int64_t>>(0);
  int64_t largest_copy_ = 0;  // the largest host copy this scope made: the spill tier keeps room for two
  size_t spill_cursor_ = 0;   // records_.in_pack_order() before it are not in host (spill_oldest_locked)
  const int64_t id_;
  // Shared with this scope's records so a handle can restore after the scope object is gone.
  const std::shared_ptr<std::mutex> mutex_;
  bool active_ = false;
  std::thread::id owner_;  // the thread that entered the scope while active_
  MarkSet marks_;
  RecordIndex records_;
  int64_t next_seq_ = 0;
  int64_t next_group_ = 0;   // groups in pack order (see begin_group)
  int64_t open_group_ = -1;  // the group new records join, or -1: each record its own group
  // Incremented by enter(): prefetch stays within the records of one entry, so
  // one graph's backward does not pull another graph's tensors onto the device.
  int64_t epoch_ = 0;
  // A prefetch found no device memory in this pass of backward: restores go on demand until release_restores.
  bool prefetch_paused_ = false;
  // Host-copy groups restored ahead: config_.prefetch_depth until set_prefetch_depth (policy auto chooses it).
  int64_t prefetch_depth_ = config_.prefetch_depth;  // guarded by mutex_ (config_ is declared before)
  // A host allocation failed in this entry: later packs keep their tensors on the device without trying again.
  bool host_alloc_failed_ = false;
  std::string first_host_alloc_error_;  // the first failure's message, kept for the warning (first_host_alloc_error)
  // Expired marks/records are pruned when the lists reach this size (amortised O(1)).
  size_t prune_at_ = 64;
  // Device blocks a side stream still uses (copy sources, restored blocks being written, a foreign consumer's
  // block), held instead of tagged in the allocator (keepalive.h); reaped at every pack and unpack, let go at the
  // end of a backward (release_restores), at exit and by the destructor.
  KeepAlive side_uses_;
  SideStreams streams_;
  OffloadStats stats_;
};

// Process-wide sum of the counters of every scope (atomic snapshot; pool_bytes is the global pool's now).
OffloadStats process_stats();

}  // namespace hsoffload
