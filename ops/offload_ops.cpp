// Adapters between the hsoffload offload ops / the OffloadScope class and the engine: handle tensors, stats as
// Dict(str, int) (names from stats.h), and every user-facing argument check of these ops.
#include "holders.h"
#include "ops.h"
#include "stats_dict.h"

#include "hsoffload/cpu_meter.h"
#include "hsoffload/host_pool.h"
#include "hsoffload/local_size.h"
#include "hsoffload/scope.h"
#include "hsoffload/transfer.h"

#include <ATen/core/Dict.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <memory>
#include <string>

namespace hsoffload::ops {
namespace {

// Owner of a SavedHandle inside a handle tensor's DataPtr.
struct HandleBox {
  std::shared_ptr<SavedHandle> handle;
};

void delete_handle_box(void* box) { delete static_cast<HandleBox*>(box); }  // DataPtr's deleter owns the box

}  // namespace

at::Tensor make_handle_tensor(std::shared_ptr<SavedHandle> handle) {
  auto box = std::make_unique<HandleBox>(HandleBox{std::move(handle)});
  at::DataPtr data(nullptr, box.release(), &delete_handle_box, c10::Device(c10::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, std::move(data), /*allocator=*/nullptr,
                       /*resizable=*/false);
  return at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                  caffe2::TypeMeta::Make<uint8_t>());
}

const SavedHandle* handle_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) {
    return nullptr;
  }
  const at::DataPtr& data = t.storage().data_ptr();
  if (data.get_deleter() != &delete_handle_box) {
    return nullptr;
  }
  return static_cast<const HandleBox*>(data.get_context())->handle.get();
}

at::Tensor& mark_hidden_state(at::Tensor& x) {
  TORCH_CHECK_VALUE(x.defined(), "mark_hidden_state: x is an undefined tensor; pass the layer's hidden_states tensor");
  if (auto scope = OffloadScope::current()) {
    scope->mark(x);
  }
  return x;
}

at::Tensor offload_pack(const at::Tensor& x, int64_t scope, bool capturing) {
  TORCH_CHECK_VALUE(scope >= -1, "offload_pack: scope must be an OffloadScope id (>= 0) or -1 for this thread's "
                    "current scope, got ", scope);
  std::shared_ptr<OffloadScope> target;
  if (scope >= 0) {
    target = OffloadScope::find(scope);
    TORCH_CHECK_VALUE(target != nullptr, "offload_pack: no live offload scope has id ", scope,
                      "; pass the id of a scope that still exists (OffloadScope.id()), or -1 for this thread's "
                      "current scope");
  } else {
    target = OffloadScope::current();
  }
  return make_handle_tensor(target ? target->pack(x, capturing) : SavedHandle::passthrough(x));
}

at::Tensor offload_unpack(const at::Tensor& handle) {
  const SavedHandle* saved = handle_of(handle);
  TORCH_CHECK_VALUE(saved != nullptr, "offload_unpack: handle is not a handle tensor (got ",
                    handle.defined() ? handle.toString() : std::string("an undefined tensor"),
                    "); pass exactly the tensor that offload_pack returned");
  return saved->unpack();
}

c10::intrusive_ptr<OffloadScopeHolder> make_scope(HSOFFLOAD_ENGINE_OPTION_PARAMS) {
  OffloadConfig config;  // every field from its argument (hsoffload/options.h: one list, generated from the table)
#define HSOFFLOAD_OPTION_ASSIGN(type, name, default_value) config.name = std::move(name);
  HSOFFLOAD_ENGINE_OPTIONS(HSOFFLOAD_OPTION_ASSIGN)
#undef HSOFFLOAD_OPTION_ASSIGN
  return c10::make_intrusive<OffloadScopeHolder>(OffloadScope::create(config, global_host_pool()));
}

void mark_in(const c10::intrusive_ptr<OffloadScopeHolder>& self, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.defined(), "OffloadScope.mark: x is an undefined tensor; pass the tensor to offload");
  self->scope->mark(x);
}

bool is_marked(const c10::intrusive_ptr<OffloadScopeHolder>& self, const at::Tensor& x) {
  return self->scope->is_marked(x);
}

c10::Dict<std::string, int64_t> scope_stats(const c10::intrusive_ptr<OffloadScopeHolder>& self) {
  return to_dict(self->scope->stats());
}

c10::Dict<std::string, int64_t> scope_spill_stats(const c10::intrusive_ptr<OffloadScopeHolder>& self) {
  return to_dict(self->scope->spill_stats());
}

void set_host_budget(int64_t max_bytes) {
  TORCH_CHECK_VALUE(max_bytes >= -1, "set_host_budget: max_bytes must be >= 0 bytes, or -1 for auto (80% of "
                    "MemAvailable / LOCAL_WORLD_SIZE), got ", max_bytes);
  global_host_budget()->set_limit(max_bytes);
  global_host_pool()->budget_changed(global_host_budget()->stats().limit);  // one limit, unless max_pool_bytes set
}

std::tuple<int64_t, std::string> local_size() {
  const hsoffload::LocalSize local = hsoffload::local_size();
  return {local.ranks, local.source};
}

bool cpu_meter_install() { return hsoffload::install_cpu_meter(); }

c10::Dict<std::string, int64_t> cpu_meter_stats() { return to_dict(hsoffload::cpu_meter_stats()); }

void cpu_meter_reset_peak() { hsoffload::reset_cpu_meter_peak(); }

c10::Dict<std::string, int64_t> budget_stats() {
  BudgetStats s = global_host_budget()->stats();
  const PoolStats pool = global_host_pool()->stats();
  s.host_bytes = pool.held_bytes + pool.unpooled_bytes + pool.staging_bytes;  // the same bytes pool_stats() reports
  return to_dict(s);
}

int64_t reserve_host(int64_t bytes, bool pinned) {
  TORCH_CHECK_VALUE(bytes >= 0, "reserve_host: bytes must be >= 0, got ", bytes,
                    "; pass the host bytes a step will offload (hsoffload plan prints them)");
  return global_host_pool()->reserve(bytes, pinned);
}

c10::Dict<std::string, int64_t> process_stats() { return to_dict(hsoffload::process_stats()); }

c10::Dict<std::string, int64_t> pool_stats() { return to_dict(global_host_pool()->stats()); }

void set_pool_limit(int64_t max_bytes) {
  TORCH_CHECK_VALUE(max_bytes >= -1, "set_pool_limit: max_bytes must be >= 0 bytes, or -1 to follow the host "
                    "budget again, got ", max_bytes);
  if (max_bytes == -1) {
    global_host_pool()->follow_budget(global_host_budget()->stats().limit);
  } else {
    global_host_pool()->set_limit(max_bytes);
  }
}

bool engine_detects_capture() { return hsoffload::engine_detects_capture(); }

std::vector<int64_t> side_streams(c10::Device device) {
  TORCH_CHECK_VALUE(!device.is_cpu(), "side_streams: device must be an accelerator, got ", device,
                    " (CPU copies run on the calling thread, without streams)");
  TORCH_CHECK_VALUE(device.has_index(), "side_streams: device must have an index (e.g. cuda:0), got ", device);
  return {static_cast<int64_t>(hsoffload::side_stream(device, hsoffload::Direction::kToHost).id()),
          static_cast<int64_t>(hsoffload::side_stream(device, hsoffload::Direction::kToDevice).id())};
}

int64_t pool_limit() { return global_host_pool()->limit(); }

void empty_pool() { global_host_pool()->empty(); }

}  // namespace hsoffload::ops
