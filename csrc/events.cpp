// Event queries that never throw or spin (events.h).
#include "hsoffload/events.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

namespace hsoffload {

namespace {
// Process-wide on purpose: a failed query means the device context is dead for every scope alike. Atomic.
std::atomic<int64_t> failed_queries{0};
}  // namespace

EventState event_state(const c10::Event& event) noexcept {
  try {
    return event.query() ? EventState::kDone : EventState::kRunning;
  } catch (...) {
    failed_queries.fetch_add(1);
    return EventState::kFailed;
  }
}

bool event_completed(const c10::Event& event) noexcept { return event_state(event) == EventState::kDone; }

bool wait_event(const c10::Event& event) noexcept {
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    switch (event_state(event)) {
      case EventState::kDone:
        return true;
      case EventState::kFailed:
        return false;
      case EventState::kRunning:
        break;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(2 * pause, std::chrono::milliseconds(1));
  }
}

int64_t failed_event_queries() noexcept { return failed_queries.load(); }

}  // namespace hsoffload
