// Device events asked from places that must not throw or spin: destructors and noexcept paths (the host pool's
// give-back and reaping, a HostBlock's release) and the spill tier's I/O threads.
//
// `c10::Event::query()` raises on every device error other than "not ready". After a sticky error (a device-side
// assert from an out-of-range label is the common one) the context is dead: every later query raises too, and no
// queued device work will ever run again. An exception from a destructor terminates the process and hides the
// user's own error, so here a failed query counts as completed: nothing can still use memory on a dead context, and
// the error reaches the user through their own next device call (docs/design.md, "Faults").
//
// Thread-safety: free functions of their argument; safe from any thread.
#pragma once

#include <c10/core/Event.h>

#include <cstdint>

namespace hsoffload {

// True if `event` has completed, was never recorded, or cannot be asked any more (a failed query). Never throws.
bool event_completed(const c10::Event& event) noexcept;

// Blocks the calling thread (an I/O thread, never a hook) until `event_completed(event)`, sleeping between queries
// (from 20 us, doubling, at most 1 ms) instead of spinning a core.
void wait_event(const c10::Event& event) noexcept;

// Process-wide count of event queries that failed (the context was dead), for tests and diagnostics.
int64_t failed_event_queries() noexcept;

}  // namespace hsoffload
