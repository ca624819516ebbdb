#include "hsoffload/scope.h"

#include "hsoffload/tensor_kind.h"

#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <unordered_map>
#include <chrono>
#include <thread>
#include <utility>

namespace hsoffload {

// One host copy of a span of one storage. Shared by every handle whose tensor
// lies inside that span (tensors saved twice, views of one storage), and freed
// with the last of them, i.e. with the autograd graph that saved it.
struct OffloadRecord {
  int64_t seq = 0;  // pack order within the scope
  int64_t group = 0;  // prefetch group (OffloadScope::begin_group), increasing in pack order
  bool restored_once = false;  // an unpack restored it (guarded by `mutex`)
  int64_t epoch = 0;  // the scope entry that packed it
  c10::Device device{c10::kCPU};
  c10::weak_intrusive_ptr<c10::StorageImpl> source{c10::intrusive_ptr<c10::StorageImpl>()};
  uint32_t source_version = 0;
  int64_t begin = 0;  // byte offsets of the span in the source storage
  int64_t end = 0;
  int64_t source_align = 0;  // address of the span's first byte modulo kSpanAlignment
  int64_t pad = 0;  // where the span starts inside the block of the current restore (prefetched or restored)
  // Where the bytes are: a host loan (with its share of the host budget), or a spill file.
  HostLease lease;
  HostBlock host;
  std::shared_ptr<SpillStore> store;  // set iff spilled; kept so a restore can read after the scope is gone
  std::shared_ptr<SpillFile> spill;
  std::shared_ptr<SpillRead> spill_read;  // the read of the current restore, until unpack waits for it
  std::shared_ptr<c10::Event> d2h_done;  // null when the copy was synchronous
  // Restore state, guarded by `mutex`.
  at::Tensor prefetched;  // device bytes of a restore started ahead of its unpack
  std::shared_ptr<c10::Event> h2d_done;  // kept: every consumer stream waits on it
  std::optional<c10::Stream> alloc_stream;  // stream whose pool owns the restored block
  c10::weak_intrusive_ptr<c10::StorageImpl> restored{c10::intrusive_ptr<c10::StorageImpl>()};  // last restore, while someone holds it
  std::shared_ptr<std::mutex> mutex;  // the owning scope's mutex
  bool use_streams = true;

  int64_t bytes() const { return end - begin; }
};

namespace {

// Cumulative counters of all scopes in the process: a process-wide total is
// the point of them. Guarded by their own mutex.
std::mutex& cumulative_mutex() {
  static std::mutex m;
  return m;
}
OffloadStats& cumulative_locked() {
  static OffloadStats s;
  return s;
}

// Live scopes by id. Global because the pack op receives its scope as an
// integer from any thread (autograd's worker threads included); guarded by its
// own mutex; entries are weak and removed by the scope's destructor.
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<int64_t, std::weak_ptr<OffloadScope>>& registry_locked() {
  static std::unordered_map<int64_t, std::weak_ptr<OffloadScope>> r;
  return r;
}
std::atomic<int64_t> next_scope_id{1};  // ids are never reused

// The stack of current scopes on this thread. Thread-local because the mark op
// (`mark_hidden_state(x)`) carries no scope argument: it applies to the scope
// the calling thread entered, and scopes on other threads are independent.
thread_local std::vector<std::shared_ptr<OffloadScope>> tls_scopes;

constexpr int64_t kSpanAlignment = 512;  // the CUDA caching allocator's block alignment

// [begin, end) byte range of the storage that holds every element of `x`.
std::pair<int64_t, int64_t> storage_span(const at::Tensor& x) {
  const int64_t itemsize = static_cast<int64_t>(x.element_size());
  int64_t last = 0;  // offset of the last element relative to the first, in elements
  for (int64_t d = 0; d < x.dim(); ++d) {
    last += (x.size(d) - 1) * x.stride(d);
  }
  const int64_t begin = x.storage_offset() * itemsize;
  return {begin, begin + (last + 1) * itemsize};
}

// A uint8 tensor aliasing bytes [begin, end) of `storage`.
at::Tensor byte_view(const c10::Storage& storage, c10::Device device, int64_t begin, int64_t end) {
  at::Tensor bytes = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device));
  bytes.set_(storage, begin, {end - begin}, {1});
  return bytes;
}

