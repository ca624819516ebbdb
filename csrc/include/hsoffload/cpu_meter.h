// The CPU meter: a counting allocator in front of the CPU allocator, so that a run whose device is the CPU has the
// figures torch.cuda's memory_allocated / max_memory_allocated give on a GPU (policy "auto" measures and verifies its
// decision with them). Allocations made while a HostAllocation is alive on the thread (the host pool's slabs and
// blocks, spill staging) count as host memory: offloaded copies leave the device's count, as on a GPU.
//
// Process-wide by nature (a process has one CPU allocator), installed on first request and never removed (storages
// it lent are freed through it for as long as they live). Only allocations made after the install are counted, and
// only those made through the CPU allocator: storages torch makes with c10's default CPU allocator directly (Python's
// storage constructors: copy.deepcopy of a tensor, torch.load) are not.
//
// Blocks stay their own context (the CPU allocator's must: c10's raw_allocate asserts it); each block's size is kept
// in a ledger keyed by its pointer. Thread-safety: every function may be called from any thread; counters are
// atomics, the ledger has a mutex.
#pragma once

#include "hsoffload/stats.h"

namespace hsoffload {

// Puts the counting allocator in front of the CPU allocator (idempotent). Returns false if another allocator of a
// higher priority keeps its place (nothing is counted then).
bool install_cpu_meter();

// What the meter counted (zeros and installed = 0 before install_cpu_meter()).
CpuMeterStats cpu_meter_stats();

// peak_allocated_bytes := allocated_bytes now.
void reset_cpu_meter_peak();

// While alive, CPU allocations on this thread count as host memory (not the device's). Nests.
class HostAllocation {
 public:
  HostAllocation();
  ~HostAllocation();
  HostAllocation(const HostAllocation&) = delete;
  HostAllocation& operator=(const HostAllocation&) = delete;

 private:
  bool previous_;
};

}  // namespace hsoffload
