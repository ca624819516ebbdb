// The engine's counters, each struct generated from one list: a counter is one line here (and one per language
// that reads it by name), nothing else.
//
// Every list is an X-macro `X(name, doc)`. It generates the struct's fields (int64_t, 0 at start; flags are 0/1),
// `fields(s)` (name -> value, in list order: what the ops return as Dict(str, int)) and, for OffloadStats, `add()`.
// The Python package builds its dataclasses from those names and refuses a library whose names differ.
//
// Thread-safety: plain values; whoever owns an instance guards it.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace hsoffload {

// Per scope, and summed over the process (`process_stats()`).
#define HSOFFLOAD_OFFLOAD_STATS(X)                                                                                  \
  X(saved_tensors_seen, "every tensor that reached pack")                                                          \
  X(marked_tensors, "marks whose tensor reached pack (each mark once, however often it is saved)")                 \
  X(offloaded_tensors, "marked tensors whose data went to host (dedup: shared storage counts once)")               \
  X(restored_tensors, "unpacks of offloaded tensors")                                                              \
  X(skipped_marked_tensors, "marked but kept in place (CPU, too small, empty, not plain storage)")                 \
  X(offloaded_bytes, "bytes copied device -> host")                                                                \
  X(restored_bytes, "bytes copied host -> device")                                                                 \
  X(prefetch_hits, "restores served by a prefetch issued earlier")                                                 \
  X(wait_ns, "host time the hooks blocked: unpacks of restores not prefetched, packs waiting for host budget")     \
  X(pool_bytes, "host pool bytes held (a snapshot taken when the stats are read, never summed)")                   \
  X(spilled_tensors, "offloaded tensors whose copy went to spill_dir (host copies written to make room, oldest first)") \
  X(spilled_bytes, "their bytes (included in offloaded_bytes)")                                                    \
  X(spill_read_wait_ns, "host time unpack waited for spilled tensors to be read back")                             \
  X(kept_on_device_tensors, "marked tensors over the host budget left in place (no spill_dir, or no room in time)") \
  X(pack_wait_ns, "host time packs waited for spill writes to free host budget (included in wait_ns)")              \
  X(spill_write_errors, "spill writes that failed (a snapshot when read; a host copy whose write failed stays in host)") \
  X(spilled_from_device_tensors, "spilled straight from device memory: no host copy of the scope could make room")  \
  X(captured_passthrough, "marked tensors saved while the current stream was capturing a graph: left in place")   \
  X(prefetch_oom, "prefetches not started for lack of device memory (the unpack copies on demand instead)")         \
  X(prefetch_dropped, "prefetched blocks given back after an out-of-memory (of a prefetch or a needed restore)")    \
  X(host_alloc_failures, "host (pinned) allocations that failed at pack (the tensor stayed on the device; later packs of the entry skip the allocation and count as kept only)")   \
  X(released_restores, "prefetched or held restores given back when a graph task ended early or the scope exited")   \
  X(side_use_holds, "device blocks held until a side stream's copy of them completed (never tagged in the allocator)")

// The process-wide host pool (HostPool::stats()).
#define HSOFFLOAD_POOL_STATS(X)                                                                                     \
  X(held_bytes, "bytes of slabs the pool owns (lent + free); unpooled blocks are not counted")                     \
  X(in_use_bytes, "bytes lent and not yet returned (granule-rounded)")                                             \
  X(cached_bytes, "free bytes in slabs, ready or waiting for a device event")                                      \
  X(peak_held_bytes, "high-water mark of held_bytes")                                                              \
  X(allocations, "buffers obtained from the allocator (slabs and unpooled blocks)")                                \
  X(reuses, "blocks served from existing slabs without a new allocation")                                          \
  X(unpooled, "blocks served outside the byte limit (a buffer of their own, freed on return)")                     \
  X(acquires, "blocks lent")                                                                                       \
  X(slabs, "slabs held now")                                                                                       \
  X(unpooled_bytes, "bytes of unpooled blocks lent now (outside held_bytes; granule-rounded)")                     \
  X(pinned_bytes, "pinned bytes held for offload now: pinned slabs, pinned unpooled blocks, pinned spill staging")    \
  X(staging_bytes, "bytes of the spill tier's staging chunks (pinned ones count against an explicit limit)")

// The process-wide host budget (HostBudget::stats()).
#define HSOFFLOAD_BUDGET_STATS(X)                                                                                   \
  X(limit, "bytes; resolved (never auto)")                                                                         \
  X(in_flight, "bytes reserved by live records now")                                                               \
  X(peak, "high-water mark of in_flight since the limit was last set")                                             \
  X(refused, "reservations that did not fit (spilled or kept on the device)")                                      \
  X(is_auto, "1: the limit came from compute_auto_budget()")                                                       \
  X(mem_available, "MemAvailable (bytes) the last auto limit was computed from; 0 if none was")                    \
  X(local_world_size, "LOCAL_WORLD_SIZE the auto limit was divided by")                                          \
  X(host_bytes, "host bytes held for offload now (slabs, unpooled blocks, spill staging): pool_stats tells the same")

