// `torch.classes.hsoffload.InitSkipRecord`: carries an engine InitSkipRecord
// across the op boundary (FSDP RAM-efficient loading).
//
// Thread-safety: the holder only forwards; an InitSkipRecord guards itself (one mutex per record).
//
// Note on the handle type: a typed custom class, like OffloadScope, rather
// than a process-global table. Each patched `_initialize_missing_keys` call
// owns its record, so concurrent loads in one process (threads, several
// models) never see each other's flags, and the record (with its weak
// references) is freed when the call's Python object is dropped.
#pragma once

#include "hsoffload/init_skip.h"

#include <ATen/core/Dict.h>
#include <torch/custom_class.h>

#include <memory>
#include <string>

namespace hsoffload::ops {

struct InitSkipRecordHolder : torch::CustomClassHolder {
  std::shared_ptr<InitSkipRecord> record = std::make_shared<InitSkipRecord>();
};

// Methods of InitSkipRecord (defined in skip_init_ops.cpp).
c10::intrusive_ptr<InitSkipRecordHolder> make_init_skip_record();
bool init_skip_record_is_flagged(const c10::intrusive_ptr<InitSkipRecordHolder>& self, const at::Tensor& t);
void init_skip_record_note_dropped_write(const c10::intrusive_ptr<InitSkipRecordHolder>& self, int64_t nbytes);
c10::Dict<std::string, int64_t> init_skip_record_stats(const c10::intrusive_ptr<InitSkipRecordHolder>& self);
bool init_skip_record_skip(const c10::intrusive_ptr<InitSkipRecordHolder>& self);
std::string init_skip_record_reason(const c10::intrusive_ptr<InitSkipRecordHolder>& self);
void init_skip_record_clear(const c10::intrusive_ptr<InitSkipRecordHolder>& self);
at::Tensor init_skip_lazy_zeros_like(const at::Tensor& like);

}  // namespace hsoffload::ops
