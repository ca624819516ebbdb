// hsemu runtime: the asynchronous parts of the emulated accelerator used by the
// test suite (streams as worker threads, events, a stream-aware device
// allocator that poisons freed memory, a pinned host allocator).
//
// Test-only code: never linked into libhsoffload.so. It knows nothing of the
// dispatcher; emu_backend.cpp binds it to PrivateUse1.
//
// Semantics (what a CUDA-like device promises, and what the tests rely on):
// - A stream runs its queued jobs in order on its own thread. Work queued on
//   different streams is unordered unless an event orders it.
// - A freed device block is reusable at once by later allocations on the stream
//   that allocated it (their work is ordered after the free), and by nobody
//   else; if other streams were recorded as users (`record_stream`), it is
//   reusable only after the work those streams had queued at the free has run.
// - Freed device blocks are filled with kPoison by a job on their allocation
//   stream, and fresh blocks (device and pinned) start as kPoison: reading
//   memory nobody wrote shows up as NaN / -1, not as luck. Blocks are reused
//   most-recently-freed first.
// - A pinned host block freed while a queued copy still uses it is kept until
//   that copy has run (as torch's caching host allocator does for CUDA).
//
// Thread-safety: every function here may be called from any thread.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace hsemu {

constexpr unsigned char kPoison = 0xFF;  // NaN in every float dtype, -1 in signed ints

// ---- streams ---------------------------------------------------------------

// Stream ids: 0 is the default stream; ids 1..kPoolStreams are handed out
// round-robin as pool streams; getNewStream ids start at kFirstNewStream.
constexpr c10::StreamId kPoolStreams = 4;
constexpr c10::StreamId kFirstNewStream = 64;

// Queues `job` on stream `id`; returns its ticket (the stream's count of
// queued jobs after this one). A job must not take the allocator locks.
uint64_t enqueue(c10::StreamId id, std::function<void()> job);
// Number of jobs queued on `id` so far (the ticket an event records).
uint64_t enqueued(c10::StreamId id);
// True once every job up to `ticket` on `id` has run.
bool done(c10::StreamId id, uint64_t ticket);
// Blocks the calling thread until every job up to `ticket` on `id` has run.
void wait(c10::StreamId id, uint64_t ticket);
// Blocks until every job queued on `id` so far has run.
void drain(c10::StreamId id);
// Blocks until every stream is idle.
void drain_all();

// The calling thread's current stream (per thread, like CUDA's).
c10::StreamId current_stream();
void set_current_stream(c10::StreamId id);
// Pool streams: low priority ids 1..kPoolStreams, high priority ids kHighPriorityPool..+kPoolStreams-1, each handed
// out round-robin (like CUDA's per-priority pools).
constexpr c10::StreamId kHighPriorityPool = 32;
c10::StreamId next_pool_stream(bool high_priority = false);
bool is_high_priority(c10::StreamId id);
c10::StreamId new_stream();

// ---- events ------------------------------------------------------------------

struct Event {
  c10::StreamId stream = -1;  // -1: never recorded
  uint64_t ticket = 0;
  bool captured = false;  // recorded on a stream that was capturing (see "graph capture")
};

// ---- graph capture (emulated; one capture at a time) -------------------------------
//
// A capturing stream runs its work as usual (nothing is replayed), but the emulator records what CUDA forbids
// during a capture (global capture mode): pinned allocation, querying or synchronizing a captured event,
// synchronizing a stream or the device; a capturing stream waiting on an event recorded outside the capture; a
// stream that joined the capture (it waited on a captured event) and was not joined back into the capturing
// stream before the capture ended. end_capture returns those violations; the capture then failed.
void begin_capture(c10::StreamId id);
std::vector<std::string> end_capture(c10::StreamId id);
// True if `id` is the capturing stream or a stream that joined its capture.
bool is_capturing(c10::StreamId id);
bool any_capturing();
void capture_violation(const std::string& what);
// block(event recorded on `from` (captured or not), onto stream `to`): joins, forks and illegal waits.
void capture_wait(const Event& e, c10::StreamId to);

