// hsemu backend: binds the emulated accelerator (emu_runtime.h) to PyTorch's
// PrivateUse1 extension points, for tests only.
//
// - DeviceGuardImpl: one device, per-thread current stream, pool and new
//   streams, events with their real meaning, recordDataPtrOnStream.
// - PrivateUse1 hooks: pinned host memory (pin_memory(), is_pinned()).
// - Kernels: empty / empty_strided (the stream-aware allocator), _copy_from
//   (queued on the current stream; non_blocking with pinned host memory returns
//   before the copy ran; device to device is always queued), views, set_,
//   resize_, record_stream.
// - Every other op: a boxed fallback that waits until the current stream's
//   queued work has run, then runs the CPU kernel on the calling thread on
//   host aliases of the device memory (no copies). Compute therefore waits for
//   exactly what it was told to wait for, as on a GPU.
// - `torch.ops.hsemu.*`: control ops for tests (delays, stall a stream, switch
//   streams, synchronize, counters).
//
// The hsoffload engine never sees this file: to it this is one more device type.
#include "emu_runtime.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

namespace hsemu {
namespace {

constexpr c10::DeviceType kEmu = c10::DeviceType::PrivateUse1;

c10::Stream stream_of(c10::StreamId id) { return c10::Stream(c10::Stream::UNSAFE, c10::Device(kEmu, 0), id); }

void check_device(c10::Device d) {
  TORCH_CHECK(d.type() == kEmu && (!d.has_index() || d.index() == 0), "hsemu: there is one emulated device (index 0), got ",
              d);
}

// ---- device guard -----------------------------------------------------------------

struct EmuGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kEmu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    check_device(d);
    return c10::Device(kEmu, 0);
  }
  c10::Device getDevice() const override { return c10::Device(kEmu, 0); }
  void setDevice(c10::Device d) const override { check_device(d); }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const override { return stream_of(current_stream()); }
  c10::Stream getDefaultStream(c10::Device) const override { return stream_of(0); }
  c10::Stream getStreamFromGlobalPool(c10::Device, bool high_priority) const override {
    return stream_of(next_pool_stream(high_priority));
  }
  c10::Stream getNewStream(c10::Device, int) const override { return stream_of(new_stream()); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const c10::StreamId old = current_stream();
    set_current_stream(s.id());
    return stream_of(old);
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }

  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    std::unique_ptr<Event> owned(static_cast<Event*>(event));  // created in record()
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) {
      *event = std::make_unique<Event>().release();  // owned by the c10::Event; freed in destroyEvent
    }
    auto* e = static_cast<Event*>(*event);
    e->stream = stream.id();
    e->ticket = enqueued(stream.id());
    e->captured = is_capturing(stream.id());
  }
  void block(void* event, const c10::Stream& stream) const override {
    const auto* e = static_cast<const Event*>(event);
    if (e == nullptr || e->stream < 0 || e->stream == stream.id()) {
      return;  // never recorded, or the same stream (already in order)
    }
    capture_wait(*e, stream.id());
    const c10::StreamId src = e->stream;
    const uint64_t ticket = e->ticket;
    enqueue(stream.id(), [src, ticket] { wait(src, ticket); });
    count(&Counters::cross_stream_waits);
  }
  bool queryEvent(void* event) const override {
    TORCH_CHECK(!event_fault(), "hsemu: device-side assert triggered (emulated sticky error, set_event_fault)");
    const auto* e = static_cast<const Event*>(event);
    if (e != nullptr && e->captured && any_capturing()) {
      capture_violation("query of a captured event");
    }
    return e == nullptr || e->stream < 0 || done(e->stream, e->ticket);
  }
  void synchronizeEvent(void* event) const override {
    TORCH_CHECK(!event_fault(), "hsemu: device-side assert triggered (emulated sticky error, set_event_fault)");
    const auto* e = static_cast<const Event*>(event);
    if (e != nullptr && e->captured && any_capturing()) {
      capture_violation("synchronize on a captured event");
    }
    count(&Counters::host_syncs);
    if (e != nullptr && e->stream >= 0) {
      wait(e->stream, e->ticket);
    }
  }
  bool queryStream(const c10::Stream& s) const override { return done(s.id(), enqueued(s.id())); }
  // Declared by torch >= 2.13's DeviceGuardImplInterface (no `override`: torch 2.11's has no such method).
  bool isStreamCapturing(const c10::Stream& s) const { return is_capturing(s.id()); }
  void synchronizeStream(const c10::Stream& s) const override {
    if (any_capturing()) {
      capture_violation("stream synchronize during a capture");
    }
    count(&Counters::host_syncs);
    drain(s.id());
  }
  void synchronizeDevice(const c10::DeviceIndex) const override {
    if (any_capturing()) {
      capture_violation("device synchronize during a capture");
    }
    count(&Counters::host_syncs);
    drain_all();
  }
  void recordDataPtrOnStream(const c10::DataPtr& data, const c10::Stream& stream) const override {
    if (data.get() != nullptr && data.device().type() == kEmu) {
      record_stream(data.get(), stream.id());
    }
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, EmuGuardImpl);