uint32_t version_of(const at::Tensor& x) {
  const auto& vc = x.unsafeGetTensorImpl()->version_counter();
  return vc.enabled() ? vc.current_version() : 0;
}

void count(OffloadStats& local, int64_t OffloadStats::*field, int64_t n) {
  local.*field += n;
  std::lock_guard<std::mutex> lock(cumulative_mutex());
  cumulative_locked().*field += n;
}

}  // namespace

void OffloadConfig::validate() const {
  TORCH_CHECK_VALUE(min_offload_size >= 0, "hsoffload: min_offload_size must be >= 0 bytes, got ", min_offload_size);
  TORCH_CHECK_VALUE(prefetch_depth >= 0, "hsoffload: prefetch_depth must be >= 0, got ", prefetch_depth);
  TORCH_CHECK_VALUE(spill_prefetch_depth >= 0, "hsoffload: spill_prefetch_depth must be >= 0, got ",
                    spill_prefetch_depth);
}

void OffloadStats::add(const OffloadStats& o) {
  saved_tensors_seen += o.saved_tensors_seen;
  marked_tensors += o.marked_tensors;
  offloaded_tensors += o.offloaded_tensors;
  restored_tensors += o.restored_tensors;
  skipped_marked_tensors += o.skipped_marked_tensors;
  offloaded_bytes += o.offloaded_bytes;
  restored_bytes += o.restored_bytes;
  prefetch_hits += o.prefetch_hits;
  wait_ns += o.wait_ns;
  spilled_tensors += o.spilled_tensors;
  spilled_bytes += o.spilled_bytes;
  spill_read_wait_ns += o.spill_read_wait_ns;
  kept_on_device_tensors += o.kept_on_device_tensors;
}

OffloadStats cumulative_stats() {
  std::lock_guard<std::mutex> lock(cumulative_mutex());
  OffloadStats s = cumulative_locked();
  s.pool_bytes = global_host_pool()->stats().held_bytes;
  return s;
}

// ---------------------------------------------------------------------------
// OffloadScope

std::shared_ptr<OffloadScope> OffloadScope::create(OffloadConfig config, std::shared_ptr<HostPool> pool,
                                                   std::shared_ptr<HostBudget> budget) {
  config.validate();
  TORCH_CHECK_VALUE(pool != nullptr && budget != nullptr, "hsoffload: OffloadScope needs a host pool and budget");
  std::shared_ptr<OffloadScope> scope(new OffloadScope(config, std::move(pool), std::move(budget)));  // private ctor
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry_locked()[scope->id_] = scope;
  return scope;
}

OffloadScope::OffloadScope(OffloadConfig config, std::shared_ptr<HostPool> pool, std::shared_ptr<HostBudget> budget)
    : config_(std::move(config)),
      pool_(std::move(pool)),
      budget_(std::move(budget)),
      id_(next_scope_id++),
      mutex_(std::make_shared<std::mutex>()) {}

OffloadScope::~OffloadScope() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry_locked().erase(id_);
}

std::shared_ptr<OffloadScope> OffloadScope::find(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& registry = registry_locked();
  auto it = registry.find(id);
  return it == registry.end() ? nullptr : it->second.lock();
}

void OffloadScope::enter() {
  // Checked at every entry (a directory can vanish between steps); raises naming the path before any state changes.
  std::shared_ptr<SpillStore> store =
      config_.spill_dir.empty() ? nullptr : SpillStore::open(config_.spill_dir, config_.pin_memory);
  {
    std::lock_guard<std::mutex> lock(*mutex_);
    TORCH_CHECK(!active_ || owner_ == std::this_thread::get_id(),
                "hsoffload: offload scope #", id_, " is active on another thread; scopes are per thread (marks "
                "apply to the thread that entered the scope). Create one OffloadScope per thread.");
    TORCH_CHECK(!active_,
                "hsoffload: this offload scope is already active; entering it again would end it at the inner exit. "
                "Nest a new OffloadScope instead.");
    active_ = true;
    owner_ = std::this_thread::get_id();
    ++epoch_;
    open_group_ = -1;  // a group left open by an exception in the previous entry
    spill_ = std::move(store);
    spill_errors_->take();  // an error from an earlier entry was raised there (or belongs to a failed step)
  }
  tls_scopes.push_back(shared_from_this());
}

