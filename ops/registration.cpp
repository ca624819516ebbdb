// The single definition site of the hsoffload op library. Every schema is
// documented in docs/ops.md; argument names are API.
#include "holders.h"
#include "ops.h"

#include <torch/custom_class.h>
#include <torch/library.h>

#include <tuple>

namespace hsoffload::ops {

TORCH_LIBRARY(hsoffload, m) {
  // One offload scope: configuration, marks, counters. Python wraps it in a
  // context manager that installs saved-tensor hooks calling the ops below.
  m.class_<OffloadScopeHolder>("OffloadScope")
      // The constructor's arguments are the engine options of the one table of knobs (hsoffload/options.h,
      // generated from python_shim/hsoffload/options.py), with their names and defaults.
      .def(torch::init(&make_scope), "an offload scope (docs/ops.md, Classes)",
           {
#define HSOFFLOAD_OPTION_ARG(type, name, default_value) torch::arg(#name) = default_value,
               HSOFFLOAD_ENGINE_OPTIONS(HSOFFLOAD_OPTION_ARG)
#undef HSOFFLOAD_OPTION_ARG
           })
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
      // Gives back restores held for unpacks that may never come (a backward graph task that ended early).
      .def("release_restores",
           [](const c10::intrusive_ptr<OffloadScopeHolder>& self) { self->scope->release_restores(); })
      // Note on the stats methods: each returns Dict(str, int), its keys the struct's X-macro list in
      // hsoffload/stats.h (one list per struct, defined once); Python builds its dataclasses from those names.
      // This scope's counters (HSOFFLOAD_OFFLOAD_STATS).
      .def("stats", &scope_stats)
      // Two of those counters, offloaded_tensors and offloaded_bytes, without the dictionary: read at every decoder
      // layer's start and end (the per-layer counters).
      .def("offloaded",
           [](const c10::intrusive_ptr<OffloadScopeHolder>& self) {
             const OffloadStats s = self->scope->stats();
             return std::make_tuple(s.offloaded_tensors, s.offloaded_bytes);
           })
      // The counters of the scope's spill store (HSOFFLOAD_SPILL_STATS; zeros without spill_dir).
      .def("spill_stats", &scope_spill_stats)
      // What the scope's first failed host allocation raised ("" if none): quoted by the Python warning.
      .def("first_host_alloc_error",
           [](const c10::intrusive_ptr<OffloadScopeHolder>& self) { return self->scope->first_host_alloc_error(); })
      // Host-copy layers restored ahead of backward from now on (policy auto's choice); the config's until set.
      .def("set_prefetch_depth", [](const c10::intrusive_ptr<OffloadScopeHolder>& self,
                                    int64_t depth) { self->scope->set_prefetch_depth(depth); })
      .def("prefetch_depth",
           [](const c10::intrusive_ptr<OffloadScopeHolder>& self) { return self->scope->prefetch_depth(); })
      .def("tracked_state",
           [](const c10::intrusive_ptr<OffloadScopeHolder>& self) { return self->scope->tracked_state(); })
      // Deprecated (one release; docs/ops.md, "Deprecated"): the process-wide ops below as statics of this class,
      // bound to the same functions.
      .def_static("process_stats", &process_stats)
      .def_static("pool_stats", &pool_stats)
      .def_static("set_pool_limit", &set_pool_limit)
      .def_static("pool_limit", &pool_limit)
      .def_static("empty_pool", &empty_pool)
      .def_static("reserve_host", &reserve_host)
      .def_static("set_host_budget", &set_host_budget)
      .def_static("budget_stats", &budget_stats)
      .def_static("local_size", &local_size)
      .def_static("cpu_meter_install", &cpu_meter_install)
      .def_static("cpu_meter_stats", &cpu_meter_stats)
      .def_static("cpu_meter_reset_peak", &cpu_meter_reset_peak)
      .def_static("engine_detects_capture", &engine_detects_capture)
      .def_static("side_streams", &side_streams);

  // The process-wide ops: the host pool, the host budget, the local size, the CPU meter, graph capture, the side
  // streams and every scope's counters (docs/ops.md, "Process-wide ops").
  // Note on CONSERVATIVE: they read or write process state that no argument names. With the schema's own alias
  // analysis TorchScript would take them for pure functions: drop a setter (no output) as dead code and merge two
  // reads of a counter around a write.
  constexpr auto kProcessState = c10::AliasAnalysisKind::CONSERVATIVE;
  // Every scope's counters summed over the process (HSOFFLOAD_OFFLOAD_STATS; pool_bytes is the pool's now).
  m.def(torch::schema("process_stats() -> Dict(str, int)", kProcessState), &process_stats);
  // What the process-wide host pool holds now (HSOFFLOAD_POOL_STATS).
  m.def(torch::schema("pool_stats() -> Dict(str, int)", kProcessState), &pool_stats);
  // Bounds the host pool's held bytes (>= 0; -1: follow the host budget again, as by default).
  m.def(torch::schema("set_pool_limit(int max_bytes) -> ()", kProcessState), &set_pool_limit);
  // The host pool's bound now, in bytes.
  m.def(torch::schema("pool_limit() -> int", kProcessState), &pool_limit);
  // Frees every idle slab of the host pool (and the accelerator's cached pinned blocks).
  m.def(torch::schema("empty_pool() -> ()", kProcessState), &empty_pool);
  // Makes `bytes` bytes (pinned: for accelerator copies) free in the pool now, before the first step, so packs
  // do not allocate; returns the pool's free bytes of that kind (less only where the pool limit stops it).
  m.def(torch::schema("reserve_host(int bytes, bool pinned) -> int", kProcessState), &reserve_host);
  // The process-wide host budget: max_bytes >= 0, or -1 for auto (80% of MemAvailable / LOCAL_WORLD_SIZE).
  m.def(torch::schema("set_host_budget(int max_bytes) -> ()", kProcessState), &set_host_budget);
  // The process-wide host budget (HSOFFLOAD_BUDGET_STATS; an auto limit is resolved by the first call).
  m.def(torch::schema("budget_stats() -> Dict(str, int)", kProcessState), &budget_stats);
  // The ranks on this node and the variable that said so ("" none): the one decider (hsoffload/local_size.h).
  m.def(torch::schema("local_size() -> (int, str)", kProcessState), &local_size);
  // The CPU meter (hsoffload/cpu_meter.h): a counting allocator in front of the CPU allocator, the figures policy
  // "auto" reads when the device is the CPU. Installs it: idempotent, false if another allocator keeps its place.
  m.def(torch::schema("cpu_meter_install() -> bool", kProcessState), &cpu_meter_install);
  // The CPU meter's figures (HSOFFLOAD_CPU_METER_STATS).
  m.def(torch::schema("cpu_meter_stats() -> Dict(str, int)", kProcessState), &cpu_meter_stats);
  // The CPU meter's peak := what it has lent now.
  m.def(torch::schema("cpu_meter_reset_peak() -> ()", kProcessState), &cpu_meter_reset_peak);
  // True if the engine tells graph capture itself (torch >= 2.13's device guard); false: the caller passes
  // offload_pack's `capturing` flag.
  m.def(torch::schema("engine_detects_capture() -> bool", kProcessState), &engine_detects_capture);
  // The process's side streams on `device` (ids of the device->host and host->device streams): one pair per
  // device per process, the same for every scope (docs/design.md, "Stream ownership").
  m.def(torch::schema("side_streams(Device device) -> int[]", kProcessState), &side_streams);

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
  // and with none, x is kept as is. `capturing`: the caller knows the current
  // stream is capturing a graph (the engine cannot tell on torch < 2.13): x
  // passes through, counted in captured_passthrough.
  m.def("offload_pack(Tensor x, int scope=-1, bool capturing=False) -> Tensor", &offload_pack);

  // The unpack hook: returns a tensor bit-identical to what was packed (the
  // current stream waits on the restore's event; prefetches earlier groups).
  m.def("offload_unpack(Tensor handle) -> Tensor", &offload_unpack);

  // FSDP RAM-efficient loading, per from_pretrained call: the storages this
  // process must not initialise, counters of the writes into them that were
  // dropped, and lazily committed zero placeholders. See docs/ops.md.
  m.class_<InitSkipRecordHolder>("InitSkipRecord")
      .def(torch::init(&make_init_skip_record))
      .def("is_flagged", &init_skip_record_is_flagged)
      .def("note_dropped_write", &init_skip_record_note_dropped_write)
      .def("stats", &init_skip_record_stats)  // HSOFFLOAD_INIT_SKIP_STATS by name
      .def("skip", &init_skip_record_skip)
      .def("reason", &init_skip_record_reason)
      .def("clear", &init_skip_record_clear)
      // Deprecated (one release): the op lazy_zeros_like below, bound to the same function.
      .def_static("lazy_zeros_like", &init_skip_lazy_zeros_like);

  // A contiguous CPU tensor of like's shape and dtype that reads as zeros and holds no resident memory until
  // written (a private anonymous mapping); `like` may be on meta, must be strided. Note: a catch-all kernel, so a
  // meta `like` still gets a CPU result (what the FSDP loader's placeholders need); CONSERVATIVE as above, since
  // every call must allocate anew.
  m.def(torch::schema("lazy_zeros_like(Tensor like) -> Tensor", kProcessState), &init_skip_lazy_zeros_like);

  // FSDP RAM-efficient loading: returns, per tensor, whether this process must
  // skip initialising it (ranks other than rank 0 / local rank 0 under FSDP
  // with cpu_ram_efficient_loading) and records those tensors' storages in
  // `record`. Note: no (a!) on `tensors` -- the op reads only their identity;
  // the record (a custom class) is what it writes. See docs/ops.md.
  m.def(
      "skip_init_non_rank0(Tensor[] tensors, int rank, int local_rank, bool fsdp_enabled, "
      "bool cpu_ram_efficient_loading, __torch__.torch.classes.hsoffload.InitSkipRecord? record=None) -> bool[]",
      &skip_init_non_rank0);

  // ZeRO-3 RAM-efficient loading (sibling of skip_init_non_rank0): returns, per tensor, whether this process skips
  // initialising / reading it because it receives only its own partition from rank 0 of the ZeRO-3 partition group
  // (every rank but group rank 0 while ZeRO-3 is active), and records those storages in `record`. Same note on (a!)
  // as above. See docs/ops.md.
  m.def(
      "skip_init_zero3(Tensor[] tensors, int group_rank, bool zero3_enabled, "
      "__torch__.torch.classes.hsoffload.InitSkipRecord? record=None) -> bool[]",
      &skip_init_zero3);
}

}  // namespace hsoffload::ops