// ---- storage resize (resize_, storage().resize_) ---------------------------------------

void resize_storage(const c10::Storage& storage, size_t nbytes) {
  drain(current_stream());  // queued copies into the old bytes land before they are moved
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  TORCH_CHECK(impl->resizable(), "hsemu: trying to resize a storage that is not resizable");
  at::DataPtr fresh = device_allocator()->allocate(nbytes);
  const size_t keep = std::min(nbytes, impl->nbytes());
  if (keep > 0) {
    std::memcpy(fresh.get(), impl->data_ptr().get(), keep);
  }
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(nbytes);
}

// ---- hooks (pinned memory) ------------------------------------------------------------

struct EmuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();  // compute runs on CPU kernels
  }
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kEmu, 0); }
  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage(storage, newsize);
  }
};

EmuHooks& hooks() {
  static EmuHooks h;
  return h;
}

struct Registrar {
  Registrar() {
    c10::SetAllocator(kEmu, device_allocator());
    at::RegisterPrivateUse1HooksInterface(&hooks());
  }
};
const Registrar registrar;  // registers at library load, like the guard above

// ---- host views of device memory ------------------------------------------------------

// What a queued copy needs to find its bytes later. Holds no reference to the
// storage on purpose: a real queued copy does not keep its tensors alive
// either, which is what record_stream is for.
struct Geometry {
  void* data = nullptr;  // first element
  at::ScalarType dtype = at::kByte;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  bool conj = false;
  bool neg = false;
};

Geometry geometry_of(const at::Tensor& t) {
  return Geometry{const_cast<void*>(t.const_data_ptr()), t.scalar_type(), t.sizes().vec(), t.strides().vec(),
                  t.is_conj(), t.is_neg()};
}

at::Tensor host_view(const Geometry& g) {
  at::Tensor t = at::from_blob(g.data, g.sizes, g.strides, at::TensorOptions().dtype(g.dtype).device(at::kCPU));
  t._set_conj(g.conj);
  t._set_neg(g.neg);
  return t;
}

