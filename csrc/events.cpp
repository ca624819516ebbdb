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

bool event_completed(const c10::Event& event) noexcept {
  try {
    return event.query();
  } catch (...) {
    failed_queries.fetch_add(1);
    return true;  // the context is dead: nothing will run on it again, nothing still uses the memory
  }
}

void wait_event(const c10::Event& event) noexcept {
  auto pause = std::chrono::microseconds(20);
  while (!event_completed(event)) {
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(2 * pause, std::chrono::milliseconds(1));
  }
}

int64_t failed_event_queries() noexcept { return failed_queries.load(); }

}  // namespace hsoffload