// ---- faults (what a dead device context or a full device does) ----------------------------------------------------

// While set, every event query and event synchronize raises (as CUDA does after a sticky error: a device-side
// assert), naming the emulated fault.
void set_event_fault(bool on);
bool event_fault();
// While set, every pinned host allocation raises (pinned memory exhausted).
void set_pinned_alloc_fault(bool on);
bool pinned_alloc_fault();
// Device bytes the allocator may hand out at once (0: unlimited); an allocation beyond it raises
// c10::OutOfMemoryError, as the CUDA caching allocator does.
void set_device_capacity(int64_t bytes);
int64_t device_capacity();

// ---- copy delays (widen race windows) -----------------------------------------

enum class CopyKind { kHostToDevice = 0, kDeviceToHost = 1, kDeviceToDevice = 2 };
// Microseconds every queued copy of that kind sleeps before it runs.
// Initialised from HSOFFLOAD_EMU_COPY_DELAY_US (all kinds).
int64_t copy_delay_us(CopyKind kind);
void set_copy_delay_us(CopyKind kind, int64_t us);
// Bytes per second a queued copy of that kind moves (0: unlimited). A copy of n bytes then takes its delay plus
// n / rate: copy time proportional to bytes, as on a bus (the step-time model's validation sweeps it).
int64_t copy_rate_bytes_per_s(CopyKind kind);
void set_copy_rate_bytes_per_s(CopyKind kind, int64_t bytes_per_s);
// Microseconds a copy of `nbytes` of that kind sleeps: the delay plus the bytes at the rate.
int64_t copy_sleep_us(CopyKind kind, int64_t nbytes);

// ---- allocators ----------------------------------------------------------------

// The device allocator (what at::empty on the emulated device uses).
c10::Allocator* device_allocator();
// Tells the device allocator that stream `id` uses the block starting at `ptr`
// (the base pointer of a storage). Raises for a pointer it did not hand out.
void record_stream(const void* ptr, c10::StreamId id);

// The pinned host allocator (pin_memory() / pinned_memory=True for this device).
c10::Allocator* pinned_allocator();
// True if `ptr` lies inside a live pinned block.
bool is_pinned(const void* ptr);
// Records that the job with `ticket` on stream `id` uses the pinned block
// containing `ptr`; the block is not reused before that job has run. No-op for
// pointers that are not pinned.
void record_pinned_use(const void* ptr, c10::StreamId id, uint64_t ticket);
// Frees idle pinned blocks whose uses have completed.
void empty_pinned_cache();

// ---- counters -------------------------------------------------------------------

struct Counters {
  int64_t async_copies = 0;         // copies that returned before running
  int64_t sync_copies = 0;          // copies the caller waited for
  int64_t cross_stream_waits = 0;   // event waits queued on another stream
  int64_t device_allocs = 0;        // device blocks handed out
  int64_t device_reuses = 0;        // ... of which were reused freed blocks
  int64_t deferred_frees = 0;       // device frees held back by record_stream uses
  int64_t pinned_deferred_frees = 0;  // pinned frees held back by pending copies
  int64_t host_syncs = 0;           // stream, event or device synchronisations (the host waited)
  int64_t job_errors = 0;           // jobs that threw (reported on stderr)
  // Gauges, not cumulative: bytes handed out in live device blocks (each request rounded up to 512 bytes, as
  // torch.cuda.memory_allocated counts; a reused larger block counts as the request, as CUDA's splitting makes
  // it), and their high-water mark since the last reset_peak_allocated().
  // A block counts from allocate() to free(), even while its reuse is held back by record_stream uses.
  int64_t allocated_bytes = 0;
  int64_t peak_allocated_bytes = 0;
};
Counters counters();
void count(int64_t Counters::*field, int64_t n = 1);
// Adds `delta` (negative on free) to allocated_bytes and raises peak_allocated_bytes to it.
void count_allocated(int64_t delta);
// Sets peak_allocated_bytes to the current allocated_bytes (torch.cuda.reset_peak_memory_stats).
void reset_peak_allocated();

}  // namespace hsemu
