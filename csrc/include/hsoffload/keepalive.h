// Device blocks a side stream still uses, held by the engine until that use is known to be done -- instead of
// telling the caching allocator of the use (`recordDataPtrOnStream`).
//
// Why: freeing a block the allocator was told of records an event on each recorded stream (CUDA's `insert_events`).
// After a sticky device error (a device-side assert in the user's loss, then `backward()` with no sync) that call
// raises, from the DataPtr's deleter inside a noexcept destructor: std::terminate, and the user never sees their
// own error. A block held here is never tagged: whoever lets go of it last, the allocator frees it plainly
// (docs/design.md, "Faults"). The cost: a block stays allocated until the engine sees its copy done (at the next
// pack or unpack, at the end of a backward, at scope exit), where a tagged one was reusable as soon as the allocator
// saw it.
//
// Thread-safety: none of its own; its owner (OffloadScope) calls it under its mutex. Never throws.
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
  // Keeps `storage` until `used` (an event recorded after the side stream's last use of it) has completed.
  // `owner`: the stream whose pool the block returns to (the stream current when it was allocated), whose later
  // work may be ordered after `used` instead of waiting for it; nullopt for memory no stream-ordered allocator
  // owns (from_blob, DLPack, a graph pool's raw pointer), which is only let go once `used` has completed.
  void hold(c10::Storage storage, std::shared_ptr<c10::Event> used, std::optional<c10::Stream> owner);
  // Keeps `storage`, used by `consumer` (a stream other than its `owner`), until release_all: when that use ends is
  // not known before the graph task that consumes it has queued all its work.
  void hold_until_release(c10::Storage storage, c10::Stream consumer, c10::Stream owner);
  // Lets go of the blocks whose use has completed (a failed query counts as not completed).
  void reap() noexcept;
  // Lets go of every block: one still in use after its owner stream waits for that use on the device (no host
  // wait; a consumer's use is first marked by an event recorded on its stream now), foreign memory after a host
  // wait. On a dead device context (a sticky error: the event calls raise) it is let go all the same -- untagged,
  // its free cannot raise, and nothing runs on that device again.
  // `capturing` (may be null): devices whose current stream captures a graph keep their blocks (no event may be
  // recorded or waited on there); they are let go by a later call.
  void release_all(const std::function<bool(c10::Device)>& capturing = nullptr) noexcept;
  // Blocks held now.
  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  // Blocks ever held (hold and hold_until_release calls).
  int64_t holds() const { return holds_; }

 private:
  struct Entry {
    c10::Storage storage;
    std::shared_ptr<c10::Event> used;  // null: a consumer's use, marked at release_all
    std::optional<c10::Stream> owner;
    std::optional<c10::Stream> consumer;
  };
  std::vector<Entry> entries_;
  int64_t holds_ = 0;
};

}  // namespace hsoffload