// A CPU tensor over the same bytes as device tensor `t` (same storage offset,
// sizes, strides, conj/neg bits). Its storage is resizable: an out= kernel that
// resizes it gets new host memory, which the fallback then moves to the device.
at::Tensor host_alias(const at::Tensor& t) {
  const c10::Storage& st = t.storage();
  c10::Storage alias(c10::Storage::use_byte_size_t(), st.nbytes(), at::DataPtr(st.data_ptr().get(), c10::Device(at::kCPU)),
                     c10::GetAllocator(at::kCPU), /*resizable=*/true);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(std::move(alias), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                            t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  out._set_conj(t.is_conj());
  out._set_neg(t.is_neg());
  return out;
}

// ---- kernels -------------------------------------------------------------------------

at::Tensor emu_empty(at::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                     std::optional<at::Device> device, std::optional<bool> pin_memory,
                     std::optional<at::MemoryFormat> memory_format) {
  if (device) {
    check_device(*device);
  }
  TORCH_CHECK(!pin_memory.value_or(false), "hsemu: only CPU tensors can be pinned");
  return at::detail::empty_generic(size, device_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   dtype.value_or(at::get_default_dtype_as_scalartype()), memory_format);
}

at::Tensor emu_empty_strided(at::IntArrayRef size, at::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                             std::optional<at::Layout> layout, std::optional<at::Device> device,
                             std::optional<bool> pin_memory) {
  if (device) {
    check_device(*device);
  }
  return at::detail::empty_strided_generic(size, stride, device_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           dtype.value_or(at::get_default_dtype_as_scalartype()));
}

// Copies between the emulated device and the host, and within the device, are
// queued on the current stream. The caller waits unless the copy is device to
// device, or non_blocking with pinned host memory (as with CUDA).
at::Tensor emu_copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const bool src_dev = self.device().type() == kEmu;
  const bool dst_dev = dst.device().type() == kEmu;
  TORCH_CHECK(src_dev || dst_dev, "hsemu: _copy_from without an emulated-device tensor");
  TORCH_CHECK((src_dev || self.is_cpu()) && (dst_dev || dst.is_cpu()),
              "hsemu: copies are supported between the emulated device and the CPU only, got ", self.device(), " -> ",
              dst.device());
  if (dst.numel() == 0) {
    return dst;
  }
  const CopyKind kind = src_dev && dst_dev ? CopyKind::kDeviceToDevice
                        : src_dev           ? CopyKind::kDeviceToHost
                                            : CopyKind::kHostToDevice;
  const at::Tensor& host = src_dev ? dst : self;
  const void* host_base = kind == CopyKind::kDeviceToDevice ? nullptr : host.storage().data_ptr().get();
  const bool pinned = host_base != nullptr && is_pinned(host_base);
  const bool async = kind == CopyKind::kDeviceToDevice || (non_blocking && pinned);
  const c10::StreamId stream = current_stream();
  const int64_t delay = copy_sleep_us(kind, static_cast<int64_t>(dst.nbytes()));
  Geometry src = geometry_of(self);
  Geometry out = geometry_of(dst);
  const uint64_t ticket = enqueue(stream, [src = std::move(src), out = std::move(out), delay] {
    if (delay > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(delay));
    }
    host_view(out).copy_(host_view(src));
  });
  if (pinned) {
    record_pinned_use(host_base, stream, ticket);
  }
  if (async) {
    count(&Counters::async_copies);
  } else {
    wait(stream, ticket);
    count(&Counters::sync_copies);
  }
  return dst;
}

at::Tensor emu_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return emu_copy_from(self, dst, false);
}

std::vector<int64_t> contiguous_strides(at::IntArrayRef size) {
  std::vector<int64_t> strides(size.size());
  int64_t s = 1;
  for (size_t i = size.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<int64_t>(size[i], 1);
  }
  return strides;
}

at::Tensor& emu_set_storage(at::Tensor& self, at::Storage source, int64_t storage_offset, at::IntArrayRef size,
                            at::IntArrayRef stride) {
  TORCH_CHECK(source.device().type() == kEmu, "hsemu: set_ expects a storage on the emulated device, got ",
              source.device());
  const std::vector<int64_t> strides = stride.empty() ? contiguous_strides(size) : stride.vec();
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_sizes_and_strides(size, strides, storage_offset);
  return self;
}

at::Tensor& emu_set_storage_whole(at::Tensor& self, at::Storage source) {
  const int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return emu_set_storage(self, std::move(source), 0, {numel}, {});
}