void OffloadScope::exit() {
  auto it = std::find(tls_scopes.rbegin(), tls_scopes.rend(), shared_from_this());
  TORCH_CHECK(it != tls_scopes.rend(),
              "hsoffload: exiting an offload scope that this thread did not enter; enter and exit a scope on the "
              "same thread (each thread needs its own scope)");
  TORCH_CHECK(it == tls_scopes.rbegin(), "hsoffload: exiting offload scope #", id_, " while scope #",
              tls_scopes.back()->id_, ", entered after it on this thread, is still active; exit scopes in the "
              "reverse order of entering them (innermost first)");
  tls_scopes.pop_back();
  std::lock_guard<std::mutex> lock(*mutex_);
  active_ = false;
  marks_.clear();
  prune_locked();
}

bool OffloadScope::active() const {
  std::lock_guard<std::mutex> lock(*mutex_);
  return active_;
}

std::shared_ptr<OffloadScope> OffloadScope::current() {
  return tls_scopes.empty() ? nullptr : tls_scopes.back();
}

void OffloadScope::mark(const at::Tensor& x) {
  TORCH_INTERNAL_ASSERT(x.defined());  // checked by the op adapter
  // Any tensor may be marked; pack decides whether its bytes can move (has_plain_storage) and counts the ones it
  // keeps in place, so a mark that cannot take effect is visible in the counters.
  std::lock_guard<std::mutex> lock(*mutex_);
  if (!active_) {
    return;
  }
  maybe_prune_locked();
  if (!is_marked_locked(x)) {
    Mark m;
    m.impl = c10::weak_intrusive_ptr<c10::TensorImpl>(x.getIntrusivePtr());
    m.impl_address = x.unsafeGetTensorImpl();
    m.version = version_of(x);
    m.dtype = x.scalar_type();
    if (has_plain_storage(x)) {
      m.storage = x.storage().getWeakStorageImpl();
      m.storage_address = x.storage().unsafeGetStorageImpl();
      m.storage_offset = x.storage_offset();
      m.sizes = x.sizes().vec();
      m.strides = x.strides().vec();
    }
    marks_.push_back(std::move(m));
  }
}

bool OffloadScope::Mark::matches(const at::Tensor& x, uint32_t x_version) const {
  if (version != x_version) {
    return false;
  }
  const bool same_impl_address = impl_address == x.unsafeGetTensorImpl();
  if (!same_impl_address &&
      (storage_address == nullptr || !has_plain_storage(x) || storage_address != x.storage().unsafeGetStorageImpl())) {
    return false;  // neither the marked tensor nor an alias of its storage (policies mark hundreds per step)
  }
  if (same_impl_address && impl.lock().get() == x.unsafeGetTensorImpl()) {
    return true;
  }
  // Not an alias that is a leaf requiring grad: that is how a reentrant checkpoint's recompute in backward re-saves
  // its (detached) inputs, which must not count as a new marked save. The executor's aliases have a grad_fn;
  // detach()'s do not require grad.
  const bool recompute_input = x.requires_grad() && x.is_leaf();
  return !recompute_input && has_plain_storage(x) && storage.lock().get() == x.storage().unsafeGetStorageImpl() &&
         x.scalar_type() == dtype && x.storage_offset() == storage_offset && x.sizes().equals(sizes) &&
         x.strides().equals(strides);
}

bool OffloadScope::is_marked(const at::Tensor& x) {
  std::lock_guard<std::mutex> lock(*mutex_);
  return active_ && x.defined() && is_marked_locked(x);
}

