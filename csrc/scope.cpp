// The offload scope (scope.h): lifecycle and the per-thread stack, pack (marks -> record index -> transfer to host
// or spill) and unpack (restore -> prefetch -> consume). The stream work is transfer.cpp's.
#include "hsoffload/scope.h"

#include "hsoffload/events.h"
#include "hsoffload/prefetch.h"
#include "hsoffload/tensor_kind.h"

#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <new>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <utility>

namespace hsoffload {

namespace {

// The process's counters (the sum over every scope): a process-wide total is the point of them. Guarded by their
// own mutex.
std::mutex& process_stats_mutex() {
  static std::mutex m;
  return m;
}
OffloadStats& process_stats_locked() {
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

// The bytes a new record copies for a save whose storage span is `span`: the span, or the whole storage when the
// span covers most of it. Sibling views of one output -- the chunks of a fused projection (gate/up, q/k/v), columns
// of one index tensor -- each span nearly all of their storage without covering one another; copying the storage
// once lets the later siblings find the record (RecordIndex::find) instead of copying the same bytes again. At most
// 4/3 of the span is copied; a view of under 3/4 of its storage copies only its span. (M21)
std::pair<int64_t, int64_t> copy_span(std::pair<int64_t, int64_t> span, int64_t storage_bytes) {
  if (4 * (span.second - span.first) >= 3 * storage_bytes) {
    return {0, storage_bytes};
  }
  return span;
}

// The elements `x` references, in bytes of its storage (`span`: storage_span(x)).
SaveFootprint footprint(const at::Tensor& x, std::pair<int64_t, int64_t> span) {
  SaveFootprint save;
  save.begin = span.first;
  save.end = span.second;
  save.itemsize = static_cast<int64_t>(x.element_size());
  save.sizes = x.sizes().vec();
  save.strides = x.strides().vec();
  // Dense: as many elements as the span holds and no two at one address (contiguous up to a permutation of dims).
  save.dense = x.numel() * save.itemsize == span.second - span.first && x.is_non_overlapping_and_dense();
  return save;
}

// Whether `device`'s current stream captures a graph: its held blocks stay held (KeepAlive::release_all).
bool capturing_device(c10::Device device) { return stream_capturing(device); }

void count(OffloadStats& local, int64_t OffloadStats::*field, int64_t n) {
  local.*field += n;
  std::lock_guard<std::mutex> lock(process_stats_mutex());
  process_stats_locked().*field += n;
}

}  // namespace

void OffloadConfig::validate() const {
  TORCH_CHECK_VALUE(min_offload_size >= 0, "hsoffload: min_offload_size must be >= 0 bytes, got ", min_offload_size);
  TORCH_CHECK_VALUE(prefetch_depth >= 0, "hsoffload: prefetch_depth must be >= 0, got ", prefetch_depth);
  TORCH_CHECK_VALUE(spill_prefetch_depth >= 0, "hsoffload: spill_prefetch_depth must be >= 0, got ",
                    spill_prefetch_depth);
  TORCH_CHECK_VALUE(spill_wait_ms >= 0 && spill_wait_ms <= kMaxSpillWaitMs, "hsoffload: spill_wait_ms must be "
                    "between 0 (keep a tensor that finds no host room on the device at once) and ", kMaxSpillWaitMs,
                    " (one hour), got ", spill_wait_ms);
}

OffloadStats process_stats() {
  std::lock_guard<std::mutex> lock(process_stats_mutex());
  OffloadStats s = process_stats_locked();
  s.pool_bytes = global_host_pool()->stats().held_bytes;
  return s;
}

// ---------------------------------------------------------------------------
// Lifecycle

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
      mutex_(std::make_shared<std::mutex>()),
      streams_(config_.use_streams) {}

void OffloadScope::set_prefetch_depth(int64_t depth) {
  TORCH_CHECK_VALUE(depth >= 0, "hsoffload: set_prefetch_depth: the depth must be >= 0 (decoder layers restored "
                    "ahead of backward), got ", depth);
  std::lock_guard<std::mutex> lock(*mutex_);
  prefetch_depth_ = depth;
}

int64_t OffloadScope::prefetch_depth() const {
  std::lock_guard<std::mutex> lock(*mutex_);
  return prefetch_depth_;
}

OffloadScope::~OffloadScope() {
  side_uses_.release_all(capturing_device);  // nothing else holds the scope now: no lock; a host wait at most for a
                                            // source still being copied
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
      config_.spill_dir.empty() ? nullptr : SpillStore::open(config_.spill_dir, config_.pin_memory, pool_);
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
    host_alloc_failed_ = false;  // a new entry tries pinning again
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
  {
    std::lock_guard<std::mutex> lock(*mutex_);
    active_ = false;
    marks_.clear();
    prune_locked();
    // What the scope's entry leaves held (keepalive.h): done copies, restored blocks (their stream waits on the
    // device) and consumers' blocks go now; on a dead context everything goes. A source still being copied on a
    // live context goes to the process's SourceReaper, which lets go of it as soon as its copy is done -- not at
    // the scope's next call or in its destructor (a scope around forward only).
    side_uses_.reap();
    side_uses_.release_restores(capturing_device);
    side_uses_.release_consumers(capturing_device);
    side_uses_.drop_failed();
    try {
      side_uses_.hand_off_sources(SourceReaper::instance(), capturing_device);  // (M26) let go at copy speed
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): no room or no thread: they stay held here,
    }                                  // reaped by the next call or waited for by the destructor, as before
  }
  release_restores();  // at the latest here: nothing of a backward that ended early stays on the device
}

bool OffloadScope::active() const {
  std::lock_guard<std::mutex> lock(*mutex_);
  return active_;
}

std::shared_ptr<OffloadScope> OffloadScope::current() {
  return tls_scopes.empty() ? nullptr : tls_scopes.back();
}

void OffloadScope::begin_group() {
  std::lock_guard<std::mutex> lock(*mutex_);
  open_group_ = next_group_++;
}

void OffloadScope::end_group() {
  std::lock_guard<std::mutex> lock(*mutex_);
  open_group_ = -1;
}

void OffloadScope::prune_locked() {
  marks_.prune();
  records_.prune();
  spill_cursor_ = 0;  // indices moved
}

void OffloadScope::maybe_prune_locked() {
  if (marks_.size() + records_.size() >= prune_at_) {
    prune_locked();
    prune_at_ = std::max<size_t>(64, 2 * (marks_.size() + records_.size()));
  }
}

int64_t OffloadScope::tracked_state() const {
  std::lock_guard<std::mutex> lock(*mutex_);
  return marks_.live() + records_.live() + static_cast<int64_t>(side_uses_.size());
}

OffloadStats OffloadScope::stats() const {
  std::lock_guard<std::mutex> lock(*mutex_);
  OffloadStats s = stats_;
  s.pool_bytes = pool_->stats().held_bytes;
  s.spill_write_errors = spill_errors_->count();
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

// ---------------------------------------------------------------------------
// Marks

void OffloadScope::mark(const at::Tensor& x) {
  TORCH_INTERNAL_ASSERT(x.defined());  // checked by the op adapter
  // Any tensor may be marked; pack decides whether its bytes can move (has_plain_storage) and counts the ones it
  // keeps in place, so a mark that cannot take effect is visible in the counters.
  std::lock_guard<std::mutex> lock(*mutex_);
  if (!active_) {
    return;
  }
  maybe_prune_locked();
  marks_.add(x);
}

bool OffloadScope::is_marked(const at::Tensor& x) {
  std::lock_guard<std::mutex> lock(*mutex_);
  return active_ && x.defined() && marks_.find(x) != nullptr;
}

// ---------------------------------------------------------------------------
// Pack

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

std::shared_ptr<SavedHandle> OffloadScope::pack(const at::Tensor& x, bool capturing) {
  // Profiler ranges (torch.profiler, Chrome/Perfetto traces) name every engine step: docs/design.md, "Tracing".
  RECORD_USER_SCOPE("hsoffload::pack");
  auto handle = SavedHandle::passthrough(x);
  handle->scope_ = shared_from_this();
  MayDefer may;
  HostNeed need;
  {
    std::lock_guard<std::mutex> lock(*mutex_);
    need = pack_locked(x, capturing, *handle, /*first=*/true, may);
  }
  while (need.any()) {  // at most twice: each kind of wait is done once
    if (need.bytes > 0) {
      // The pool has no room for this copy: grow it here, holding no lock (a pinned allocation costs ~0.1-0.3 s per
      // GiB; other threads' packs and unpacks go on meanwhile), then decide again. hsoffload.reserve_host does this
      // before the first step, so packs normally never get here.
      if (!reserve_or_keep(need.bytes, need.pinned)) {
        std::lock_guard<std::mutex> lock(*mutex_);
        count(stats_, &OffloadStats::kept_on_device_tensors, 1);
        return handle;  // the host has no memory to give: the tensor stays on the device, as for a full budget
      }
      may.pool = false;
    } else {
      // Packs outran the disk: the budget is full of host copies being written out. Wait, holding no lock, until
      // the writes free room (bounded; a failed write or nothing left to write ends it early), then decide again:
      // the copy goes to host, or the tensor stays on the device.
      if (config_.spill_wait_ms > 0) {
        RECORD_USER_SCOPE("hsoffload::wait_host_budget");
        const auto t0 = std::chrono::steady_clock::now();
        budget_->wait_for_room(need.budget_bytes, t0 + std::chrono::milliseconds(config_.spill_wait_ms), [this] {
          return writing_bytes_->load() == 0 || spill_errors_->pending();
        });
        const int64_t waited =
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
        std::lock_guard<std::mutex> lock(*mutex_);
        count(stats_, &OffloadStats::wait_ns, waited);
        count(stats_, &OffloadStats::pack_wait_ns, waited);
      }
      may.budget = false;
    }
    std::lock_guard<std::mutex> lock(*mutex_);
    need = pack_locked(x, capturing, *handle, /*first=*/false, may);
  }
  return handle;
}

OffloadScope::HostNeed OffloadScope::pack_locked(const at::Tensor& x, bool capturing, SavedHandle& out, bool first,
                                                  MayDefer may) {
  SavedHandle* const handle = &out;
  if (spill_) {
    // A spill write of this scope failed on an I/O thread since the last pack: fail the step here, in forward.
    const std::string error = spill_errors_->take();
    TORCH_CHECK(error.empty(), error);
  }
  if (first) count(stats_, &OffloadStats::saved_tensors_seen, 1);
  if (!capturing && !side_uses_.empty() && x.defined() && !stream_capturing(x.device())) {
    side_uses_.reap();  // no event query while a graph is captured
  }
  Mark* mark = x.defined() && !marks_.empty() ? marks_.find(x) : nullptr;
  if (mark != nullptr) {
    if (!mark->counted) {
      mark->counted = true;
      count(stats_, &OffloadStats::marked_tensors, 1);
    }
    // Parameters are refused at mark time by the Python shim (only it can tell
    // an nn.Parameter from any leaf that requires grad, such as an embedding
    // output under enable_input_require_grads()).
    const bool device_ok = has_plain_storage(x) && (!x.is_cpu() || config_.offload_cpu_tensors) && x.numel() > 0;
    // Graph capture: no copy, event, side stream or pinned allocation may happen while the current stream captures
    // (docs/design.md, "Graph capture"); the tensor stays where it is, in the graph's own memory. Checked before the
    // record index too: a record packed before the capture must not be shared into the graph.
    if (device_ok && (capturing || stream_capturing(x.device()))) {  // (M19) no transfer while capturing
      count(stats_, &OffloadStats::captured_passthrough, 1);
      return {};
    }
    auto span = device_ok ? storage_span(x) : std::make_pair<int64_t, int64_t>(0, 0);
    // The engine checks what it copies from: the span must lie inside the storage's bytes.
    const bool span_ok = device_ok && span.first >= 0 &&
                         span.second <= static_cast<int64_t>(x.storage().nbytes());
    if (span_ok && span.second - span.first >= config_.min_offload_size) {
      // Start the copy at a 512-byte boundary of the storage: the restored
      // tensor then has the same data-pointer alignment as the original, so
      // kernels pick the same algorithms (bit-identical results).
      const SaveFootprint save = footprint(x, span);
      span.first -= span.first % kSpanAlignment;
      const int64_t itemsize = static_cast<int64_t>(x.element_size());
      const ProducerRef producer = ProducerRef::of(x);
      const SaveSite site = SaveSite::now();
      // A record of this storage may serve this save only with the same contents (version), aligned for this dtype,
      // and only for bytes it may share (SharePolicy): else the save gets a copy of its own.
      auto record = records_.find(x.storage().unsafeGetStorageImpl(), span.first, span.second,
                                  [&](const OffloadRecord& r) {
                                    if (r.source.version != version_of(x)) return false;
                                    if ((save.begin - r.source.begin) % itemsize != 0) return false;
                                    // no stale bytes (SharePolicy, M24)
                                    if (!r.sharing.admits(save, producer.get(), site, config_.share_copies)) return false;
                                    return true;
                                  });
      // Only within this scope entry's forward: a record of another graph, or one backward has restored already (a
      // reentrant recompute saving it again), keeps its place.
      if (record && open_group_ >= 0 && record->group < open_group_ && record->epoch == epoch_ &&
          !record->restore.restored_once) {
        records_.regroup(record, open_group_, next_seq_++, epoch_);  // (M23) saved again by a later layer
      }
      HostNeed need;
      if (record) {
        record->sharing.add(save);
      } else {
        const auto copied = copy_span(span, static_cast<int64_t>(x.storage().nbytes()));
        record = offload_locked(x, copied.first, copied.second, may, need);
        if (record) record->sharing.first(save, producer, site);
      }
      if (need.any()) {
        return need;  // pack() grows the pool or waits for room holding no lock, then comes back
      }
      if (!record) {
        count(stats_, &OffloadStats::kept_on_device_tensors, 1);  // over the host budget, no spill tier
        return {};
      }
      handle->passthrough_ = at::Tensor();  // the record replaces the device tensor
      record->restore.round.add_handle();
      handle->record_ = std::move(record);
      handle->dtype_ = x.scalar_type();
      handle->sizes_ = x.sizes().vec();
      handle->strides_ = x.strides().vec();
      handle->conj_ = x.is_conj();  // a bit of the tensor, not of its bytes
      handle->neg_ = x.is_neg();
      handle->offset_in_span_ =
          (x.storage_offset() * static_cast<int64_t>(x.element_size()) - handle->record_->source.begin) /
          static_cast<int64_t>(x.element_size());
      return {};
    }
    count(stats_, &OffloadStats::skipped_marked_tensors, 1);
  }
  return {};
}

std::shared_ptr<OffloadRecord> OffloadScope::offload_locked(const at::Tensor& x, int64_t begin, int64_t end,
                                                            MayDefer may, HostNeed& need) {
  const int64_t bytes = end - begin;
  const int64_t granted = (bytes + HostPool::kGranule - 1) / HostPool::kGranule * HostPool::kGranule;
  const bool pinned = !x.device().is_cpu() && config_.pin_memory;
  // Never allocate (pin) host memory under the scope's lock: pack() grows the pool holding none, then comes back.
  const auto pool_lacks_room = [&] { return may.pool && pool_->free_bytes(pinned) < granted; };
  if (budget_->fits(granted) && pool_lacks_room()) {
    need.bytes = granted;
    need.pinned = pinned;
    return nullptr;
  }
  auto record = std::make_shared<OffloadRecord>();
  bool in_budget = budget_->try_reserve(granted, record->copy->lease);
  if (!in_budget && !spill_) {
    return nullptr;
  }
  if (!in_budget && granted <= budget_->stats().limit) {
    // Docs/design.md, "Host budget and spill tier": the copy goes to host once older host copies are on disk.
    spill_oldest_locked(granted);
    // Read before trying again: a write finishes by giving its budget back and only then leaves writing_bytes_, so
    // 0 here means every write of this scope has given its room back already.
    const int64_t writing = writing_bytes_->load();
    in_budget = budget_->try_reserve(granted, record->copy->lease);
    if (in_budget && pool_lacks_room()) {
      need.bytes = granted;  // the reservation goes back with `record`; pack() grows the pool and comes back
      need.pinned = pinned;
      return nullptr;
    }
    if (!in_budget && writing > 0) {
      if (may.budget) {
        need.budget_bytes = granted;  // pack() waits for that room holding no lock, then comes back
      }
      return nullptr;  // after the wait: stays on the device
    }
  }
  // Larger than the whole budget, or the budget is held by copies this scope cannot move (another scope's, or
  // failed writes): no room will come, so the device bytes go to the file themselves.
  const bool from_device = !in_budget;
  HostBlock host;
  if (!from_device) {
    // Normally lent from room pack() made; a pool over its limit allocates a block of its own here, which can fail
    // (pinned memory exhausted): then the tensor stays on the device, counted, never an error out of the hook.
    try {
      host = acquire_host_block(*pool_, bytes, x.device(), config_.pin_memory);
    } catch (const c10::Error& e) {
      note_host_alloc_failure_locked(e.what_without_backtrace());
      return nullptr;
    } catch (const std::bad_alloc& e) {
      note_host_alloc_failure_locked(e.what());
      return nullptr;
    }
  }
  record->seq = next_seq_++;
  record->group = open_group_ >= 0 ? open_group_ : next_group_++;
  record->epoch = epoch_;
  SourceSpan& source = record->source;
  source.device = x.device();
  source.storage = x.storage().getWeakStorageImpl();
  source.version = version_of(x);
  source.begin = begin;
  source.end = end;
  // `begin` is a multiple of kSpanAlignment, so the span starts where the storage does, modulo kSpanAlignment.
  source.align = static_cast<int64_t>(reinterpret_cast<uintptr_t>(x.storage().data_ptr().get()) % kSpanAlignment);
  record->mutex = mutex_;
  if (from_device) {
    spill_from_device_locked(*record, x);
    count(stats_, &OffloadStats::spilled_tensors, 1);
    count(stats_, &OffloadStats::spilled_bytes, bytes);
    count(stats_, &OffloadStats::spilled_from_device_tensors, 1);
  } else {
    copy_to_host_locked(*record, x, std::move(host));
  }
  maybe_prune_locked();
  records_.add(record);
  count(stats_, &OffloadStats::offloaded_tensors, 1);
  count(stats_, &OffloadStats::offloaded_bytes, bytes);
  if (!from_device && spill_) {
    largest_copy_ = std::max(largest_copy_, granted);
    spill_oldest_locked(0);  // start writing early, so that the next packs find room
  }
  return record;
}

bool OffloadScope::reserve_or_keep(int64_t bytes, bool pinned) {
  {
    std::lock_guard<std::mutex> lock(*mutex_);
    if (host_alloc_failed_) {
      return false;  // failed earlier in this entry: no other failing pinned allocation per pack (kept, not failed)
    }
  }
  std::string error;
  try {
    pool_->reserve(bytes, pinned);
    return true;
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::bad_alloc& e) {
    error = e.what();
  }
  std::lock_guard<std::mutex> lock(*mutex_);
  note_host_alloc_failure_locked(error);
  return false;
}

void OffloadScope::note_host_alloc_failure_locked(const std::string& error) {
  host_alloc_failed_ = true;
  count(stats_, &OffloadStats::host_alloc_failures, 1);
  if (first_host_alloc_error_.empty()) {
    first_host_alloc_error_ = error.empty() ? std::string("(no message)") : error;
  }
}

std::string OffloadScope::first_host_alloc_error() const {
  std::lock_guard<std::mutex> lock(*mutex_);
  return first_host_alloc_error_;
}

void OffloadScope::copy_to_host_locked(OffloadRecord& record, const at::Tensor& x, HostBlock host) {
  RECORD_USER_SCOPE("hsoffload::copy_to_host");
  CopyLocation& copy = *record.copy;  // not shared yet: no lock needed
  copy.host = std::move(host);
  const at::Tensor src = byte_view(x.storage(), x.device(), record.source.begin, record.source.end);
  const int64_t held = side_uses_.holds();
  copy.d2h_done = copy_to_host(src, copy.host, streams_, side_uses_);
  count(stats_, &OffloadStats::side_use_holds, side_uses_.holds() - held);
}

void OffloadScope::spill_from_device_locked(OffloadRecord& record, const at::Tensor& x) {
  RECORD_USER_SCOPE("hsoffload::spill");
  at::Tensor src = byte_view(x.storage(), x.device(), record.source.begin, record.source.end);
  SpillOrder order = spill_write_order(src, streams_);
  CopyLocation& copy = *record.copy;  // not shared yet: no lock needed
  copy.store = spill_;
  copy.spill = spill_->write(std::move(src), std::move(order.ready), order.copy_stream, spill_errors_);
  copy.where = CopyLocation::Where::kFile;
}

void OffloadScope::spill_oldest_locked(int64_t need) {
  const BudgetStats budget = budget_->stats();
  const int64_t headroom = std::min(2 * largest_copy_, budget.limit / 2);
  int64_t deficit = need + headroom - (budget.limit - budget.in_flight) - writing_bytes_->load();
  const auto& records = records_.in_pack_order();  // oldest first
  // Records before the cursor are dead or have left kHost, which no copy ever re-enters: each is passed once.
  for (; spill_cursor_ < records.size() && deficit > 0; ++spill_cursor_) {
    auto record = records[spill_cursor_].lock();
    if (!record) {
      continue;
    }
    const std::shared_ptr<CopyLocation>& copy = record->copy;
    int64_t held = 0;
    {
      std::lock_guard<std::mutex> lock(copy->mutex);
      if (copy->where.load() != CopyLocation::Where::kHost || !copy->host.valid()) {
        continue;
      }
      copy->where = CopyLocation::Where::kSpilling;
      held = copy->lease.bytes();
    }
    start_host_write_locked(copy, record->bytes(), held);
    count(stats_, &OffloadStats::spilled_tensors, 1);
    count(stats_, &OffloadStats::spilled_bytes, record->bytes());
    deficit -= held;
  }
}

namespace {

// The host bytes of one spill write: counted in its scope's writing_bytes_ from the start of the write until its
// copy has moved to the file (or the job ended without writing), exactly once, and the budget's waiters woken.
class WritingBytes {
 public:
  WritingBytes(std::shared_ptr<std::atomic<int64_t>> counter, int64_t bytes, std::shared_ptr<HostBudget> budget)
      : counter_(std::move(counter)), bytes_(bytes), budget_(std::move(budget)) {
    counter_->fetch_add(bytes_);
  }
  ~WritingBytes() { finish(); }
  WritingBytes(const WritingBytes&) = delete;
  WritingBytes& operator=(const WritingBytes&) = delete;
  void finish() {
    if (!done_.exchange(true)) {
      counter_->fetch_sub(bytes_);
      budget_->wake();
    }
  }

 private:
  std::shared_ptr<std::atomic<int64_t>> counter_;
  int64_t bytes_;
  std::shared_ptr<HostBudget> budget_;
  std::atomic<bool> done_{false};
};

}  // namespace

void OffloadScope::start_host_write_locked(const std::shared_ptr<CopyLocation>& copy, int64_t bytes,
                                           int64_t held) {
  RECORD_USER_SCOPE("hsoffload::spill");
  std::weak_ptr<CopyLocation> weak = copy;  // the write must not keep a record alive that nobody needs
  auto writing = std::make_shared<WritingBytes>(writing_bytes_, held, budget_);
  auto take = [weak]() -> std::optional<HostSource> {
    auto location = weak.lock();
    if (!location) {
      return std::nullopt;
    }
    std::lock_guard<std::mutex> lock(location->mutex);
    return HostSource{location->host.extents(), location->d2h_done, location};
  };
  // On the I/O thread, after the write: the copy now lives in the file; its host block and budget go back (the
  // waiting packs wake). Takes only the copy's mutex, never the scope's (docs/design.md, "Threads").
  auto done = [weak, writing, errors = spill_errors_, store = std::weak_ptr<SpillStore>(spill_)](
                  std::shared_ptr<SpillFile> file, const std::string& error) {
    HostBlock freed_block;
    HostLease freed_lease;
    if (auto location = weak.lock()) {
      std::lock_guard<std::mutex> lock(location->mutex);
      auto owner = store.lock();
      if (error.empty() && file && owner) {
        location->store = std::move(owner);
        location->spill = std::move(file);
        freed_block = std::move(location->host);
        freed_lease = std::move(location->lease);
        location->where = CopyLocation::Where::kFile;
      } else {
        location->where = CopyLocation::Where::kSpillFailed;  // still in host; never written again
      }
    }
    if (!error.empty()) {
      errors->set(error);  // raised on the scope's thread, at its next pack or at the unpack
    }
    freed_block = HostBlock();  // back to the pool (after its last device use)
    freed_lease = HostLease();  // back to the budget: wakes the packs waiting for room
    writing->finish();
  };
  spill_->write_host(bytes, std::move(take), std::move(done));
}

// ---------------------------------------------------------------------------
// Restore

void OffloadScope::copy_to_device_locked(OffloadRecord& record) {
  RECORD_USER_SCOPE("hsoffload::copy_to_device");
  DeviceSpan dev = allocate_device_span(record.source.device, record.bytes(), record.source.align);
  RestoreState& restore = record.restore;
  restore.prefetched = dev.block;
  restore.pad = dev.pad;
  restore.h2d_done = nullptr;
  CopyLocation& copy = *record.copy;
  std::unique_lock<std::mutex> copy_lock(copy.mutex);  // an I/O thread may be moving it to a file
  if (!copy.in_host()) {
    // The I/O thread copies into the block once the allocation point has passed; unpack waits for the read and
    // then for its event.
    const std::shared_ptr<SpillStore> store = copy.store;
    const std::shared_ptr<SpillFile> file = copy.spill;
    copy_lock.unlock();
    SpillOrder order = spill_read_order(dev.bytes, streams_);
    if (order.alloc_stream) restore.alloc_stream = order.alloc_stream;
    restore.spill_read = store->read(file, dev.bytes, std::move(order.ready), order.copy_stream);
    return;
  }
  // In host (also while a spill write reads the block: both only read it).
  const int64_t held = side_uses_.holds();
  RestoreOrder order = copy_to_device(dev.bytes, copy.host, copy.d2h_done, streams_, side_uses_);
  count(stats_, &OffloadStats::side_use_holds, side_uses_.holds() - held);
  if (order.alloc_stream) restore.alloc_stream = order.alloc_stream;
  restore.h2d_done = std::move(order.done);
}

namespace {

// What a user needs next to the allocator's own message when a restore backward cannot do without finds no device
// memory: which op, how much, what was tried, and the knobs. The exception keeps its type (torch.OutOfMemoryError).
void add_restore_oom_context(c10::OutOfMemoryError& e, int64_t bytes, int64_t dropped, int64_t prefetch_depth) {
  std::ostringstream msg;
  msg << "hsoffload offload_unpack: no device memory to restore an offloaded tensor of " << bytes
      << " bytes that backward needs now";
  if (dropped > 0) {
    msg << ", even after giving back the " << dropped << " tensor(s) prefetched ahead (prefetch_depth="
        << prefetch_depth << ")";
  } else {
    msg << " (no prefetched tensors held; prefetch_depth=" << prefetch_depth << ")";
  }
  msg << ". The step's backward needs more device memory than is free while the offloaded tensors come back as it "
         "reaches them: shorten the sequence or micro-batch, use a tiled MLP or a chunked loss, lower keep_last_layers "
         "(layers kept on the device) or prefetch_depth, or compare with `hsoffload plan <config> --seq-len N`.";
  e.add_context(msg.str());
}

}  // namespace

void OffloadScope::restore_now_locked(OffloadRecord& record) {
  int64_t dropped = 0;
  try {
    copy_to_device_locked(record);
    return;
  } catch (c10::OutOfMemoryError& e) {
    // Blocks prefetched ahead of their unpack may hold the room this restore needs: give them back and try once
    // more (they are copied again when their unpack comes), and prefetch no more in this pass (each failed
    // allocation makes a caching allocator free its whole cache). Blocks held until their copies are done go back
    // too (keepalive.h). With none of either, the device is really full.
    const size_t held = side_uses_.size();
    side_uses_.reap();
    dropped = drop_prefetched_locked();
    if (dropped == 0 && side_uses_.size() == held) {
      add_restore_oom_context(e, record.bytes(), 0, prefetch_depth_);
      throw;
    }
    prefetch_paused_ = true;
  }
  try {
    copy_to_device_locked(record);
  } catch (c10::OutOfMemoryError& e) {
    add_restore_oom_context(e, record.bytes(), dropped, prefetch_depth_);
    throw;
  }
}

int64_t OffloadScope::drop_prefetched_locked() {
  int64_t dropped = 0;
  for (const auto& entry : records_.in_pack_order()) {
    auto record = entry.lock();
    if (record && record->restore.prefetched.defined()) {
      // A spill read still copying into the block holds the block itself until it is done (spill.h).
      record->restore.prefetched = at::Tensor();
      record->restore.spill_read = nullptr;
      record->restore.h2d_done = nullptr;
      ++dropped;
    }
  }
  // Dropped blocks whose copies still run are held (keepalive.h): ordered after their copies on the device, they go
  // back to the allocator now, for the restore that needs the room. Consumers' blocks stay: their readers' kernels
  // may not be queued yet.
  side_uses_.release_restores(capturing_device);
  count(stats_, &OffloadStats::prefetch_dropped, dropped);
  return dropped;
}

void OffloadScope::prefetch_locked(const OffloadRecord& record) {
  if ((prefetch_depth_ == 0 && config_.spill_prefetch_depth == 0) || prefetch_paused_) {
    return;
  }
  RECORD_USER_SCOPE("hsoffload::prefetch");
  // Without a spill store there are no spilled records to prefetch.
  const PrefetchDepths depths{prefetch_depth_, spill_ ? config_.spill_prefetch_depth : 0};
  for (const auto& next : records_to_prefetch(records_, record, depths)) {
    try {
      copy_to_device_locked(*next);  // allocates first: an allocation that fails leaves `next` as it was
    } catch (const c10::OutOfMemoryError&) {
      // A prefetch is an optimisation: the step must not fail for it. Give back every block prefetched ahead and
      // restore on demand for the rest of this pass of backward (until release_restores), so from here the device
      // holds what prefetch_depth 0 would. Counted, and logged once by the Python shim.
      count(stats_, &OffloadStats::prefetch_oom, 1);
      drop_prefetched_locked();
      prefetch_paused_ = true;
      break;
    }
  }
}

void OffloadScope::release_restores() {
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> held;  // freed after the lock is let go
  {
    std::lock_guard<std::mutex> lock(*mutex_);
    for (const auto& entry : records_.in_pack_order()) {
      auto record = entry.lock();
      if (!record) continue;
      RestoreState& restore = record->restore;
      if (restore.prefetched.defined()) {
        restore.prefetched = at::Tensor();
        restore.spill_read = nullptr;
        restore.h2d_done = nullptr;
        count(stats_, &OffloadStats::released_restores, 1);
      }
      if (auto storage = restore.round.end_round()) {
        held.push_back(std::move(storage));
        count(stats_, &OffloadStats::released_restores, 1);
      }
      restore.restored_once = false;  // the next backward over a retained graph is a new pass: same-group prefetch
    }
    prefetch_paused_ = false;  // a new pass tries prefetching again
    // The graph task queued all its work: a consumer's use is marked now; dropped prefetches' blocks go too.
    side_uses_.release_restores(capturing_device);
    side_uses_.release_consumers(capturing_device);
  }
}

at::Tensor OffloadScope::restore(const SavedHandle& handle) {
  RECORD_USER_SCOPE("hsoffload::unpack");
  OffloadRecord& record = *handle.record_;
  RestoreState& restore = record.restore;
  TORCH_CHECK(!stream_capturing(record.source.device),
              "offload_unpack: this tensor was offloaded to host memory before the graph capture now running on ",
              record.source.device, "; restoring it would bake a host address into the graph. Capture both the "
              "forward that saves it and its backward (tensors packed during a capture stay on the device), or "
              "run this backward outside the capture.");
  std::unique_lock<std::mutex> lock(*record.mutex);
  side_uses_.reap();
  at::Tensor dev;
  std::shared_ptr<SpillRead> read;  // a spill read this unpack waits for, holding no lock
  if (auto alive = restore.restored.lock()) {
    // Restored earlier and still held (a second unpack of a shared storage), perhaps still being read.
    dev = byte_view(c10::Storage(std::move(alive)), record.source.device, restore.pad, restore.pad + record.bytes());
    read = restore.reading;
  } else {
    const bool hit = restore.prefetched.defined();
    const auto t0 = std::chrono::steady_clock::now();
    if (!hit) {
      restore_now_locked(record);
    }
    dev = std::move(restore.prefetched);
    restore.prefetched = at::Tensor();
    read = std::move(restore.spill_read);
    restore.reading = read;
    restore.restored = dev.storage().getWeakStorageImpl();
    restore.restored_once = true;
    count(stats_, hit ? &OffloadStats::prefetch_hits : &OffloadStats::wait_ns,
          hit ? 1 : std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    count(stats_, &OffloadStats::restored_bytes, record.bytes());
    // Queued before this unpack waits for its own read: a miss must not serialise the reads behind it.
    prefetch_locked(record);
  }
  if (read) {
    // Raises (naming spill_dir) if the write or the read failed; nothing of this restore is kept then. Waits holding
    // no lock: other unpacks, prefetches and packs go on meanwhile.
    lock.unlock();
    const auto w0 = std::chrono::steady_clock::now();
    std::shared_ptr<c10::Event> h2d_done;
    try {
      RECORD_USER_SCOPE("hsoffload::wait_spill_read");
      h2d_done = read->wait();  // (M18) the restored bytes are complete before anyone reads them
    } catch (...) {
      lock.lock();
      if (restore.reading == read) {
        restore.reading = nullptr;
        restore.restored.reset();
      }
      throw;
    }
    lock.lock();
    if (restore.reading == read) {
      restore.reading = nullptr;
      restore.h2d_done = std::move(h2d_done);
    }
    count(stats_, &OffloadStats::spill_read_wait_ns,
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - w0).count());
  }
  // Held for this record's other handles until each has unpacked (UnpackRound); freed here once the round is over.
  const auto ended = restore.round.unpacked(
      handle.round_, c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(dev.storage().unsafeGetStorageImpl()));
  if (restore.h2d_done) {
    const int64_t held = side_uses_.holds();
    consume(dev, *restore.h2d_done, restore.alloc_stream, side_uses_);
    count(stats_, &OffloadStats::side_use_holds, side_uses_.holds() - held);
  }
  count(stats_, &OffloadStats::restored_tensors, 1);
  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(handle.dtype_).device(record.source.device));
  out.set_(dev.storage(), restore.pad / at::elementSize(handle.dtype_) + handle.offset_in_span_, handle.sizes_,
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

SavedHandle::~SavedHandle() {
  if (!record_) {
    return;
  }
  record_->restore.round.drop_handle(round_);  // takes the round's mutex, never the scope's (UnpackRound)
}

at::Tensor SavedHandle::unpack() const {
  check_version();
  if (!record_) {
    return passthrough_;
  }
  return scope_->restore(*this);
}

}  // namespace hsoffload