at::Tensor& emu_set_tensor(at::Tensor& self, const at::Tensor& source) {
  return emu_set_storage(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
}

const at::Tensor& emu_resize_(const at::Tensor& self, at::IntArrayRef size, std::optional<at::MemoryFormat> format) {
  int64_t numel = 1;
  for (int64_t s : size) {
    TORCH_CHECK_VALUE(s >= 0, "hsemu: resize_ to a negative size ", size);
    numel *= s;
  }
  const size_t needed = static_cast<size_t>((self.storage_offset() + numel) * self.dtype().itemsize());
  if (numel > 0 && self.storage().nbytes() < needed) {
    resize_storage(self.storage(), needed);
  }
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (format && *format != at::MemoryFormat::Preserve) {
    impl->empty_tensor_restride(*format);
  }
  return self;
}

void emu_record_stream(at::Tensor& self, c10::Stream s) {
  TORCH_CHECK(s.device_type() == kEmu, "hsemu: record_stream expects a stream of the emulated device, got ", s);
  record_stream(self.storage().data_ptr().get(), s.id());
}

// ---- compute fallback -----------------------------------------------------------------

struct Aliased {
  at::Tensor device;
  at::Tensor host;
};

at::Tensor to_host(const at::Tensor& t, std::vector<Aliased>& aliased) {
  if (!t.defined() || t.device().type() != kEmu) {
    return t;
  }
  at::Tensor h = host_alias(t);
  aliased.push_back({t, h});
  return h;
}

// A device tensor for a CPU result: the device tensor it aliases, a device view
// of the storage it is a view of, or a new device tensor holding its values.
at::Tensor to_device(const at::Tensor& t, const std::vector<Aliased>& aliased) {
  if (!t.defined() || !t.is_cpu()) {
    return t;
  }
  for (const auto& a : aliased) {
    if (t.unsafeGetTensorImpl() == a.host.unsafeGetTensorImpl()) {
      return a.device;
    }
  }
  for (const auto& a : aliased) {
    if (t.storage().unsafeGetStorageImpl() == a.host.storage().unsafeGetStorageImpl() &&
        t.storage().data_ptr().get() == a.device.storage().data_ptr().get()) {
      at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(
          c10::Storage(a.device.storage()), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), t.dtype());
      view.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
      view._set_conj(t.is_conj());
      view._set_neg(t.is_neg());
      return view;
    }
  }
  const auto options = t.options().device(c10::Device(kEmu, 0));
  at::Tensor out = t.is_non_overlapping_and_dense() ? at::empty_strided(t.sizes(), t.strides(), options)
                                                    : at::empty(t.sizes(), options);
  drain(current_stream());  // the block's pending poison job (queued at its free) runs first
  host_alias(out).copy_(t);
  return out;
}

// A written argument whose host alias was resized or restrided by the kernel
// (out= arguments): give the device tensor the same geometry and bytes.
void write_back(const Aliased& a) {
  const at::Tensor& h = a.host;
  const at::Tensor& d = a.device;
  c10::TensorImpl* impl = d.unsafeGetTensorImpl();
  if (h.storage().data_ptr().get() != d.storage().data_ptr().get()) {
    const size_t nbytes = h.storage().nbytes();
    at::DataPtr fresh = device_allocator()->allocate(nbytes);
    if (nbytes > 0) {
      std::memcpy(fresh.get(), h.storage().data_ptr().get(), nbytes);
    }
    c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(fresh), device_allocator(), true);
    impl->set_storage_keep_dtype(std::move(storage));
  }
  if (h.sizes() != d.sizes() || h.strides() != d.strides() || h.storage_offset() != d.storage_offset()) {
    impl->set_sizes_and_strides(h.sizes(), h.strides(), h.storage_offset());
  }
}

void compute_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  drain(current_stream());  // compute waits for the current stream's queued work, nothing else
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t first = stack->size() - num_args;
  std::vector<Aliased> aliased;
  std::vector<size_t> written;  // indices into `aliased` of arguments the kernel may write
  for (size_t i = 0; i < num_args; ++i) {
    c10::IValue& v = (*stack)[first + i];
    const auto* alias_info = schema.arguments()[i].alias_info();
    const bool writes = alias_info != nullptr && alias_info->isWrite();
    if (v.isTensor()) {
      const size_t before = aliased.size();
      v = to_host(v.toTensor(), aliased);
      if (writes && aliased.size() > before) {
        written.push_back(before);
      }
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList()) {
        const size_t before = aliased.size();
        list.push_back(to_host(t, aliased));
        if (writes && aliased.size() > before) {
          written.push_back(before);
        }
      }
      v = list;
    } else if (v.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> list;
      for (const std::optional<at::Tensor>& t : v.toOptionalTensorList()) {
        list.push_back(t ? std::optional<at::Tensor>(to_host(*t, aliased)) : std::nullopt);
      }
      v = list;
    } else if (v.isDevice() && v.toDevice().type() == kEmu) {
      v = c10::Device(at::kCPU);  // factory functions: build on the host, moved below
    }
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  for (size_t i : written) {
    write_back(aliased[i]);
  }
  const size_t num_returns = schema.returns().size();
  for (size_t i = stack->size() - num_returns; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (v.isTensor()) {
      v = to_device(v.toTensor(), aliased);
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList()) {
        list.push_back(to_device(t, aliased));
      }
      v = list;
    }
  }
}