// One spill store (SpillStore::stats()), shared by the scopes that spill to its directory.
// One InitSkipRecord's counters (InitSkipRecord::stats(); FSDP RAM-efficient loading).
#define HSOFFLOAD_INIT_SKIP_STATS(X)                                                                                \
  X(flagged_tensors, "tensors passed to `flag` while skipping (a tensor listed twice counts twice)")                \
  X(flagged_storages, "distinct storages recorded")                                                                \
  X(flagged_bytes, "bytes of the distinct storages recorded")                                                      \
  X(dropped_writes, "writes into flagged storages that the caller dropped (`note_dropped_write`)")                 \
  X(dropped_bytes, "bytes those writes would have written")                                                        \
  X(live_storages, "recorded storages still alive (a snapshot)")

#define HSOFFLOAD_SPILL_STATS(X)                                                                                    \
  X(bytes_written, "bytes written to spill files")                                                                 \
  X(bytes_read, "bytes read back")                                                                                 \
  X(write_ns, "I/O-thread time spent writing (device copy + pwrite)")                                              \
  X(read_ns, "I/O-thread time spent reading (pread + device copy)")                                                \
  X(files, "spill files open now")                                                                                 \
  X(direct_io, "1: the last file was opened with O_DIRECT")                                                       \
  X(staging_bytes, "host bytes of the I/O threads' staging chunks (pinned: as the host allocator holds them)")

// The CPU meter (cpu_meter.h): what the CPU allocator lent since it was installed, as torch.cuda's memory_allocated
// / max_memory_allocated tell of a GPU's.
#define HSOFFLOAD_CPU_METER_STATS(X)                                                                                \
  X(installed, "1: the counting allocator is the process's CPU allocator")                                        \
  X(allocated_bytes, "bytes lent now to everything but the host pool (the device's, when the device is the CPU)") \
  X(peak_allocated_bytes, "high-water mark of allocated_bytes since the last reset")                             \
  X(host_bytes, "bytes lent now to the host pool and spill staging (offloaded copies: not the device's)")

#define HSOFFLOAD_STATS_FIELD(name, doc) int64_t name = 0;
#define HSOFFLOAD_STATS_PAIR(name, doc) {#name, s.name},

// (name, value) in list order.
using StatFields = std::vector<std::pair<const char*, int64_t>>;

struct OffloadStats {
  HSOFFLOAD_OFFLOAD_STATS(HSOFFLOAD_STATS_FIELD)
  // Adds every counter of `other` (pool_bytes too: callers overwrite that snapshot after summing).
  void add(const OffloadStats& other);
};

struct PoolStats {
  HSOFFLOAD_POOL_STATS(HSOFFLOAD_STATS_FIELD)
};

struct BudgetStats {
  HSOFFLOAD_BUDGET_STATS(HSOFFLOAD_STATS_FIELD)
};

struct SpillStats {
  HSOFFLOAD_SPILL_STATS(HSOFFLOAD_STATS_FIELD)
};

struct CpuMeterStats {
  HSOFFLOAD_CPU_METER_STATS(HSOFFLOAD_STATS_FIELD)
};

struct InitSkipStats {
  HSOFFLOAD_INIT_SKIP_STATS(HSOFFLOAD_STATS_FIELD)
};

inline StatFields fields(const OffloadStats& s) { return {HSOFFLOAD_OFFLOAD_STATS(HSOFFLOAD_STATS_PAIR)}; }
inline StatFields fields(const PoolStats& s) { return {HSOFFLOAD_POOL_STATS(HSOFFLOAD_STATS_PAIR)}; }
inline StatFields fields(const BudgetStats& s) { return {HSOFFLOAD_BUDGET_STATS(HSOFFLOAD_STATS_PAIR)}; }
inline StatFields fields(const SpillStats& s) { return {HSOFFLOAD_SPILL_STATS(HSOFFLOAD_STATS_PAIR)}; }
inline StatFields fields(const CpuMeterStats& s) { return {HSOFFLOAD_CPU_METER_STATS(HSOFFLOAD_STATS_PAIR)}; }
inline StatFields fields(const InitSkipStats& s) { return {HSOFFLOAD_INIT_SKIP_STATS(HSOFFLOAD_STATS_PAIR)}; }

#undef HSOFFLOAD_STATS_FIELD
#undef HSOFFLOAD_STATS_PAIR

}  // namespace hsoffload
