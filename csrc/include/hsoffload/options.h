// The engine's options of one offload scope, as X-macros. GENERATED from python_shim/hsoffload/options.py
// (the one table of knobs) by `python -m hsoffload.options --write`: edit the table, not this file
// (tests/offload/test_options.py fails when they differ).
//
// X(type, name, default): one per option, in the OffloadScope class constructor's argument order. Used for
// the fields of hsoffload::OffloadConfig (scope.h) and the constructor's arguments (ops/registration.cpp).
#pragma once

#include <cstdint>
#include <string>

// min_offload_size: marked tensors smaller than this many bytes stay on the device.
// offload_cpu_tensors: also copy marked CPU tensors into the host pool (CPU runs, tests).
// pin_memory: pinned host buffers for accelerator tensors (needed for asynchronous copies).
// use_streams: copy on side streams ordered by events; false: on the compute stream.
// prefetch_depth: decoder layers (prefetch groups) restored ahead of their use in backward.
// spill_dir: local directory for packs over the host budget (null: they stay on the device).
// spill_prefetch_depth: decoder layers of spilled tensors read back ahead of their use.
// spill_wait_ms: a pack's longest wait (ms) for host room when the disk lags (0: keep on device).
// share_copies: saves of one tensor by several ops share one host copy (fewer bytes; a .data write between the
//   saves then restores the first's bytes).
#define HSOFFLOAD_ENGINE_OPTIONS(X) \
  X(int64_t, min_offload_size, 1024) \
  X(bool, offload_cpu_tensors, false) \
  X(bool, pin_memory, true) \
  X(bool, use_streams, true) \
  X(int64_t, prefetch_depth, 1) \
  X(std::string, spill_dir, "") \
  X(int64_t, spill_prefetch_depth, 2) \
  X(int64_t, spill_wait_ms, 30000) \
  X(bool, share_copies, false)

// The constructor's parameters (the same list as one parameter list).
#define HSOFFLOAD_ENGINE_OPTION_PARAMS \
  int64_t min_offload_size, \
  bool offload_cpu_tensors, \
  bool pin_memory, \
  bool use_streams, \
  int64_t prefetch_depth, \
  std::string spill_dir, \
  int64_t spill_prefetch_depth, \
  int64_t spill_wait_ms, \
  bool share_copies

namespace hsoffload {

// spill_wait_ms's bound (one hour).
constexpr int64_t kMaxSpillWaitMs = 3600000;
// The auto host budget: this fraction of MemAvailable at first use, per rank on the node.
constexpr double kAutoHostBudgetFraction = 0.8;

}  // namespace hsoffload