// ---- control ops (torch.ops.hsemu.*) ----------------------------------------------------

void op_set_copy_delay(int64_t h2d_us, int64_t d2h_us, int64_t d2d_us) {
  set_copy_delay_us(CopyKind::kHostToDevice, h2d_us);
  set_copy_delay_us(CopyKind::kDeviceToHost, d2h_us);
  set_copy_delay_us(CopyKind::kDeviceToDevice, d2d_us);
}

void op_set_copy_rate(int64_t h2d, int64_t d2h, int64_t d2d) {
  set_copy_rate_bytes_per_s(CopyKind::kHostToDevice, h2d);
  set_copy_rate_bytes_per_s(CopyKind::kDeviceToHost, d2h);
  set_copy_rate_bytes_per_s(CopyKind::kDeviceToDevice, d2d);
}

std::vector<int64_t> op_copy_rate() {
  return {copy_rate_bytes_per_s(CopyKind::kHostToDevice), copy_rate_bytes_per_s(CopyKind::kDeviceToHost),
          copy_rate_bytes_per_s(CopyKind::kDeviceToDevice)};
}

std::vector<int64_t> op_copy_delay() {
  return {copy_delay_us(CopyKind::kHostToDevice), copy_delay_us(CopyKind::kDeviceToHost),
          copy_delay_us(CopyKind::kDeviceToDevice)};
}

void op_sleep(int64_t us) {
  TORCH_CHECK_VALUE(us >= 0, "hsemu.sleep: us must be >= 0, got ", us);
  enqueue(current_stream(), [us] { std::this_thread::sleep_for(std::chrono::microseconds(us)); });
}

std::vector<int64_t> op_stats() {
  const Counters c = counters();
  return {c.async_copies,  c.sync_copies,    c.cross_stream_waits,    c.device_allocs, c.device_reuses,
          c.deferred_frees, c.pinned_deferred_frees, c.host_syncs, c.job_errors, c.allocated_bytes,
          c.peak_allocated_bytes};
}

}  // namespace
}  // namespace hsemu

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(hsemu::emu_empty));
  m.impl("empty_strided", TORCH_FN(hsemu::emu_empty_strided));
  m.impl("_copy_from", TORCH_FN(hsemu::emu_copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(hsemu::emu_copy_from_and_resize));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(hsemu::emu_set_storage));
  m.impl("set_.source_Storage", TORCH_FN(hsemu::emu_set_storage_whole));
  m.impl("set_.source_Tensor", TORCH_FN(hsemu::emu_set_tensor));
  m.impl("resize_", TORCH_FN(hsemu::emu_resize_));
  m.impl("record_stream", TORCH_FN(hsemu::emu_record_stream));
  // Note on silu_backward / mish_backward: they are the only aten ops with both a CPU kernel and a
  // CompositeImplicitAutograd decomposition, which a backend without a kernel of its own gets (SiLU's backward
  // then holds six tokens x intermediate temporaries at once). CUDA and CPU run one fused kernel: routing them to
  // the CPU kernel keeps this device's allocations those of a GPU (tests/device/emu/test_device_peak.py measures them).
  m.impl("silu_backward", torch::CppFunction::makeFromBoxedFunction<&hsemu::compute_fallback>());
  m.impl("mish_backward", torch::CppFunction::makeFromBoxedFunction<&hsemu::compute_fallback>());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&hsemu::compute_fallback>());
}