bool OffloadScope::is_marked_locked(const at::Tensor& x) { return find_mark_locked(x) != nullptr; }

OffloadScope::Mark* OffloadScope::find_mark_locked(const at::Tensor& x) {
  const uint32_t version = version_of(x);
  // Newest first: a policy that marks a tensor right before autograd packs it finds its mark at once.
  for (auto it = marks_.rbegin(); it != marks_.rend(); ++it) {
    if (it->matches(x, version)) {
      return &*it;
    }
  }
  return nullptr;
}

void OffloadScope::prune_locked() {
  marks_.erase(std::remove_if(marks_.begin(), marks_.end(), [](const Mark& m) { return m.expired(); }),
               marks_.end());
  records_.erase(std::remove_if(records_.begin(), records_.end(),
                                [](const std::weak_ptr<OffloadRecord>& r) { return r.expired(); }),
                 records_.end());
  for (auto it = by_storage_.begin(); it != by_storage_.end();) {
    it = it->second.expired() ? by_storage_.erase(it) : std::next(it);
  }
}

void OffloadScope::maybe_prune_locked() {
  if (marks_.size() + records_.size() >= prune_at_) {
    prune_locked();
    prune_at_ = std::max<size_t>(64, 2 * (marks_.size() + records_.size()));
  }
}

int64_t OffloadScope::tracked_state() const {
  std::lock_guard<std::mutex> lock(*mutex_);
  int64_t n = 0;
  for (const auto& m : marks_) n += m.expired() ? 0 : 1;
  for (const auto& r : records_) n += r.expired() ? 0 : 1;
  return n;
}

OffloadStats OffloadScope::stats() const {
  std::lock_guard<std::mutex> lock(*mutex_);
  OffloadStats s = stats_;
  s.pool_bytes = pool_->stats().held_bytes;
  return s;
}

SpillStats OffloadScope::spill_stats() const {
  std::shared_ptr<SpillStore> store;
  {
    std::lock_guard<std::mutex> lock(*mutex_);
    store = spill_;
  }
  return store ? store->stats() : SpillStats{};
}

c10::Stream OffloadScope::side_stream_locked(c10::Device device, int which) {
  for (const auto& entry : streams_) {
    if (entry.first == device) {
      return entry.second[which];
    }
  }
  c10::impl::VirtualGuardImpl impl(device.type());
  streams_.emplace_back(device, std::array<c10::Stream, 2>{impl.getStreamFromGlobalPool(device, false),
                                                          impl.getStreamFromGlobalPool(device, false)});
  return streams_.back().second[which];
}

std::shared_ptr<SavedHandle> SavedHandle::passthrough(const at::Tensor& x) {
  std::shared_ptr<SavedHandle> handle(new SavedHandle());  // private ctor
  if (x.defined() && x.unsafeGetTensorImpl()->version_counter().enabled()) {
    handle->version_counter_ = x.unsafeGetTensorImpl()->version_counter();
    handle->version_at_pack_ = version_of(x);
  }
  // A tensor with a grad_fn may be the output of the node saving it; holding
  // it (and so its grad_fn) from the node would be a reference cycle, so keep
  // a shallow alias that shares storage and version counter.
  handle->passthrough_ = (x.defined() && x.requires_grad() && !x.is_leaf()) ? x.tensor_data() : x;
  return handle;
}

