// Adapters between the hsoffload ops / custom classes and the engine.
// Every user-facing argument check of the offload ops lives here.
#include "holders.h"
#include "ops.h"

#include "hsoffload/host_pool.h"
#include "hsoffload/scope.h"

#include <c10/util/Exception.h>

#include <vector>

namespace hsoffload::ops {
namespace {

std::vector<int64_t> to_list(const OffloadStats& s) {
  return {s.saved_tensors_seen, s.marked_tensors,  s.offloaded_tensors, s.restored_tensors, s.skipped_marked_tensors,
          s.offloaded_bytes,    s.restored_bytes,  s.prefetch_hits,     s.wait_ns,          s.pool_bytes};
}

std::vector<int64_t> to_list(const PoolStats& s) {
  return {s.held_bytes, s.in_use_bytes, s.cached_bytes, s.peak_held_bytes, s.allocations, s.reuses, s.unpooled};
}

}  // namespace

at::Tensor& mark_hidden_state(at::Tensor& x) {
  TORCH_CHECK_VALUE(x.defined(), "mark_hidden_state: x is an undefined tensor; pass the layer's hidden_states tensor");
  if (auto scope = OffloadScope::current()) {
    scope->mark(x);
  }
  return x;
}

c10::intrusive_ptr<SavedHandleHolder> offload_pack(const at::Tensor& x,
                                                   const std::optional<c10::intrusive_ptr<OffloadScopeHolder>>& scope) {
  std::shared_ptr<OffloadScope> target = scope.has_value() && *scope ? (*scope)->scope : OffloadScope::current();
  if (!target) {
    return c10::make_intrusive<SavedHandleHolder>(SavedHandle::passthrough(x));
  }
  return c10::make_intrusive<SavedHandleHolder>(target->pack(x));
}

at::Tensor offload_unpack(const c10::intrusive_ptr<SavedHandleHolder>& handle) {
  TORCH_CHECK_VALUE(handle && handle->handle,
                    "offload_unpack: handle is empty; pass the object that offload_pack returned");
  return handle->handle->unpack();
}

c10::intrusive_ptr<OffloadScopeHolder> make_scope(int64_t min_offload_size, bool offload_cpu_tensors, bool pin_memory,
                                                  bool use_streams, int64_t prefetch_depth) {
  OffloadConfig config;
  config.min_offload_size = min_offload_size;
  config.offload_cpu_tensors = offload_cpu_tensors;
  config.pin_memory = pin_memory;
  config.use_streams = use_streams;
  config.prefetch_depth = prefetch_depth;
  return c10::make_intrusive<OffloadScopeHolder>(OffloadScope::create(config, global_host_pool()));
}

std::vector<int64_t> scope_stats(const c10::intrusive_ptr<OffloadScopeHolder>& self) {
  return to_list(self->scope->stats());
}

std::vector<int64_t> process_stats() { return to_list(cumulative_stats()); }

std::vector<int64_t> pool_stats() { return to_list(global_host_pool()->stats()); }

void set_pool_limit(int64_t max_bytes) {
  TORCH_CHECK_VALUE(max_bytes >= 0, "set_pool_limit: max_bytes must be >= 0 bytes, got ", max_bytes);
  global_host_pool()->set_max_bytes(max_bytes);
}

int64_t pool_limit() { return global_host_pool()->max_bytes(); }

void empty_pool() { global_host_pool()->empty_cache(); }

}  // namespace hsoffload::ops
