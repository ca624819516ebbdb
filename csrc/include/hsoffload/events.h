// Device events asked from places that must not throw or spin: destructors and noexcept paths (the host pool's
// give-back and reaping, a HostBlock's release) and the spill tier's I/O threads.
//
// `c10::Event::query()` raises on every device error other than "not ready". After a sticky error (a device-side
// assert from an out-of-range label is the common one) the context is dead and every later query raises too; an
// exception from a destructor terminates the process and hides the user's own error. So these never throw. A failed
// query counts as NOT completed: what the event guards (a pinned range, a foreign source) is never reused on its
// word. On a dead context that memory is held until the process ends (it ends: the user's own next device call
// raises their error); where a query fails without the context being dead (another thread capturing a CUDA graph
// in global mode) nothing still being copied is ever reused (docs/design.md, "Faults").
//
// Thread-safety: free functions of their argument; safe from any thread.
#pragma once

#include <c10/core/Event.h>

#include <cstdint>

namespace hsoffload {

// What a query of `event` says: done (or never recorded), still running, or failed (a dead context). Never throws.
enum class EventState { kDone, kRunning, kFailed };
EventState event_state(const c10::Event& event) noexcept;

// True if `event` has completed or was never recorded; false while it runs and when the query failed. Never throws.
bool event_completed(const c10::Event& event) noexcept;

// Blocks the calling thread (an I/O thread, a destructor; never a hook) until `event` has completed, sleeping
// between queries (from 20 us, doubling, at most 1 ms) instead of spinning a core. False if a query failed (the
// wait ends there: the caller must not use what the event guards as if it were done).
bool wait_event(const c10::Event& event) noexcept;

// Process-wide count of event queries that failed (the context was dead), for tests and diagnostics.
int64_t failed_event_queries() noexcept;

}  // namespace hsoffload
