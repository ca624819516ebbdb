// Kernels bound in registration.cpp (declared here, defined in offload_ops.cpp and skip_init_ops.cpp). Argument
// names match the schemas.
//
// Thread-safety: the kernels keep no state of their own; the engine objects they call guard themselves.
#pragma once

#include "holders.h"
#include "init_skip_holder.h"

#include "hsoffload/options.h"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace hsoffload::ops {

at::Tensor& mark_hidden_state(at::Tensor& x);
at::Tensor offload_pack(const at::Tensor& x, int64_t scope, bool capturing);
at::Tensor offload_unpack(const at::Tensor& handle);

// The engine options by name, in the table's order (hsoffload/options.h).
c10::intrusive_ptr<OffloadScopeHolder> make_scope(HSOFFLOAD_ENGINE_OPTION_PARAMS);
// The stats ops return name -> value; the names are the lists in hsoffload/stats.h.
c10::Dict<std::string, int64_t> scope_stats(const c10::intrusive_ptr<OffloadScopeHolder>& self);
c10::Dict<std::string, int64_t> scope_spill_stats(const c10::intrusive_ptr<OffloadScopeHolder>& self);
void set_host_budget(int64_t max_bytes);
c10::Dict<std::string, int64_t> budget_stats();
std::tuple<int64_t, std::string> local_size();
bool cpu_meter_install();
c10::Dict<std::string, int64_t> cpu_meter_stats();
void cpu_meter_reset_peak();
void mark_in(const c10::intrusive_ptr<OffloadScopeHolder>& self, const at::Tensor& x);
bool is_marked(const c10::intrusive_ptr<OffloadScopeHolder>& self, const at::Tensor& x);
c10::Dict<std::string, int64_t> process_stats();
c10::Dict<std::string, int64_t> pool_stats();
void set_pool_limit(int64_t max_bytes);
int64_t pool_limit();
bool engine_detects_capture();
std::vector<int64_t> side_streams(c10::Device device);
int64_t reserve_host(int64_t bytes, bool pinned);
void empty_pool();

// Defined in skip_init_ops.cpp (FSDP RAM-efficient loading); the
// InitSkipRecord class methods are declared in init_skip_holder.h.
c10::List<bool> skip_init_non_rank0(const std::vector<at::Tensor>& tensors, int64_t rank, int64_t local_rank,
                                    bool fsdp_enabled, bool cpu_ram_efficient_loading,
                                    const std::optional<c10::intrusive_ptr<InitSkipRecordHolder>>& record);
c10::List<bool> skip_init_zero3(const std::vector<at::Tensor>& tensors, int64_t group_rank, bool zero3_enabled,
                                const std::optional<c10::intrusive_ptr<InitSkipRecordHolder>>& record);

}  // namespace hsoffload::ops