// Control ops for tests. Names are API for tests/device/emu: keep them in step with tests/device/emu/hsemu.py.
TORCH_LIBRARY(hsemu, m) {
  // Microseconds each queued copy of that kind sleeps before it runs (widens race windows).
  m.def("set_copy_delay(int h2d_us, int d2h_us, int d2d_us) -> ()", &hsemu::op_set_copy_delay);
  // The three delays, in that order.
  m.def("copy_delay() -> int[]", &hsemu::op_copy_delay);
  // Bytes per second each queued copy of that kind moves (0: unlimited): a copy of n bytes sleeps its delay plus
  // n / rate, so copy time is proportional to bytes (the step-time model's bandwidth knob).
  m.def("set_copy_rate(int h2d_bytes_per_s, int d2h_bytes_per_s, int d2d_bytes_per_s) -> ()", &hsemu::op_set_copy_rate);
  // The three rates, in that order.
  m.def("copy_rate() -> int[]", &hsemu::op_copy_rate);
  // Queues a sleep on the current stream: the stream lags the host (like torch.cuda._sleep).
  m.def("sleep(int us) -> ()", &hsemu::op_sleep);
  // The calling thread's current stream id, and switching it.
  m.def("current_stream() -> int", [] { return static_cast<int64_t>(hsemu::current_stream()); });
  m.def("set_stream(int id) -> ()", [](int64_t id) { hsemu::set_current_stream(id); });
  // A stream that no one else uses.
  m.def("new_stream() -> int", [] { return static_cast<int64_t>(hsemu::new_stream()); });
  // Waits until every stream is idle.
  // Drains every stream; raises afterwards while a sticky error is emulated, as cudaDeviceSynchronize does.
  m.def("synchronize() -> ()", [] {
    hsemu::drain_all();
    TORCH_CHECK(!hsemu::event_fault(), "hsemu: device-side assert triggered (emulated sticky error, set_event_fault)");
  });
  // async_copies, sync_copies, cross_stream_waits, device_allocs, device_reuses, deferred_frees,
  // pinned_deferred_frees, host_syncs, job_errors (cumulative); allocated_bytes, peak_allocated_bytes (gauges).
  m.def("stats() -> int[]", &hsemu::op_stats);
  // Sets peak_allocated_bytes to the current allocated_bytes.
  m.def("reset_peak() -> ()", [] { hsemu::reset_peak_allocated(); });
  // Frees idle pinned blocks whose copies have completed.
  m.def("empty_pinned_cache() -> ()", [] { hsemu::empty_pinned_cache(); });
  // Emulated graph capture of the current stream (emu_runtime.h): begin, whether a stream captures, and end, which
  // returns what CUDA would have refused during it (empty: the capture succeeded).
  m.def("begin_capture() -> ()", [] { hsemu::begin_capture(hsemu::current_stream()); });
  m.def("is_current_stream_capturing() -> bool", [] { return hsemu::is_capturing(hsemu::current_stream()); });
  m.def("end_capture() -> str[]", [] { return hsemu::end_capture(hsemu::current_stream()); });
  // Faults (emu_runtime.h): every event query/synchronize raises while set (a sticky device error); the device
  // allocator's capacity in bytes (0: unlimited; beyond it allocations raise OutOfMemoryError).
  m.def("set_event_fault(bool on) -> ()", [](bool on) { hsemu::set_event_fault(on); });
  m.def("set_device_capacity(int bytes) -> ()", [](int64_t bytes) { hsemu::set_device_capacity(bytes); });
  m.def("device_capacity() -> int", [] { return hsemu::device_capacity(); });
  // While set, every pinned host allocation raises.
  m.def("set_pinned_alloc_fault(bool on) -> ()", [](bool on) { hsemu::set_pinned_alloc_fault(on); });
  // Jobs queued on stream `id` so far (copies, waits, poison fills): which streams a piece of work used.
  m.def("enqueued(int id) -> int", [](int64_t id) { return static_cast<int64_t>(hsemu::enqueued(id)); });
  // True if `id` is a high-priority pool stream.
  m.def("is_high_priority(int id) -> bool", [](int64_t id) { return hsemu::is_high_priority(id); });
}
