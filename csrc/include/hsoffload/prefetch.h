// Prefetch scheduling: which records to bring back ahead of their unpack, given the one backward just restored.
//
// Host copies come back `host_depth` groups ahead; spilled ones, slower to read, `spill_depth` groups ahead.
// Distance 0 is the rest of the current record's own group (packed before or after it: a layer's recompute reads
// its saved tensors in forward order), needed next; distance d is the d-th earlier group in reverse pack order
// (the backward order of a layer stack). Only records of the current record's scope entry (epoch) are considered,
// so one graph's backward does not pull another graph's tensors onto the device.
//
// Thread-safety: a pure function of the index and the records' state; the caller holds the scope's mutex (which
// guards the records' restore state).
#pragma once

#include "hsoffload/records.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace hsoffload {

struct PrefetchDepths {
  int64_t host = 0;   // groups of host copies (OffloadConfig::prefetch_depth)
  int64_t spill = 0;  // groups of spilled copies (spill_prefetch_depth; 0 without a spill store)
};

// The records to restore now, in the order to start them, after `current` was restored. Skips records that are
// restored or prefetched already, and records of `current`'s group packed after it that were restored before
// (backward is past them).
std::vector<std::shared_ptr<OffloadRecord>> records_to_prefetch(const RecordIndex& index,
                                                                const OffloadRecord& current, PrefetchDepths depths);

}  // namespace hsoffload
