// Device blocks a side stream (or a consumer on another stream) still uses, held by the engine until that use is
// known to be done -- instead of telling the caching allocator of the use (`recordDataPtrOnStream`).
//
// Why: freeing a block the allocator was told of records an event on each recorded stream (CUDA's `insert_events`).
// After a sticky device error (a device-side assert in the user's loss, then `backward()` with no sync) that call
// raises, from the DataPtr's deleter inside a noexcept destructor: std::terminate, and the user never sees their
// own error. A block held here is never tagged: whoever lets go of it last, the allocator frees it plainly
// (docs/design.md, "Faults"). The cost: a block stays allocated until the engine sees its use done (at the next pack
// or unpack), where a tagged one was reusable as soon as the allocator saw that.
//
// Thread-safety: none of its own; its owner (OffloadScope) calls it under its mutex (the destructor alone without).
// Only the hold calls may throw (an allocation); the others never do.
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

class KeepAlive {
 public:
  // Devices whose current stream captures a graph (no event may be queried, recorded or waited on there): their
  // blocks stay held through the release calls below, for a later call.
  using Capturing = std::function<bool(c10::Device)>;

  // A pack's source, read by the copy to host until `copied` completes. Its block returns to the pool of the stream
  // it was allocated on, which the engine does not know: it is let go only once the copy is known done.
  void hold_source(c10::Storage storage, std::shared_ptr<c10::Event> copied);
  // A restored block the engine allocated on `owner`, written by the copy to device until `written` completes.
  void hold_restore(c10::Storage storage, std::shared_ptr<c10::Event> written, c10::Stream owner);
  // A restored block (allocated on `owner`) read on `consumer`, another stream, whose use ends after kernels not yet
  // queued: its event is recorded on `consumer` once nothing but this hold references the block (its users are
  // gone, their work queued), or when the graph task has queued all its work (release_consumers).
  void hold_consumer(c10::Storage storage, c10::Stream consumer, c10::Stream owner);

  // Lets go of the blocks whose use has completed, and marks the end of a consumer's use where nothing else
  // references its block. Call only where no graph is being captured on these devices.
  void reap() noexcept;
  // Lets go of the restored blocks now: their owner stream waits for the copy on the device (no host wait).
  void release_restores(const Capturing& capturing) noexcept;
  // Lets go of the consumers' blocks now: the owner stream waits for an event recorded on the consumer stream now.
  void release_consumers(const Capturing& capturing) noexcept;
  // Lets go of the blocks whose event query fails (a dead context: it never completes; untagged, their free cannot
  // raise, and nothing runs on that device again).
  void drop_failed() noexcept;
  // Lets go of everything (the owner's destructor): restores and consumers as above, sources after a host wait for
  // their copy (at once on a dead context).
  void release_all(const Capturing& capturing) noexcept;

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
    std::shared_ptr<c10::Event> used;  // null: a consumer's use not marked yet
    std::optional<c10::Stream> owner;  // restores and consumers: the stream the engine allocated the block on
    std::optional<c10::Stream> consumer;
  };
  // Lets go of the entries of `kind` (all kinds: nullopt) that `capturing` does not keep, after `settle` for each.
  void release_if(std::optional<Kind> kind, const Capturing& capturing, void (*settle)(Entry&)) noexcept;

  std::vector<Entry> entries_;
  int64_t holds_ = 0;
};

}  // namespace hsoffload
