// Device blocks held until their side-stream or consumer use is done (keepalive.h).
#include "hsoffload/keepalive.h"

#include "hsoffload/events.h"

#include <algorithm>
#include <utility>

namespace hsoffload {

namespace {

// The owner stream's later work (a reuse of the block) runs after the use. Never throws: on a dead context the
// calls raise, and the block is let go untagged all the same.
void order_owner_after_use(std::shared_ptr<c10::Event>& used, const std::optional<c10::Stream>& consumer,
                           const std::optional<c10::Stream>& owner) noexcept {
  try {
    if (!used && consumer) {
      used = std::make_shared<c10::Event>(consumer->device_type());
      used->record(*consumer);  // the consumer's work queued so far
    }
    if (used && owner) used->block(*owner);
  } catch (...) {  // NOLINT(bugprone-empty-catch): a dead context
  }
}

}  // namespace

void KeepAlive::hold_source(c10::Storage storage, std::shared_ptr<c10::Event> copied) {
  entries_.push_back(Entry{Kind::kSource, std::move(storage), std::move(copied), std::nullopt, std::nullopt});
  ++holds_;
}

void KeepAlive::hold_restore(c10::Storage storage, std::shared_ptr<c10::Event> written, c10::Stream owner) {
  entries_.push_back(Entry{Kind::kRestore, std::move(storage), std::move(written), owner, std::nullopt});
  ++holds_;
}

void KeepAlive::hold_consumer(c10::Storage storage, c10::Stream consumer, c10::Stream owner) {
  entries_.push_back(Entry{Kind::kConsumer, std::move(storage), nullptr, owner, consumer});
  ++holds_;
}

void KeepAlive::reap() noexcept {
  for (Entry& e : entries_) {
    if (!e.used && e.storage.use_count() == 1) {
      // Nothing but this hold references the block: its users are gone, every kernel that reads it is queued.
      try {
        auto used = std::make_shared<c10::Event>(e.consumer->device_type());
        used->record(*e.consumer);
        e.used = std::move(used);
      } catch (...) {  // NOLINT(bugprone-empty-catch): a dead context: release_consumers or drop_failed lets go
      }
    }
  }
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [](const Entry& e) { return e.used && event_completed(*e.used); }),
                 entries_.end());
}

void KeepAlive::release_if(std::optional<Kind> kind, const Capturing& capturing, void (*settle)(Entry&)) noexcept {
  std::vector<Entry> kept;
  std::vector<Entry> released;
  for (Entry& e : entries_) {
    bool keep = kind && e.kind != *kind;
    if (!keep && capturing) {
      try {
        keep = capturing(e.storage.device());
      } catch (...) {  // NOLINT(bugprone-empty-catch): cannot tell; let go as on a dead context
      }
    }
    (keep ? kept : released).push_back(std::move(e));
  }
  entries_ = std::move(kept);
  for (Entry& e : released) settle(e);
  // `released` goes out of scope here: each storage's reference is dropped, after every event call.
}

void KeepAlive::release_restores(const Capturing& capturing) noexcept {
  release_if(Kind::kRestore, capturing, [](Entry& e) { order_owner_after_use(e.used, e.consumer, e.owner); });
}

void KeepAlive::release_consumers(const Capturing& capturing) noexcept {
  release_if(Kind::kConsumer, capturing, [](Entry& e) { order_owner_after_use(e.used, e.consumer, e.owner); });
}

void KeepAlive::drop_failed() noexcept {
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [](const Entry& e) { return e.used && event_state(*e.used) == EventState::kFailed; }),
                 entries_.end());
}

void KeepAlive::release_all(const Capturing& capturing) noexcept {
  release_if(std::nullopt, capturing, [](Entry& e) {
    if (e.kind == Kind::kSource) {
      if (e.used) wait_event(*e.used);  // its block's owner stream is not known: the copy must be done
      return;
    }
    order_owner_after_use(e.used, e.consumer, e.owner);
  });
}

}  // namespace hsoffload
