// Device blocks held until their side-stream or consumer use is done (keepalive.h).
#include "hsoffload/keepalive.h"

#include "hsoffload/events.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>

namespace hsoffload {

namespace {

// The owner stream's later work (a reuse of the block) runs after the use. Never throws: on a dead context the
// calls raise, and the block is let go untagged all the same. Allocates nothing: a consumer's event exists since
// its hold, and recording an existing event or waiting on it makes no new one.
void order_owner_after_use(const std::shared_ptr<c10::Event>& used, bool& marked,
                           const std::optional<c10::Stream>& consumer,
                           const std::optional<c10::Stream>& owner) noexcept {
  try {
    if (!marked && consumer) {
      used->record(*consumer);  // the consumer's work queued so far
      marked = true;
    }
    if (marked && used && owner) used->block(*owner);
  } catch (...) {  // NOLINT(bugprone-empty-catch): a dead context
  }
}

}  // namespace

void KeepAlive::reserve_hold() { entries_.reserve(entries_.size() + 1); }

void KeepAlive::hold_source(c10::Storage storage, std::shared_ptr<c10::Event> copied) {
  entries_.push_back(Entry{Kind::kSource, std::move(storage), std::move(copied), true, std::nullopt, std::nullopt});
  ++holds_;
}

void KeepAlive::hold_restore(c10::Storage storage, std::shared_ptr<c10::Event> written, c10::Stream owner) {
  entries_.push_back(Entry{Kind::kRestore, std::move(storage), std::move(written), true, owner, std::nullopt});
  ++holds_;
}

void KeepAlive::hold_consumer(c10::Storage storage, c10::Stream consumer, c10::Stream owner) {
  // Made and recorded once now, so that marking the end of the use (reap, release_*) allocates nothing; until then
  // `marked` is false and the event says nothing.
  auto used = std::make_shared<c10::Event>(consumer.device_type());
  used->record(consumer);
  entries_.push_back(Entry{Kind::kConsumer, std::move(storage), std::move(used), false, owner, consumer});
  ++holds_;
}

void KeepAlive::reap() noexcept {
  for (Entry& e : entries_) {
    if (!e.marked && e.storage.use_count() == 1) {
      // Nothing but this hold references the block: its users are gone, every kernel that reads it is queued.
      try {
        e.used->record(*e.consumer);
        e.marked = true;
      } catch (...) {  // NOLINT(bugprone-empty-catch): a dead context: release_consumers or drop_failed lets go
      }
    }
  }
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [](const Entry& e) { return e.marked && event_completed(*e.used); }),
                 entries_.end());
}

void KeepAlive::release_if(std::optional<Kind> kind, const Capturing& capturing, void (*settle)(Entry&)) noexcept {
  const auto kept = [&](const Entry& e) noexcept {
    bool keep = kind && e.kind != *kind;
    if (!keep && capturing) {
      try {
        keep = capturing(e.storage.device());
      } catch (...) {  // NOLINT(bugprone-empty-catch): cannot tell; let go as on a dead context
      }
    }
    return keep;
  };
  // In place, no allocation: the kept entries move to the front (std::partition swaps), the rest are settled, then
  // erased -- each storage's reference is dropped after every event call.
  const auto released = std::partition(entries_.begin(), entries_.end(), kept);
  for (auto it = released; it != entries_.end(); ++it) settle(*it);
  entries_.erase(released, entries_.end());
}

void KeepAlive::release_restores(const Capturing& capturing) noexcept {
  release_if(Kind::kRestore, capturing, [](Entry& e) { order_owner_after_use(e.used, e.marked, e.consumer, e.owner); });
}

void KeepAlive::release_consumers(const Capturing& capturing) noexcept {
  release_if(Kind::kConsumer, capturing, [](Entry& e) { order_owner_after_use(e.used, e.marked, e.consumer, e.owner); });
}

void KeepAlive::drop_failed() noexcept {
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [](const Entry& e) {
                                  return e.marked && e.used && event_state(*e.used) == EventState::kFailed;
                                }),
                 entries_.end());
}

