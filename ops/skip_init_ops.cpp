// Adapter for skip_init_non_rank0 (FSDP RAM-efficient loading).
#include "ops.h"

namespace hsoffload::ops {

c10::List<bool> skip_init_non_rank0(const std::vector<at::Tensor>& tensors, int64_t rank, int64_t local_rank,
                                      bool fsdp_enabled, bool cpu_ram_efficient_loading) {
  (void)rank;
  const bool skip = fsdp_enabled && cpu_ram_efficient_loading && local_rank != 0;
  c10::List<bool> out;
  for (size_t i = 0; i < tensors.size(); ++i) out.push_back(skip);
  return out;
}

}  // namespace hsoffload::ops
