// The single definition site of the hsoffload op library. Every schema is
// documented in docs/ops.md; argument names are API.
#include "holders.h"
#include "ops.h"

#include <torch/custom_class.h>
#include <torch/library.h>

namespace hsoffload::ops {
namespace {

// Order of the integer lists returned by `stats()`; mirrored by
// `hsoffload.OffloadStats` in Python.
constexpr const char* kStatsDoc =
    "saved_tensors_seen, marked_tensors, offloaded_tensors, restored_tensors, skipped_marked_tensors, "
    "offloaded_bytes, restored_bytes, prefetch_hits, wait_ns, pool_bytes, spilled_tensors, spilled_bytes, "
    "spill_read_wait_ns, kept_on_device_tensors";

}  // namespace

TORCH_LIBRARY(hsoffload, m) {
  // One offload scope: configuration, marks, counters. Python wraps it in a
  // context manager that installs saved-tensor hooks calling the ops below.
  m.class_<OffloadScopeHolder>("OffloadScope")
      .def(torch::init(&make_scope), kStatsDoc,
           {torch::arg("min_offload_size") = 1024, torch::arg("offload_cpu_tensors") = false,
            torch::arg("pin_memory") = true, torch::arg("use_streams") = true, torch::arg("prefetch_depth") = 1,
            torch::arg("spill_dir") = "", torch::arg("spill_prefetch_depth") = 2})
      .def("enter", [](const c10::intrusive_ptr<OffloadScopeHolder>& self) { self->scope->enter(); })
      .def("exit", [](const c10::intrusive_ptr<OffloadScopeHolder>& self) { self->scope->exit(); })
      .def("active", [](const c10::intrusive_ptr<OffloadScopeHolder>& self) { return self->scope->active(); })
      .def("id", [](const c10::intrusive_ptr<OffloadScopeHolder>& self) { return self->scope->id(); })
      // Marks x in this scope (from any thread; mark_hidden_state marks in the calling thread's current scope).
      .def("mark", [](const c10::intrusive_ptr<OffloadScopeHolder>& self, const at::Tensor& x) { mark_in(self, x); })
      .def("is_marked",
           [](const c10::intrusive_ptr<OffloadScopeHolder>& self, const at::Tensor& x) { return is_marked(self, x); })
      .def("begin_group", [](const c10::intrusive_ptr<OffloadScopeHolder>& self) { self->scope->begin_group(); })
      .def("end_group", [](const c10::intrusive_ptr<OffloadScopeHolder>& self) { self->scope->end_group(); })
      .def("stats", &scope_stats)
      // bytes_written, bytes_read, write_ns, read_ns, files (open now), direct_io of the scope's spill store.
      .def("spill_stats", &scope_spill_stats)
      .def("tracked_state",
           [](const c10::intrusive_ptr<OffloadScopeHolder>& self) { return self->scope->tracked_state(); })
      .def_static("process_stats", &process_stats)
      .def_static("pool_stats", &pool_stats)
      .def_static("set_pool_limit", &set_pool_limit)
      .def_static("pool_limit", &pool_limit)
      .def_static("empty_pool", &empty_pool)
      // The process-wide host budget: bytes >= 0, or -1 for auto (80% of MemAvailable / LOCAL_WORLD_SIZE).
      .def_static("set_host_budget", &set_host_budget)
      // limit, in_flight, peak, refused, is_auto, mem_available, local_world_size (auto resolved at first call).
      .def_static("host_budget", &host_budget);

  // Returns x itself; marks x for offload when autograd saves it while an
  // offload scope is active on this thread (no-op without one).
  // Note on (a!): marking writes x's offload state. Declaring it as a write is
  // what keeps a call whose result is unused alive through TorchScript's dead
  // code elimination; the kernel is CompositeImplicitAutograd, so autograd and
  // torch.compile see straight through it (it traces as identity).
  m.def("mark_hidden_state(Tensor(a!) x) -> Tensor(a!)", &mark_hidden_state);

  // The pack hook: decides passthrough or offload for x, starts the copy and
  // returns a handle tensor (0-element uint8, owns the saved data; see
  // holders.h). `scope` is an OffloadScope id; -1: this thread's current scope,
  // and with none, x is kept as is.
  m.def("offload_pack(Tensor x, int scope=-1) -> Tensor", &offload_pack);

  // The unpack hook: returns a tensor bit-identical to what was packed (waits
  // on the restore's event, prefetches the previous offloaded tensor).
  m.def("offload_unpack(Tensor handle) -> Tensor", &offload_unpack);

  // FSDP RAM-efficient loading, per from_pretrained call: the storages this
  // process must not initialise, counters of the writes into them that were
  // dropped, and lazily committed zero placeholders. See docs/ops.md.
  m.class_<InitSkipRecordHolder>("InitSkipRecord")
      .def(torch::init(&make_init_skip_record))
      .def("is_flagged", &init_skip_record_is_flagged)
      .def("note_dropped_write", &init_skip_record_note_dropped_write)
      .def("stats", &init_skip_record_stats,
           "flagged_tensors, flagged_storages, flagged_bytes, dropped_writes, dropped_bytes, live_storages")
      .def("skip", &init_skip_record_skip)
      .def("reason", &init_skip_record_reason)
      .def("clear", &init_skip_record_clear)
      .def_static("lazy_zeros_like", &init_skip_lazy_zeros_like);

  // FSDP RAM-efficient loading: returns, per tensor, whether this process must
  // skip initialising it (ranks other than rank 0 / local rank 0 under FSDP
  // with cpu_ram_efficient_loading) and records those tensors' storages in
  // `record`. Note: no (a!) on `tensors` -- the op reads only their identity;
  // the record (a custom class) is what it writes. See docs/ops.md.
  m.def(
      "skip_init_non_rank0(Tensor[] tensors, int rank, int local_rank, bool fsdp_enabled, "
      "bool cpu_ram_efficient_loading, __torch__.torch.classes.hsoffload.InitSkipRecord? record=None) -> bool[]",
      &skip_init_non_rank0);
}

}  // namespace hsoffload::ops
