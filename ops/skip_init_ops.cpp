// Adapter for skip_init_non_rank0 and the InitSkipRecord class (FSDP
// RAM-efficient loading). Every user-facing argument check of these lives here.
#include "init_skip_holder.h"
#include "ops.h"
#include "stats_dict.h"

#include "hsoffload/init_skip.h"

#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace hsoffload::ops {

namespace {
// Sets the record's decision and flags every tensor the decision skips (one bool per tensor, in order).
c10::List<bool> flag_all(const std::vector<at::Tensor>& tensors, SkipDecision decision,
                         const std::optional<c10::intrusive_ptr<InitSkipRecordHolder>>& record) {
  InitSkipRecord* target = record.has_value() && *record ? (*record)->record.get() : nullptr;
  if (target != nullptr) target->set_decision(decision);

  c10::List<bool> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) {
    // A tensor that cannot be recorded (no storage) is not skipped: we could
    // not recognise writes into it.
    bool skip = decision.skip && InitSkipRecord::can_flag(t);
    if (skip && target != nullptr) skip = target->flag(t);
    out.push_back(skip);
  }
  return out;
}
}  // namespace

c10::List<bool> skip_init_non_rank0(const std::vector<at::Tensor>& tensors, int64_t rank, int64_t local_rank,
                                    bool fsdp_enabled, bool cpu_ram_efficient_loading,
                                    const std::optional<c10::intrusive_ptr<InitSkipRecordHolder>>& record) {
  TORCH_CHECK_VALUE(rank >= -1, "skip_init_non_rank0: rank must be the process group rank or -1 without one, got ",
                    rank);
  TORCH_CHECK_VALUE(local_rank >= -1,
                    "skip_init_non_rank0: local_rank must be the node-local rank (LOCAL_RANK) or -1 when unknown, got ",
                    local_rank);
  TORCH_CHECK_VALUE(!fsdp_enabled || rank >= 0, "skip_init_non_rank0: fsdp_enabled=True needs an initialized process ",
                    "group, so rank must be >= 0 (torch.distributed.get_rank()), got ", rank);
  const SkipDecision decision = decide_skip_init(RankFacts{rank, local_rank, fsdp_enabled, cpu_ram_efficient_loading});
  return flag_all(tensors, decision, record);
}

c10::List<bool> skip_init_zero3(const std::vector<at::Tensor>& tensors, int64_t group_rank, bool zero3_enabled,
                                const std::optional<c10::intrusive_ptr<InitSkipRecordHolder>>& record) {
  TORCH_CHECK_VALUE(group_rank >= -1, "skip_init_zero3: group_rank must be the rank in the parameters' ZeRO-3 ",
                    "partition group, or -1 without a process group, got ", group_rank);
  TORCH_CHECK_VALUE(!zero3_enabled || group_rank >= 0, "skip_init_zero3: zero3_enabled=True needs an initialized ",
                    "process group, so group_rank must be >= 0, got ", group_rank);
  return flag_all(tensors, decide_skip_init_zero3(group_rank, zero3_enabled), record);
}

c10::intrusive_ptr<InitSkipRecordHolder> make_init_skip_record() { return c10::make_intrusive<InitSkipRecordHolder>(); }

bool init_skip_record_is_flagged(const c10::intrusive_ptr<InitSkipRecordHolder>& self, const at::Tensor& t) {
  return self->record->is_flagged(t);
}

void init_skip_record_note_dropped_write(const c10::intrusive_ptr<InitSkipRecordHolder>& self, int64_t nbytes) {
  TORCH_CHECK_VALUE(nbytes >= 0, "InitSkipRecord.note_dropped_write: nbytes must be >= 0 (the size of the dropped ",
                    "write), got ", nbytes);
  self->record->note_dropped_write(nbytes);
}

c10::Dict<std::string, int64_t> init_skip_record_stats(const c10::intrusive_ptr<InitSkipRecordHolder>& self) {
  return to_dict(self->record->stats());
}

bool init_skip_record_skip(const c10::intrusive_ptr<InitSkipRecordHolder>& self) {
  return self->record->decision().skip;
}

std::string init_skip_record_reason(const c10::intrusive_ptr<InitSkipRecordHolder>& self) {
  return describe(self->record->decision().reason);
}

void init_skip_record_clear(const c10::intrusive_ptr<InitSkipRecordHolder>& self) { self->record->clear(); }

at::Tensor init_skip_lazy_zeros_like(const at::Tensor& like) {
  TORCH_CHECK_VALUE(like.defined(), "InitSkipRecord.lazy_zeros_like: like is undefined; pass the tensor whose shape ",
                    "and dtype the placeholder takes");
  TORCH_CHECK_VALUE(like.layout() == c10::kStrided, "InitSkipRecord.lazy_zeros_like: like must be a strided (dense) ",
                    "tensor, got layout ", like.layout());
  return lazy_zeros(like.sizes(), like.scalar_type());
}

}  // namespace hsoffload::ops
