// Device blocks a side stream (or a consumer on another stream) still uses, held by the engine until that use is
// known to be done -- instead of telling the caching allocator of the use (`recordDataPtrOnStream`).
//
// Why: freeing a block the allocator was told of records an event on each recorded stream (CUDA's `insert_events`).
// After a sticky device error (a device-side assert in the user's loss, then `backward()` with no sync) that call
// raises, from the DataPtr's deleter inside a noexcept destructor: std::terminate, and the user never sees their
// own error. A block held here is never tagged: whoever lets go of it last, the allocator frees it plainly
// (docs/design.md, "Faults"). The cost: a block stays allocated until the engine sees its use done (at the next pack
// or unpack, or -- for a copy's source still read when the scope exits -- on the SourceReaper's thread as soon as
// the copy is done), where a tagged one was reusable as soon as the allocator saw that.
//
// No allocation on the release paths: every release call below is noexcept and allocates nothing (an allocation
// that fails there would be std::terminate): the room and the events they need are made by `reserve_hold` and the
// hold calls, which may throw (docs/design.md, "What must not throw").
//
// Thread-safety: KeepAlive has none of its own; its owner (OffloadScope) calls it under its mutex (the destructor
// alone without). SourceReaper is thread-safe (its own mutex; its thread never takes a scope's).
#pragma once

#include <c10/core/Event.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace hsoffload {

class SourceReaper;

class KeepAlive {
 public:
  // Devices whose current stream captures a graph (no event may be queried, recorded or waited on there): their
  // blocks stay held through the release calls below, for a later call.
  using Capturing = std::function<bool(c10::Device)>;

  // Makes room for one more hold. May throw (an allocation): the transfers call it before they queue a copy, so
  // that the hold after the queued copy cannot fail (a block nobody holds could be reused while the copy runs).
  void reserve_hold();
  // A pack's source, read by the copy to host until `copied` completes. Its block returns to the pool of the stream
  // it was allocated on, which the engine does not know: it is let go only once the copy is known done. Allocates
  // nothing after reserve_hold.
  void hold_source(c10::Storage storage, std::shared_ptr<c10::Event> copied);
  // A restored block the engine allocated on `owner`, written by the copy to device until `written` completes.
  // Allocates nothing after reserve_hold.
  void hold_restore(c10::Storage storage, std::shared_ptr<c10::Event> written, c10::Stream owner);
  // A restored block (allocated on `owner`) read on `consumer`, another stream, whose use ends after kernels not yet
  // queued: its event is recorded on `consumer` once nothing but this hold references the block (its users are
  // gone, their work queued), or when the graph task has queued all its work (release_consumers). That event is
  // made here (recorded once on `consumer`, which creates the device event), so marking the use later allocates
  // nothing. May throw (the event) before it holds anything.
  void hold_consumer(c10::Storage storage, c10::Stream consumer, c10::Stream owner);

  // Lets go of the blocks whose use has completed, and marks the end of a consumer's use where nothing else
  // references its block. Call only where no graph is being captured on these devices. Allocates nothing.
  void reap() noexcept;
  // Lets go of the restored blocks now: their owner stream waits for the copy on the device (no host wait).
  // Allocates nothing.
  void release_restores(const Capturing& capturing) noexcept;
  // Lets go of the consumers' blocks now: the owner stream waits for an event recorded on the consumer stream now.
  // Allocates nothing.
  void release_consumers(const Capturing& capturing) noexcept;
  // Lets go of the blocks whose event query fails (a dead context: it never completes; untagged, their free cannot
  // raise, and nothing runs on that device again). Allocates nothing.
  void drop_failed() noexcept;
  // Lets go of everything (the owner's destructor): restores and consumers as above, sources after a host wait for
  // their copy (at once on a dead context). Allocates nothing.
  void release_all(const Capturing& capturing) noexcept;
  // Moves the sources (but those whose query fails, and those of a device that `capturing` names) to `reaper`,
  // which lets go of each as soon as its copy is done, with no later call into the engine (the scope's exit). May
  // throw (an allocation, starting the reaper's thread) before it moved any: they then stay here, as before.
  void hand_off_sources(SourceReaper& reaper, const Capturing& capturing);

  // Blocks held now.
  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  // Blocks ever held.
  int64_t holds() const { return holds_; }

 private:
  enum class Kind { kSource, kRestore, kConsumer };
  struct Entry {
    Kind kind;
    c10::Storage storage;
    std::shared_ptr<c10::Event> used;  // completes with the use (a consumer's: once `marked`)
    bool marked = true;                // false: a consumer's use not marked yet (`used` does not tell its end)
    std::optional<c10::Stream> owner;  // restores and consumers: the stream the engine allocated the block on
    std::optional<c10::Stream> consumer;
  };
  // Lets go of the entries of `kind` (all kinds: nullopt) that `capturing` does not keep, after `settle` for each.
  // In place (the kept ones are moved to the front): no allocation.
  void release_if(std::optional<Kind> kind, const Capturing& capturing, void (*settle)(Entry&)) noexcept;

  std::vector<Entry> entries_;
  int64_t holds_ = 0;
};

// The sources scopes handed off at exit while their copies to host ran (KeepAlive::hand_off_sources): one thread
// per process lets go of each as soon as a query of its copy's event says done, so the device gets the block back at
// copy speed with no later call into the engine (docs/design.md, "Faults": sources held past their copy). The thread
// starts at the first hand-off (again in a forked child), sleeps while it holds nothing and polls, while it does,
// with the pause of wait_event (20 us doubling to 1 ms). A failed query (a dead context, or another thread
// capturing a CUDA graph in global mode) never lets a source go: it is asked again, every 100 ms.
//
// Thread-safety: every method may be called from any thread (one mutex). Storages are let go on the reaper's
// thread outside that mutex (a deleter may take other locks, e.g. a DLPack producer's GIL).
class SourceReaper {
 public:
  // The process's reaper (never destroyed: its thread may outlive static destruction).
  static SourceReaper& instance();
  // Sources handed off and not yet let go.
  int64_t pending() const;
  // Sources let go so far (since the process started).
  int64_t released() const;

 private:
  friend class KeepAlive;
  struct Source {
    c10::Storage storage;
    std::shared_ptr<c10::Event> copied;
  };
  SourceReaper();
  // Takes every source of `batch` or none: may throw (an allocation, starting the thread) before it takes any.
  void adopt(std::vector<Source>&& batch);
  struct State;
  static void run(std::shared_ptr<State> state) noexcept;

  std::shared_ptr<State> state_;  // shared with the thread
};

}  // namespace hsoffload
