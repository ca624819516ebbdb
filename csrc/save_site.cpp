// Where a save happens (save_site.h).
#include "hsoffload/save_site.h"

#include <ATen/SequenceNumber.h>

#include <atomic>

namespace hsoffload {

namespace {
// Numbers threads in the order they first save; global on purpose (a process-wide counter). Atomic.
std::atomic<uint64_t> next_thread{1};
}  // namespace

SaveSite SaveSite::now() {
  thread_local const uint64_t thread = next_thread.fetch_add(1);
  return SaveSite{thread, at::sequence_number::peek()};
}

}  // namespace hsoffload
