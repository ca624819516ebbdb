// Device blocks held until their side-stream use is done (keepalive.h).
#include "hsoffload/keepalive.h"

#include "hsoffload/events.h"

#include <algorithm>
#include <utility>

namespace hsoffload {

void KeepAlive::hold(c10::Storage storage, std::shared_ptr<c10::Event> used, std::optional<c10::Stream> owner) {
  entries_.push_back(Entry{std::move(storage), std::move(used), owner, std::nullopt});
  ++holds_;
}

void KeepAlive::hold_until_release(c10::Storage storage, c10::Stream consumer, c10::Stream owner) {
  entries_.push_back(Entry{std::move(storage), nullptr, owner, consumer});
  ++holds_;
}

void KeepAlive::reap() noexcept {
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [](const Entry& e) { return e.used && event_completed(*e.used); }),
                 entries_.end());
}

void KeepAlive::release_all(const std::function<bool(c10::Device)>& capturing) noexcept {
  std::vector<Entry> entries;
  entries.swap(entries_);
  for (Entry& e : entries) {
    const c10::Device device = e.storage.device();
    bool kept = false;
    try {
      kept = capturing && capturing(device);
    } catch (...) {  // NOLINT(bugprone-empty-catch): cannot tell; release as on a dead context
    }
    if (kept) {
      entries_.push_back(std::move(e));
      continue;
    }
    if (e.used && event_completed(*e.used)) {
      continue;  // done: let go below
    }
    if (!e.owner) {
      if (e.used) wait_event(*e.used);  // foreign memory: its owner does not order reuse by streams
      continue;
    }
    try {
      if (!e.used) {
        e.used = std::make_shared<c10::Event>(e.owner->device_type());
        e.used->record(*e.consumer);  // the consumer's work queued so far: all of it, once its graph task ended
      }
      e.used->block(*e.owner);  // the owner's later work (a reuse of the block) runs after the use
    } catch (...) {  // NOLINT(bugprone-empty-catch): a dead context; the block is let go untagged all the same
    }
  }
  // `entries` goes out of scope here: each storage's reference is dropped, outside any event call.
}

}  // namespace hsoffload