std::shared_ptr<SavedHandle> OffloadScope::pack(const at::Tensor& x) {
  // Profiler ranges (torch.profiler, Chrome/Perfetto traces) name every engine step: docs/design.md, "Tracing".
  RECORD_USER_SCOPE("hsoffload::pack");
  auto handle = SavedHandle::passthrough(x);
  handle->scope_ = shared_from_this();
  std::lock_guard<std::mutex> lock(*mutex_);
  if (spill_) {
    // A spill write of this scope failed on an I/O thread since the last pack: fail the step here, in forward.
    const std::string error = spill_errors_->take();
    TORCH_CHECK(error.empty(), error);
  }
  count(stats_, &OffloadStats::saved_tensors_seen, 1);
  Mark* mark = x.defined() && !marks_.empty() ? find_mark_locked(x) : nullptr;
  if (mark != nullptr) {
    if (!mark->counted) {
      mark->counted = true;
      count(stats_, &OffloadStats::marked_tensors, 1);
    }
    // Parameters are refused at mark time by the Python shim (only it can tell
    // an nn.Parameter from any leaf that requires grad, such as an embedding
    // output under enable_input_require_grads()).
    const bool device_ok = has_plain_storage(x) && (!x.is_cpu() || config_.offload_cpu_tensors) && x.numel() > 0;
    auto span = device_ok ? storage_span(x) : std::make_pair<int64_t, int64_t>(0, 0);
    // The engine checks what it copies from: the span must lie inside the storage's bytes.
    const bool span_ok = device_ok && span.first >= 0 &&
                         span.second <= static_cast<int64_t>(x.storage().nbytes());
    if (span_ok && span.second - span.first >= config_.min_offload_size) {
      // Start the copy at a 512-byte boundary of the storage: the restored
      // tensor then has the same data-pointer alignment as the original, so
      // kernels pick the same algorithms (bit-identical results).
      span.first -= span.first % kSpanAlignment;
      auto record = find_record_locked(x.storage().unsafeGetStorageImpl(), span.first, span.second);
      const int64_t x_begin = x.storage_offset() * static_cast<int64_t>(x.element_size());
      if (record && (record->source_version != version_of(x) ||
                     (x_begin - record->begin) % static_cast<int64_t>(x.element_size()) != 0)) {
        record = nullptr;  // same storage but new contents (or misaligned for this dtype): copy again
      }
      if (!record) {
        record = offload_locked(x, span.first, span.second);
      }
      if (!record) {
        count(stats_, &OffloadStats::kept_on_device_tensors, 1);  // over the host budget, no spill tier
        return handle;
      }
      handle->passthrough_ = at::Tensor();  // the record replaces the device tensor
      handle->record_ = std::move(record);
      handle->dtype_ = x.scalar_type();
      handle->sizes_ = x.sizes().vec();
      handle->strides_ = x.strides().vec();
      handle->conj_ = x.is_conj();  // a bit of the tensor, not of its bytes
      handle->neg_ = x.is_neg();
      handle->offset_in_span_ =
          (x.storage_offset() * static_cast<int64_t>(x.element_size()) - handle->record_->begin) /
          static_cast<int64_t>(x.element_size());
      return handle;
    }
    count(stats_, &OffloadStats::skipped_marked_tensors, 1);
  }
  return handle;
}

std::shared_ptr<OffloadRecord> OffloadScope::find_record_locked(const c10::StorageImpl* storage, int64_t begin,
                                                                int64_t end) {
  auto range = by_storage_.equal_range(storage);
  for (auto it = range.first; it != range.second; ++it) {
    auto record = it->second.lock();
    if (record && record->begin <= begin && end <= record->end && record->source.lock().get() == storage) {
      return record;
    }
  }
  return nullptr;
}

std::shared_ptr<OffloadRecord> OffloadScope::offload_locked(const at::Tensor& x, int64_t begin, int64_t end) {
  auto record = std::make_shared<OffloadRecord>();
  const int64_t bytes = end - begin;
  const bool in_budget = budget_->try_reserve((bytes + HostPool::kGranule - 1) / HostPool::kGranule *
                                                  HostPool::kGranule, record->lease);
  if (!in_budget && !spill_) {
    return nullptr;
  }
  record->seq = next_seq_++;
  record->group = open_group_ >= 0 ? open_group_ : next_group_++;
  record->epoch = epoch_;
  record->device = x.device();
  record->source = x.storage().getWeakStorageImpl();
  record->source_version = version_of(x);
  record->begin = begin;
  record->end = end;
  // `begin` is a multiple of kSpanAlignment, so the span starts where the storage does, modulo kSpanAlignment.
  record->source_align =
      static_cast<int64_t>(reinterpret_cast<uintptr_t>(x.storage().data_ptr().get()) % kSpanAlignment);
  record->mutex = mutex_;
  record->use_streams = config_.use_streams;
  if (in_budget) {
    copy_to_host_locked(*record, x);
  } else {
    spill_locked(*record, x);
    count(stats_, &OffloadStats::spilled_tensors, 1);
    count(stats_, &OffloadStats::spilled_bytes, bytes);
  }
  maybe_prune_locked();
  records_.push_back(record);
  by_storage_.emplace(x.storage().unsafeGetStorageImpl(), record);
  count(stats_, &OffloadStats::offloaded_tensors, 1);
  count(stats_, &OffloadStats::offloaded_bytes, bytes);
  return record;
}

