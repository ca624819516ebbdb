// FSDP RAM-efficient loading: which tensors a process must not initialise.
//
// Under FSDP with cpu_ram_efficient_loading only the ranks that load real
// weights need them initialised; every other rank receives its values later by
// broadcast from rank 0. The engine decides, from this process's rank facts,
// whether it is such a rank, and records the storages of the tensors it must
// not initialise so that writes into them can be recognised and dropped.
//
// The engine knows tensors and storages; it knows nothing of Python,
// transformers or torch.distributed (the caller supplies the facts).
//
// Thread-safety: `decide_skip_init` and `describe` are pure. An
// `InitSkipRecord` may be used from several threads at once; one mutex per
// record guards its table and counters.
#pragma once

#include "hsoffload/stats.h"

#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace hsoffload {

// What the caller knows about this process.
struct RankFacts {
  int64_t rank = -1;        // global rank in the default process group; -1 without one
  int64_t local_rank = -1;  // rank on this node (launcher's LOCAL_RANK); -1 when unknown
  bool fsdp_enabled = false;               // process group initialised and FSDP requested
  bool cpu_ram_efficient_loading = false;  // only rank 0 loads real weights; others get them by broadcast
};

// Why a process does or does not skip weight initialisation.
enum class SkipReason {
  kSkip,                   // non-rank-0 under FSDP RAM-efficient loading
  kFsdpDisabled,           // no process group or FSDP not requested
  kNoRamEfficientLoading,  // every rank loads real weights
  kGlobalRankZero,         // the broadcast source must hold real, initialised values
  kLocalRankZero,          // transformers loads real weights on every node's local rank 0
  kInconsistentRanks,      // local_rank > rank: the facts contradict each other, stay stock
  kZero3Skip,              // ZeRO-3, not the partition group's rank 0: receives only its partition from rank 0
  kZero3Disabled,          // ZeRO-3 not active (or a load it does not cover): stock
};

struct SkipDecision {
  bool skip = false;
  SkipReason reason = SkipReason::kFsdpDisabled;
};

// The decision for one process. Never skips on global rank 0 whatever
// LOCAL_RANK says, so a wrong or missing LOCAL_RANK cannot leave the broadcast
// source uninitialised.
SkipDecision decide_skip_init(const RankFacts& facts);

// The ZeRO-3 decision for one process (skip_init_zero3): under ZeRO-3 only
// rank 0 of a parameter's partition group initialises or reads full weights
// (transformers runs init and checkpoint loads on that rank inside
// GatheredParameters(modifier_rank=0)); every other rank only receives its own
// partition. `group_rank` is the rank in that group, -1 without a process
// group. Local ranks play no part: ZeRO-3 has one source per group, not per node.
SkipDecision decide_skip_init_zero3(int64_t group_rank, bool zero3_enabled);

// One-line human description of a reason (for logs).
const char* describe(SkipReason reason);

// The set of storages whose tensors must not be initialised, with counters.
//
// Entries are keyed by StorageImpl address and hold a weak reference to it.
// A weak reference keeps the StorageImpl allocation (not its data) alive, so
// the address of a recorded storage cannot be reused by another storage while
// the record exists: no ABA between a freed parameter and a new tensor. A
// recorded storage that has been freed no longer counts as flagged.
class InitSkipRecord {
 public:
  InitSkipRecord() = default;
  InitSkipRecord(const InitSkipRecord&) = delete;
  InitSkipRecord& operator=(const InitSkipRecord&) = delete;

  // Records the decision this record was filled under (see `decision`).
  void set_decision(SkipDecision decision);
  // The last decision set; `kFsdpDisabled`/no skip before any.
  SkipDecision decision() const;

  // Whether t's storage can be recognised later (is_flagged): a strided,
  // non-nested tensor with storage (meta included). Sparse and nested tensors
  // cannot, so they are never skipped.
  static bool can_flag(const at::Tensor& t);
  // Records t's storage as flagged. Returns false (records nothing) when
  // !can_flag(t).
  bool flag(const at::Tensor& t);
  // True when t shares storage with a flagged tensor that is still alive
  // (views, `.data` and `detach()` aliases included).
  bool is_flagged(const at::Tensor& t) const;
  // Counts one write into a flagged storage that the caller dropped.
  void note_dropped_write(int64_t bytes);

  InitSkipStats stats() const;
  // Forgets every entry and zeroes the counters; keeps the decision.
  void clear();

 private:
  mutable std::mutex mu_;
  SkipDecision decision_;
  std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> flagged_;
  InitSkipStats stats_;
};

// A CPU tensor of zeros whose pages are not committed until written.
//
// The memory is a private anonymous mapping: the kernel guarantees it reads as
// zeros, and untouched pages cost no resident memory, so a non-rank-0 process
// can hold a model-shaped placeholder with defined values (zeros, as stock
// transformers >= 5.4 uses) at almost no RSS until the broadcast overwrites
// it. Contiguous, requires no grad; freed (unmapped) with its storage.
at::Tensor lazy_zeros(c10::IntArrayRef sizes, c10::ScalarType dtype);

}  // namespace hsoffload
