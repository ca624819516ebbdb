// The record index: one OffloadRecord per host (or spill) copy of a storage span, found again by storage and span
// so that a tensor saved twice, or a view inside an already copied span, shares one copy (dedup).
//
// A record is owned by the handles that use it (so by the autograd graphs that saved them); the index holds weak
// references only, in pack order (for prefetch) and by source storage (for dedup in O(1)). Storage keys are only
// compared, never dereferenced; a hit is confirmed through the record's weak reference to its storage, so an
// address reused by a new storage never matches.
//
// Thread-safety: RecordIndex has none of its own; its owner (OffloadScope) calls it under its mutex. A record's
// `restore` state is guarded by `record.mutex` (the owning scope's mutex); its `copy` by the copy's own mutex (the
// spill tier's I/O threads change it); the round of unpacks by its own (`restore.round`); `seq`, `group` and
// `epoch` at pack and at regroup (under the scope's mutex); the rest is written once, at pack. Lock order: scope ->
// copy -> pool/budget, and scope -> round.
#pragma once

#include "hsoffload/host_budget.h"
#include "hsoffload/host_pool.h"
#include "hsoffload/save_site.h"
#include "hsoffload/tensor_kind.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace hsoffload {

class SpillFile;
class SpillRead;
class SpillStore;

// The span of one storage that a record copies.
struct SourceSpan {
  c10::Device device{c10::kCPU};
  c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
  uint32_t version = 0;  // the storage's tensor version at pack
  int64_t begin = 0;     // byte offsets of the span in the storage
  int64_t end = 0;
  int64_t align = 0;     // address of the span's first byte modulo kSpanAlignment (transfer.h)

  int64_t bytes() const { return end - begin; }
  // True if [begin, end) of `storage` lies inside this span and `storage` is still this very storage.
  bool covers(const c10::StorageImpl* storage, int64_t begin, int64_t end) const;
};

// Where the copied bytes are: a host block (with its share of the host budget), a spill file, or both while a spill
// write of the host block runs. The spill tier moves a host copy to a file in the background (docs/design.md, "Host
// budget and spill tier") and gives the host block and its budget back from an I/O thread, which never takes a
// scope's mutex; so a CopyLocation has a mutex of its own (taken after the scope's, never before). Owned by its
// record; a spill write in progress holds it too.
struct CopyLocation {
  enum class Where : int {
    kHost,         // in `host`
    kSpilling,     // in `host`, and being written to a file (the host block is read, never written)
    kFile,         // in `spill` only (written, or being written straight from the device)
    kSpillFailed,  // in `host`; its write failed (the error went to the scope): never written again
  };
  std::mutex mutex;  // guards lease, host, store, spill; `where` changes under it
  std::atomic<Where> where{Where::kHost};  // may be read without the mutex (a prefetch decision)
  HostLease lease;
  HostBlock host;
  std::shared_ptr<SpillStore> store;  // set iff a file exists; kept so a restore can read after the scope is gone
  std::shared_ptr<SpillFile> spill;
  std::shared_ptr<c10::Event> d2h_done;  // the device->host copy's done event; null when it was synchronous. Set at
                                         // pack, before the location is shared: read without the mutex.

  bool in_host() const { return where.load() != Where::kFile; }
};

// One restore serves every handle of a record, as the one saved tensor would have without offload (the chunks of a
// fused projection, a tensor every layer saves: their backward nodes run apart). A round is one pass of backward
// over the record: it ends when every live handle has unpacked in it (a retained graph's next backward is the next
// round). Until then the record holds the restored storage; a handle that dies without unpacking leaves the round.
//
// Thread-safety: its own mutex, taken last and never held while calling out -- a handle's destructor, run by
// autograd or Python's garbage collector on any thread, takes it and not the scope's mutex. The storages these
// methods return are freed by the caller, after the mutex is let go.
class UnpackRound {
 public:
  // A handle now shares the record.
  void add_handle();
  // A handle unpacked `restored`. `handle_round` is the round of that handle's last unpack (-1: never), updated
  // here. Returns the held storage to free when this unpack ended the round; else holds `restored` for the rest.
  c10::intrusive_ptr<c10::StorageImpl> unpacked(int64_t& handle_round, c10::intrusive_ptr<c10::StorageImpl> restored);
  // A handle (last unpacked in `handle_round`) is gone. Returns the held storage to free when that ended the round.
  c10::intrusive_ptr<c10::StorageImpl> drop_handle(int64_t handle_round);
  // Ends the round now, whoever has not unpacked yet (the graph task that was unpacking ended early:
  // torch.autograd.grad on some inputs, a partial backward). Returns the held storage to free, if any; a handle that
  // unpacks later restores again.
  c10::intrusive_ptr<c10::StorageImpl> end_round();

 private:
  c10::intrusive_ptr<c10::StorageImpl> end_if_done_locked();

  std::mutex mutex_;
  int64_t live_handles_ = 0;
  int64_t round_ = 0;
  int64_t unpacked_ = 0;  // live handles that have unpacked in this round
  c10::intrusive_ptr<c10::StorageImpl> held_;
};