void OffloadScope::copy_to_host_locked(OffloadRecord& record, const at::Tensor& x) {
  RECORD_USER_SCOPE("hsoffload::copy_to_host");
  const int64_t bytes = record.bytes();
  const bool on_cpu = x.is_cpu();
  const bool pinned = !on_cpu && config_.pin_memory;
  record.host = pool_->acquire(bytes, pinned);
  at::Tensor src = byte_view(x.storage(), x.device(), record.begin, record.end);
  const auto copy_pieces = [&](bool non_blocking) {
    int64_t offset = 0;
    for (const at::Tensor& piece : record.host.pieces()) {
      piece.copy_(src.narrow(0, offset, piece.numel()), non_blocking);
      offset += piece.numel();
    }
  };
  if (on_cpu) {
    copy_pieces(false);
    return;
  }
  c10::impl::VirtualGuardImpl impl(x.device().type());
  const c10::Stream compute = impl.getStream(x.device());  // current at pack time, never cached
  c10::Stream copy_stream = compute;
  if (config_.use_streams) {
    copy_stream = side_stream_locked(x.device(), 0);
    c10::Event produced(x.device().type());
    produced.record(compute);
    produced.block(copy_stream);  // the copy reads x only after the compute stream wrote it
  }
  {
    c10::StreamGuard guard(copy_stream);
    copy_pieces(/*non_blocking=*/pinned);
  }
  if (copy_stream != compute) {
    // The device block must not be reused by the compute stream before the
    // copy has read it: tell the allocator about the side-stream use, so
    // that dropping the last reference frees it without a host block.
    impl.recordDataPtrOnStream(x.storage().data_ptr(), copy_stream);
  }
  record.d2h_done = std::make_shared<c10::Event>(x.device().type());
  record.d2h_done->record(copy_stream);
  record.host.record_use(record.d2h_done);
}

void OffloadScope::spill_locked(OffloadRecord& record, const at::Tensor& x) {
  RECORD_USER_SCOPE("hsoffload::spill");
  // The I/O thread holds the device bytes until it has copied them to staging, so no allocator bookkeeping is
  // needed; it waits for `produced` on the copy stream before reading them.
  at::Tensor src = byte_view(x.storage(), x.device(), record.begin, record.end);
  std::shared_ptr<c10::Event> produced;
  std::optional<c10::Stream> copy_stream;
  if (!x.is_cpu()) {
    c10::impl::VirtualGuardImpl impl(x.device().type());
    const c10::Stream compute = impl.getStream(x.device());
    copy_stream = config_.use_streams ? side_stream_locked(x.device(), 0) : compute;
    produced = std::make_shared<c10::Event>(x.device().type());
    produced->record(compute);
  }
  record.store = spill_;
  record.spill = spill_->write(std::move(src), std::move(produced), copy_stream, spill_errors_);
}