void KeepAlive::release_all(const Capturing& capturing) noexcept {
  release_if(std::nullopt, capturing, [](Entry& e) {
    if (e.kind == Kind::kSource) {
      if (e.used) wait_event(*e.used);  // its block's owner stream is not known: the copy must be done
      return;
    }
    order_owner_after_use(e.used, e.marked, e.consumer, e.owner);
  });
}

void KeepAlive::hand_off_sources(SourceReaper& reaper, const Capturing& capturing) {
  // The sources to the back (in place), copied (reference counts, no allocation) into one batch the reaper adopts
  // whole or not at all; only then are they erased here.
  const auto stays = [&](const Entry& e) noexcept {
    if (e.kind != Kind::kSource || !e.used) return true;
    try {
      if (capturing && capturing(e.storage.device())) return true;  // no query there: a later call reaps it
    } catch (...) {
      return true;
    }
    // Running, or done since the caller's reap: the reaper lets go of it (at once when done). Failed: the caller's
    // drop_failed decides.
    return event_state(*e.used) == EventState::kFailed;
  };
  const auto moving = std::partition(entries_.begin(), entries_.end(), stays);
  if (moving == entries_.end()) return;
  std::vector<SourceReaper::Source> batch;
  batch.reserve(static_cast<size_t>(entries_.end() - moving));
  for (auto it = moving; it != entries_.end(); ++it) batch.push_back(SourceReaper::Source{it->storage, it->used});
  reaper.adopt(std::move(batch));  // may throw: nothing adopted, everything still held here
  entries_.erase(moving, entries_.end());
}

// ---------------------------------------------------------------------------
// SourceReaper

struct SourceReaper::State {
  std::mutex mutex;
  std::condition_variable wake;
  std::vector<Source> pending;  // guarded by mutex
  bool fresh = false;           // sources adopted since the thread last looked: poll from the shortest pause
  bool started = false;
  int64_t released = 0;
};

SourceReaper::SourceReaper() : state_(std::make_shared<State>()) {}

SourceReaper& SourceReaper::instance() {
  // A static whose destruction at exit only drops its reference: the thread holds the state too.
  static SourceReaper reaper;
  return reaper;
}

int64_t SourceReaper::pending() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return static_cast<int64_t>(state_->pending.size());
}

int64_t SourceReaper::released() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->released;
}

void SourceReaper::adopt(std::vector<Source>&& batch) {
  State& st = *state_;
  {
    std::lock_guard<std::mutex> lock(st.mutex);
    st.pending.reserve(st.pending.size() + batch.size());  // may throw: nothing taken yet
    if (!st.started) {
      std::thread(run, state_).detach();  // may throw: nothing taken yet
      st.started = true;
    }
    for (Source& s : batch) st.pending.push_back(std::move(s));  // within the capacity: no allocation, no throw
    st.fresh = true;
  }
  batch.clear();
  st.wake.notify_one();
}

void SourceReaper::run(std::shared_ptr<State> state) noexcept {
  // The thread's whole body allocates nothing: queries (events.h), condition waits, moves within `pending`.
  State& st = *state;
  std::unique_lock<std::mutex> lock(st.mutex);
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    st.wake.wait(lock, [&] { return !st.pending.empty(); });
    if (st.fresh) {
      st.fresh = false;
      pause = std::chrono::microseconds(20);
    }
    bool failed = false;
    for (size_t i = 0; i < st.pending.size();) {
      const EventState state_now = event_state(*st.pending[i].copied);
      if (state_now != EventState::kDone) {
        failed = failed || state_now == EventState::kFailed;  // never let go on a failed query's word
        ++i;
        continue;
      }
      Source done = std::move(st.pending[i]);
      if (i + 1 != st.pending.size()) st.pending[i] = std::move(st.pending.back());
      st.pending.pop_back();
      ++st.released;
      lock.unlock();
      done = Source{};  // let go outside the mutex: a deleter may take other locks
      lock.lock();      // only this thread removes entries: index i is still the next to look at
    }
    if (st.pending.empty()) continue;
    st.wake.wait_for(lock, failed ? std::chrono::microseconds(100000) : pause, [&] { return st.fresh; });
    pause = std::min<std::chrono::microseconds>(2 * pause, std::chrono::milliseconds(1));
  }
}

}  // namespace hsoffload