// The state of the restore in progress or last done. Guarded by the record's mutex, except `round` (its own).
struct RestoreState {
  at::Tensor prefetched;  // device bytes of a restore started ahead of its unpack (until unpack takes them)
  int64_t pad = 0;        // where the span starts inside that block
  std::shared_ptr<SpillRead> spill_read;  // the read of the current restore, until unpack waits for it
  std::shared_ptr<SpillRead> reading;     // that read while an unpack waits for it holding no lock
  std::shared_ptr<c10::Event> h2d_done;   // kept: every consumer stream waits on it
  std::optional<c10::Stream> alloc_stream;  // stream whose pool owns the restored block
  c10::weak_intrusive_ptr<c10::StorageImpl> restored{c10::intrusive_ptr<c10::StorageImpl>()};  // while held
  bool restored_once = false;  // an unpack restored it in this pass of backward (reset when a graph task ends)
  UnpackRound round;
};

// The elements one save referenced, in bytes of its storage: first byte, element size, sizes and strides.
struct SaveFootprint {
  int64_t begin = 0;
  int64_t end = 0;  // one past its last byte
  int64_t itemsize = 1;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  // in elements
  bool dense = false;  // its elements fill [begin, end) exactly (contiguous, or a permutation of contiguous)

  // True if every element of `other` is an element of this save: `other` lies inside this dense save's bytes, or
  // has this very geometry.
  bool contains(const SaveFootprint& other) const;
};

// Which later saves may share a record's copy (docs/design.md, "Copy sharing"). The contract, as every copy-at-save
// offloader gives it (`save_on_cpu`): each saved tensor restores the bytes it had at its own save. A write that
// bypasses the version counter (`.data`, a kernel writing through a raw pointer into a preallocated buffer) is
// invisible to the engine; between two saves it makes the second save's bytes differ from the copy the first save
// made, and sharing that copy would restore stale bytes: a silent wrong gradient. So by default a later save shares
// the copy only when it is made at the first save's site (SaveSite: by the same autograd node, with no code
// between the two saves that could write anything). With `share_copies` (opt-in, OffloadConfig) a later save also
// shares (a) elements an earlier save of the record referenced -- a tensor saved by several ops, as the input q, k
// and v projections share -- or (b) views made by the same autograd node as the record's first save while that node
// lives (the outputs of one split/chunk/unbind: a fused gate/up or q/k/v); there a version-bypassing write between
// the saves restores the first save's bytes.
//
// Thread-safety: none of its own; written and read at pack, under the owning scope's mutex.
class SharePolicy {
 public:
  // The record's first save: its footprint, the node that made the saved tensor, and where it was saved.
  void first(SaveFootprint save, ProducerRef producer, SaveSite site);
  // True if a save with this footprint, made by `producer` (null: none) at `site`, may share the record's copy;
  // `share_copies`: the opt-in rule (a) and (b) above applies too. (M24)
  bool admits(const SaveFootprint& save, const void* producer, const SaveSite& site, bool share_copies) const;
  // A later save now shares the record: its elements count as referenced.
  void add(SaveFootprint save);

 private:
  std::vector<SaveFootprint> saves_;
  ProducerRef producer_;
  SaveSite site_;
};

// One host copy of a span of one storage. Shared by every handle whose tensor lies inside that span (tensors saved
// twice, views of one storage), and freed with the last of them, i.e. with the autograd graph that saved it.
struct OffloadRecord {
  // Identity and order.
  int64_t seq = 0;    // pack order within the scope
  int64_t group = 0;  // prefetch group (OffloadScope::begin_group), increasing in pack order
  int64_t epoch = 0;  // the scope entry that packed it
  SourceSpan source;
  std::shared_ptr<CopyLocation> copy = std::make_shared<CopyLocation>();
  RestoreState restore;
  SharePolicy sharing;  // which later saves may share `copy`
  std::shared_ptr<std::mutex> mutex;  // the owning scope's mutex

  int64_t bytes() const { return source.bytes(); }
  bool spilled() const { return !copy->in_host(); }  // the next restore reads a file
};

// A record's place in pack order, made when it was packed in `group`.
struct PackEntry {
  std::weak_ptr<OffloadRecord> record;
  int64_t group = 0;
  // The record, or null when it died or moved on to a later group (RecordIndex::regroup): then a later entry is
  // its place.
  std::shared_ptr<OffloadRecord> lock() const;
};

// The live records of one scope.
class RecordIndex {
 public:
  // Indexes `record` (its `source` must be set); it stays indexed while some handle holds it.
  void add(const std::shared_ptr<OffloadRecord>& record);
  // A live record of `storage` whose span covers [begin, end) and that `accept`s (if given), or null.
  std::shared_ptr<OffloadRecord> find(const c10::StorageImpl* storage, int64_t begin, int64_t end,
                                      const std::function<bool(const OffloadRecord&)>& accept = nullptr) const;
  // `record`, found again by a pack in a later `group` (a tensor every layer saves: rotary cos/sin), moves to that
  // group at the end of pack order (sequence number `seq`, scope entry `epoch`): backward, in reverse, needs it there
  // first, so prefetch brings it back with that group -- not with its first group, whose neighbours would come back
  // a whole layer early. RestoreState::held keeps it for the earlier groups' handles. No-op for an earlier group.
  void regroup(const std::shared_ptr<OffloadRecord>& record, int64_t group, int64_t seq, int64_t epoch);
  // Records in pack order, oldest first (entries may have expired or moved: PackEntry::lock).
  const std::vector<PackEntry>& in_pack_order() const { return records_; }
  // Entries held, expired ones included (what pruning is scheduled by).
  size_t size() const { return records_.size(); }
  // Records still alive.
  int64_t live() const;
  // Drops expired entries.
  void prune();

 private:
  std::vector<PackEntry> records_;
  std::unordered_multimap<const c10::StorageImpl*, std::weak_ptr<OffloadRecord>> by_storage_;
};

}  // namespace hsoffload