void OffloadScope::start_restore_locked(OffloadRecord& record) {
  RECORD_USER_SCOPE("hsoffload::copy_to_device");
  // Allocated while the compute stream is current so the block belongs to its
  // pool; the side stream waits for the allocation point and for the D2H copy.
  const int64_t bytes = record.bytes();
  // The restored span starts at the same address modulo kSpanAlignment as the original did, so kernels see the
  // same data-pointer alignment and take the same code paths (bit-identical results). Allocators that hand out
  // kSpanAlignment-aligned blocks (CUDA's) get exactly `bytes`; others (the CPU's 64-byte alignment) a little more.
  const auto options = at::TensorOptions().dtype(at::kByte).device(record.device);
  at::Tensor block = at::empty({bytes}, options);
  const auto misalignment = [&](const at::Tensor& b) {
    const auto at = static_cast<int64_t>(reinterpret_cast<uintptr_t>(b.data_ptr()) % kSpanAlignment);
    return (record.source_align - at + kSpanAlignment) % kSpanAlignment;
  };
  record.pad = misalignment(block);
  if (record.pad != 0) {
    block = at::empty({bytes + kSpanAlignment}, options);
    record.pad = misalignment(block);
  }
  at::Tensor dev = block.narrow(0, record.pad, bytes);
  const auto copy_pieces = [&](bool non_blocking) {
    int64_t offset = 0;
    for (const at::Tensor& piece : record.host.pieces()) {
      dev.narrow(0, offset, piece.numel()).copy_(piece, non_blocking);
      offset += piece.numel();
    }
  };
  record.prefetched = block;
  record.h2d_done = nullptr;
  if (record.device.is_cpu()) {
    if (record.spill) {
      record.spill_read = record.store->read(record.spill, dev, nullptr, std::nullopt);
    } else {
      copy_pieces(false);
    }
    return;
  }
  c10::impl::VirtualGuardImpl impl(record.device.type());
  const c10::Stream compute = impl.getStream(record.device);
  record.alloc_stream = compute;
  c10::Stream copy_stream = compute;
  if (record.spill) {
    // The I/O thread copies into `dev` on the copy stream once the allocation point has passed; unpack waits for
    // the read and then for its event.
    auto allocated = std::make_shared<c10::Event>(record.device.type());
    allocated->record(compute);
    record.spill_read =
        record.store->read(record.spill, dev, std::move(allocated),
                           record.use_streams ? side_stream_locked(record.device, 1) : compute);
    return;
  }
  if (record.use_streams) {
    copy_stream = side_stream_locked(record.device, 1);
    c10::Event allocated(record.device.type());
    allocated.record(compute);
    allocated.block(copy_stream);
  }
  if (record.d2h_done) {
    record.d2h_done->block(copy_stream);  // host bytes are complete before we read them
  }
  {
    c10::StreamGuard guard(copy_stream);
    copy_pieces(/*non_blocking=*/record.host.pinned());
  }
  if (copy_stream != compute) {
    impl.recordDataPtrOnStream(dev.storage().data_ptr(), copy_stream);
  }
  record.h2d_done = std::make_shared<c10::Event>(record.device.type());
  record.h2d_done->record(copy_stream);
  record.host.record_use(record.h2d_done);
}

void OffloadScope::prefetch_before_locked(const OffloadRecord& current) {
  RECORD_USER_SCOPE("hsoffload::prefetch");
  // Host copies come back prefetch_depth groups ahead; spilled ones, slower to read, spill_prefetch_depth groups
  // ahead. Distance 0 is the rest of the current record's own group (packed before or after it: a layer's
  // recompute reads its saved tensors in forward order), needed next.
  // Without a spill store there are no spilled records here: stop after the host quota (O(prefetch_depth)).
  const int64_t spill_depth = spill_ ? config_.spill_prefetch_depth : 0;
  struct Quota {
    int64_t depth;
    int64_t last_group;
    int64_t distance = 0;
    bool admits(int64_t group) {
      if (depth == 0) {
        return false;  // no prefetch of this kind
      }
      if (group != last_group) {
        last_group = group;
        ++distance;
      }
      return distance <= depth;
    }
    bool more() const { return depth > 0 && distance <= depth; }
  };
  Quota host{config_.prefetch_depth, current.group}, spilled{spill_depth, current.group};
  const auto more = [&] { return host.more() || spilled.more(); };
  for (auto it = records_.rbegin(); it != records_.rend() && more(); ++it) {
    auto record = it->lock();
    if (!record || record->group > current.group || record.get() == &current) {
      continue;  // later groups were restored before (reverse order); the rest of this group comes next
    }
    if (record->epoch != current.epoch) {
      break;  // records are in pack order: everything before belongs to an earlier entry
    }
    if (!(record->spill ? spilled : host).admits(record->group)) {
      continue;
    }
    if (record->prefetched.defined() || !record->restored.expired()) {
      continue;
    }
    if (record->group == current.group && record->seq > current.seq && record->restored_once) {
      continue;  // packed after the current one and restored already: backward is past it (reverse order)
    }
    start_restore_locked(*record);
  }
}

