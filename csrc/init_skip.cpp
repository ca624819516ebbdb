// FSDP RAM-efficient loading (init_skip.h): the skip decision from rank facts, the record of storages not to
// initialise, and lazily committed zero placeholders.
#include "hsoffload/init_skip.h"

#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <memory>

namespace hsoffload {

SkipDecision decide_skip_init(const RankFacts& facts) {
  if (!facts.fsdp_enabled) return {false, SkipReason::kFsdpDisabled};
  if (!facts.cpu_ram_efficient_loading) return {false, SkipReason::kNoRamEfficientLoading};
  if (facts.rank == 0) return {false, SkipReason::kGlobalRankZero};
  if (facts.local_rank == 0) return {false, SkipReason::kLocalRankZero};
  // An unknown local rank (-1) is decided by the global rank alone (checked
  // above); a known one larger than the global rank cannot be right.
  if (facts.local_rank > facts.rank) return {false, SkipReason::kInconsistentRanks};
  return {true, SkipReason::kSkip};
}

SkipDecision decide_skip_init_zero3(int64_t group_rank, bool zero3_enabled) {
  if (!zero3_enabled) return {false, SkipReason::kZero3Disabled};
  if (group_rank == 0) return {false, SkipReason::kGlobalRankZero};
  return {true, SkipReason::kZero3Skip};
}

const char* describe(SkipReason reason) {
  switch (reason) {
    case SkipReason::kSkip:
      return "non-rank-0 process under FSDP cpu_ram_efficient_loading: weights arrive by broadcast from rank 0";
    case SkipReason::kFsdpDisabled:
      return "FSDP is not enabled (torch.distributed not initialized or ACCELERATE_USE_FSDP unset)";
    case SkipReason::kNoRamEfficientLoading:
      return "FSDP_CPU_RAM_EFFICIENT_LOADING is unset: every rank loads real weights";
    case SkipReason::kGlobalRankZero:
      return "global rank 0 loads the real weights and is the broadcast source";
    case SkipReason::kLocalRankZero:
      return "local rank 0 loads the real weights on its node";
    case SkipReason::kInconsistentRanks:
      return "LOCAL_RANK is larger than the global rank; rank facts are inconsistent, keeping stock behaviour";
    case SkipReason::kZero3Skip:
      return "ZeRO-3 rank other than its partition group's rank 0: it receives only its own partition from rank 0";
    case SkipReason::kZero3Disabled:
      return "ZeRO-3 is not active for this load (transformers' is_deepspeed_zero3_enabled() false, or quantized)";
  }
  return "unknown";
}

void InitSkipRecord::set_decision(SkipDecision decision) {
  std::lock_guard<std::mutex> lock(mu_);
  decision_ = decision;
}

SkipDecision InitSkipRecord::decision() const {
  std::lock_guard<std::mutex> lock(mu_);
  return decision_;
}

bool InitSkipRecord::can_flag(const at::Tensor& t) {
  // Meta tensors count (their storage is recognisable); nested and sparse ones do not.
  return t.defined() && t.layout() == c10::kStrided && !t.is_nested() && t.has_storage();
}

bool InitSkipRecord::flag(const at::Tensor& t) {
  if (!can_flag(t)) return false;
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.flagged_tensors;
  auto it = flagged_.find(impl);
  if (it != flagged_.end() && !it->second.expired()) return true;
  // Either new, or an expired entry whose address we still pin (cannot be a
  // different live storage, see the class comment); refresh it in both cases.
  c10::weak_intrusive_ptr<c10::StorageImpl> weak(t.storage().getWeakStorageImpl());
  if (it == flagged_.end()) {
    flagged_.emplace(impl, std::move(weak));
  } else {
    it->second = std::move(weak);
  }
  ++stats_.flagged_storages;
  stats_.flagged_bytes += static_cast<int64_t>(impl->nbytes());
  return true;
}

bool InitSkipRecord::is_flagged(const at::Tensor& t) const {
  if (!can_flag(t)) return false;
  const c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = flagged_.find(impl);
  return it != flagged_.end() && !it->second.expired();
}

void InitSkipRecord::note_dropped_write(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.dropped_writes;
  stats_.dropped_bytes += bytes;
}

InitSkipStats InitSkipRecord::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  InitSkipStats s = stats_;
  s.live_storages = 0;
  for (const auto& entry : flagged_) {
    if (!entry.second.expired()) ++s.live_storages;
  }
  return s;
}

void InitSkipRecord::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  flagged_.clear();
  stats_ = InitSkipStats{};
}

namespace {

// Owns one anonymous mapping; the DataPtr's context.
struct Mapping {
  void* addr = nullptr;
  size_t length = 0;
  ~Mapping() {
    if (addr != nullptr) munmap(addr, length);
  }
};

void delete_mapping(void* ctx) {
  std::unique_ptr<Mapping> owner(static_cast<Mapping*>(ctx));
}

}  // namespace

at::Tensor lazy_zeros(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  for (int64_t s : sizes) {
    TORCH_CHECK_VALUE(s >= 0, "lazy_zeros: sizes must be non-negative, got ", sizes);
  }
  const auto meta = caffe2::TypeMeta::fromScalarType(dtype);
  const size_t numel = c10::multiply_integers(sizes);
  const size_t nbytes = numel * meta.itemsize();
  c10::DataPtr data(nullptr, c10::Device(c10::kCPU));
  if (nbytes > 0) {
    auto mapping = std::make_unique<Mapping>();
    void* addr = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    TORCH_CHECK(addr != MAP_FAILED, "lazy_zeros: mmap of ", nbytes, " bytes failed: ", std::strerror(errno));
    mapping->addr = addr;
    mapping->length = nbytes;
    data = c10::DataPtr(addr, mapping.release(), &delete_mapping, c10::Device(c10::kCPU));
  }
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), /*allocator=*/nullptr,
                       /*resizable=*/false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), meta);
  impl->set_sizes_contiguous(sizes);
  return at::Tensor(std::move(impl));
}

}  // namespace hsoffload