void OffloadScope::begin_group() {
  std::lock_guard<std::mutex> lock(*mutex_);
  open_group_ = next_group_++;
}

void OffloadScope::end_group() {
  std::lock_guard<std::mutex> lock(*mutex_);
  open_group_ = -1;
}

at::Tensor OffloadScope::restore(const SavedHandle& handle) {
  RECORD_USER_SCOPE("hsoffload::unpack");
  OffloadRecord& record = *handle.record_;
  std::lock_guard<std::mutex> lock(*record.mutex);
  at::Tensor dev;
  if (auto alive = record.restored.lock()) {
    // Restored earlier and still held (a second unpack of a shared storage).
    dev = byte_view(c10::Storage(std::move(alive)), record.device, record.pad, record.pad + record.bytes());
  } else {
    const bool hit = record.prefetched.defined();
    const auto t0 = std::chrono::steady_clock::now();
    if (!hit) {
      start_restore_locked(record);
    }
    dev = std::move(record.prefetched);
    record.prefetched = at::Tensor();
    if (record.spill_read) {
      // Raises (naming spill_dir) if the write or the read failed; nothing of this restore is kept then.
      const auto w0 = std::chrono::steady_clock::now();
      const auto read = std::move(record.spill_read);
      {
        RECORD_USER_SCOPE("hsoffload::wait_spill_read");
        record.h2d_done = read->wait();
      }
      count(stats_, &OffloadStats::spill_read_wait_ns,
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - w0).count());
    }
    record.restored = dev.storage().getWeakStorageImpl();
    record.restored_once = true;
    count(stats_, hit ? &OffloadStats::prefetch_hits : &OffloadStats::wait_ns,
          hit ? 1 : std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    count(stats_, &OffloadStats::restored_bytes, record.bytes());
    if (config_.prefetch_depth > 0 || config_.spill_prefetch_depth > 0) {
      prefetch_before_locked(record);
    }
  }
  if (record.h2d_done) {
    // Every consumer waits for the copy on its own current stream (device-side
    // wait, no host sync); a consumer on another stream than the one that
    // allocated the block is made known to the allocator.
    c10::impl::VirtualGuardImpl impl(record.device.type());
    const c10::Stream consumer = impl.getStream(record.device);
    record.h2d_done->block(consumer);
    if (record.alloc_stream && *record.alloc_stream != consumer) {
      impl.recordDataPtrOnStream(dev.storage().data_ptr(), consumer);
    }
  }
  count(stats_, &OffloadStats::restored_tensors, 1);
  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(handle.dtype_).device(record.device));
  out.set_(dev.storage(), record.pad / at::elementSize(handle.dtype_) + handle.offset_in_span_, handle.sizes_,
           handle.strides_);
  out._set_conj(handle.conj_);
  out._set_neg(handle.neg_);
  return out;
}

// ---------------------------------------------------------------------------
// SavedHandle

void SavedHandle::check_version() const {
  if (!version_counter_) {
    return;
  }
  const uint32_t now = version_counter_->current_version();
  TORCH_CHECK(now == version_at_pack_,
              "one of the variables needed for gradient computation has been modified by an inplace operation "
              "(detected by hsoffload's unpack hook): is at version ",
              now, "; expected version ", version_at_pack_,
              " instead. Hint: do not modify a tensor in place after autograd saved it, or clone it first.");
}

at::Tensor SavedHandle::unpack() const {
  check_version();
  if (!record_) {
    return passthrough_;
  }
  return scope_->restore(*this);
}

}  // namespace hsoffload
