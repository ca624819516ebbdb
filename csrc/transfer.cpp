// The transfer protocol (transfer.h): the engine's only use of streams, events, StreamGuard and
// recordDataPtrOnStream. Each rule carries its invariant (docs/design.md, I1-I4) and mutation-check id (Mn).
#include "hsoffload/transfer.h"

#include "hsoffload/events.h"

#include <ATen/ops/empty.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <utility>

namespace hsoffload {

namespace {

// torch >= 2.13 declares DeviceGuardImplInterface::isStreamCapturing (the CUDA guard answers it; other backends
// say false); torch 2.11 has no device-generic query. Detected by signature, not by version number.
template <class Impl, class = void>
struct HasIsStreamCapturing : std::false_type {};
template <class Impl>
struct HasIsStreamCapturing<Impl, std::void_t<decltype(std::declval<const Impl&>().isStreamCapturing(
                                      std::declval<const c10::Stream&>()))>> : std::true_type {};

template <class Impl>
bool ask_capturing(const Impl& impl, const c10::Stream& stream) {
  if constexpr (HasIsStreamCapturing<Impl>::value) {
    return impl.isStreamCapturing(stream);
  } else {
    return false;
  }
}

}  // namespace

bool engine_detects_capture() { return HasIsStreamCapturing<c10::impl::VirtualGuardImpl>::value; }

bool stream_capturing(c10::Device device) {
  if (device.is_cpu()) {
    return false;
  }
  c10::impl::VirtualGuardImpl impl(device.type());
  return ask_capturing(impl, impl.getStream(device));
}

namespace {

// The process's side streams: one pair per device, taken from torch's stream pools once per process. Global because
// a pair per scope would take new streams from torch's shared pools every step (those pools also serve
// torch.cuda.Stream(), DeepSpeed's and users' streams, round-robin, so large copies would queue behind unrelated
// work); guarded by its own mutex, never freed (streams live as long as the process anyway).
struct ProcessStreams {
  std::mutex mutex;
  std::vector<std::pair<c10::Device, std::array<c10::Stream, 2>>> pairs;  // [kToHost, kToDevice]
};
ProcessStreams& process_streams() {
  static ProcessStreams* streams = new ProcessStreams();  // intentionally leaked: used until the process ends
  return *streams;
}

}  // namespace

c10::Stream side_stream(c10::Device device, Direction direction) {
  const size_t which = direction == Direction::kToHost ? 0 : 1;
  ProcessStreams& streams = process_streams();
  std::lock_guard<std::mutex> lock(streams.mutex);
  for (const auto& entry : streams.pairs) {
    if (entry.first == device) {
      return entry.second[which];
    }
  }
  c10::impl::VirtualGuardImpl impl(device.type());
  // Copies to host at normal priority (they overlap forward compute); restores at high priority: backward waits for
  // them, so they go ahead of queued low-priority work.
  streams.pairs.emplace_back(device, std::array<c10::Stream, 2>{
                                         impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false),
                                         impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true)});
  return streams.pairs.back().second[which];
}

c10::Stream SideStreams::for_copy(c10::Device device, Direction direction, c10::Stream compute) {
  return enabled_ ? side_stream(device, direction) : compute;
}

at::Tensor byte_view(const c10::Storage& storage, c10::Device device, int64_t begin, int64_t end) {
  at::Tensor bytes = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device));
  bytes.set_(storage, begin, {end - begin}, {1});
  return bytes;
}

void copy_extents(Direction direction, const at::Tensor& device_bytes, const HostBlock& host, bool non_blocking) {
  int64_t offset = 0;
  for (const at::Tensor& extent : host.extents()) {
    at::Tensor device_part = device_bytes.narrow(0, offset, extent.numel());
    if (direction == Direction::kToHost) {
      extent.copy_(device_part, non_blocking);
    } else {
      device_part.copy_(extent, non_blocking);
    }
    offset += extent.numel();
  }
}

HostBlock acquire_host_block(HostPool& pool, int64_t bytes, c10::Device device, bool pin_memory) {
  return pool.acquire(bytes, /*pinned=*/!device.is_cpu() && pin_memory);
}

std::shared_ptr<c10::Event> copy_to_host(const at::Tensor& src, HostBlock& host, SideStreams& streams,
                                         KeepAlive& uses) {
  if (src.is_cpu()) {
    copy_extents(Direction::kToHost, src, host, /*non_blocking=*/false);
    return nullptr;
  }
  uses.reserve_hold();  // before the copy is queued: the hold after it cannot fail
  c10::impl::VirtualGuardImpl impl(src.device().type());
  const c10::Stream compute = impl.getStream(src.device());  // current at pack time, never cached
  const c10::Stream copy_stream = streams.for_copy(src.device(), Direction::kToHost, compute);
  if (copy_stream != compute) {
    c10::Event produced(src.device().type());
    produced.record(compute);
    produced.block(copy_stream);  // I1 (M1): the copy reads the bytes only after the compute stream wrote them
  }
  {
    c10::StreamGuard guard(copy_stream);
    copy_extents(Direction::kToHost, src, host, /*non_blocking=*/host.pinned());  // I4 (M12): no host sync
  }
  auto d2h_done = std::make_shared<c10::Event>(src.device().type());
  d2h_done->record(copy_stream);
  host.record_use(d2h_done);  // I2 (M3): the pool lends the block again only after the copy wrote it
  // Memory the device's caching allocator does not own (DLPack, from_blob, a graph pool's raw pointer) is not
  // ordered by streams at all: held until the copy has read it, even when the copy runs on the compute stream.
  const bool owned = src.storage().allocator() == c10::GetAllocator(src.device().type());
  if (copy_stream != compute || !owned) {
    // I1 (M2): the device block must not be reused before the copy has read it: held (never tagged in the
    // allocator: keepalive.h) until d2h_done completes.
    uses.hold_source(src.storage(), d2h_done);
  }
  return d2h_done;
}

DeviceSpan allocate_device_span(c10::Device device, int64_t bytes, int64_t align) {
  // Allocated while the compute stream is current, so the block belongs to its pool. The restored span starts at
  // the same address modulo kSpanAlignment as the original did, so kernels see the same data-pointer alignment
  // and take the same code paths (bit-identical results). Allocators that hand out kSpanAlignment-aligned blocks
  // (CUDA's) get exactly `bytes`; others (the CPU's 64-byte alignment) a little more.
  const auto options = at::TensorOptions().dtype(at::kByte).device(device);
  const auto misalignment = [&](const at::Tensor& b) {
    const auto at = static_cast<int64_t>(reinterpret_cast<uintptr_t>(b.data_ptr()) % kSpanAlignment);
    return (align - at + kSpanAlignment) % kSpanAlignment;
  };
  DeviceSpan span;
  span.block = at::empty({bytes}, options);
  span.pad = misalignment(span.block);
  if (span.pad != 0) {
    span.block = at::empty({bytes + kSpanAlignment}, options);
    span.pad = misalignment(span.block);
  }
  span.bytes = span.block.narrow(0, span.pad, bytes);
  return span;
}

RestoreOrder copy_to_device(const at::Tensor& dev, HostBlock& host, const std::shared_ptr<c10::Event>& d2h_done,
                            SideStreams& streams, KeepAlive& uses) {
  RestoreOrder order;
  if (dev.is_cpu()) {
    copy_extents(Direction::kToDevice, dev, host, /*non_blocking=*/false);
    return order;
  }
  uses.reserve_hold();  // before the copy is queued: the hold after it cannot fail
  c10::impl::VirtualGuardImpl impl(dev.device().type());
  const c10::Stream compute = impl.getStream(dev.device());
  order.alloc_stream = compute;
  const c10::Stream copy_stream = streams.for_copy(dev.device(), Direction::kToDevice, compute);
  if (copy_stream != compute) {
    c10::Event allocated(dev.device().type());
    allocated.record(compute);
    allocated.block(copy_stream);  // I1 (M4): the block's previous users on the compute stream are done
  }
  if (d2h_done) {
    d2h_done->block(copy_stream);  // I2 (M5): host bytes are complete before we read them
  }
  {
    c10::StreamGuard guard(copy_stream);
    copy_extents(Direction::kToDevice, dev, host, /*non_blocking=*/host.pinned());  // I4 (M13): no host sync
  }
  order.done = std::make_shared<c10::Event>(dev.device().type());
  order.done->record(copy_stream);
  host.record_use(order.done);  // I2 (M7): the pool lends the block again only after the copy read it
  if (copy_stream != compute) {
    uses.hold_restore(dev.storage(), order.done, compute);  // I1 (M6, M25): the copy writes it on H; held, never tagged
  }
  return order;
}

void consume(const at::Tensor& dev, const c10::Event& done, const std::optional<c10::Stream>& alloc_stream,
             KeepAlive& uses) {
  // Every consumer waits for the copy on its own current stream (device-side wait, no host sync); a consumer on
  // another stream than the one that allocated the block keeps it held until its graph task has queued its work.
  c10::impl::VirtualGuardImpl impl(dev.device().type());
  const c10::Stream consumer = impl.getStream(dev.device());
  done.block(consumer);  // I3 (M8): the consumer reads the restored bytes only after the copy wrote them
  if (alloc_stream && *alloc_stream != consumer) {
    uses.hold_consumer(dev.storage(), consumer, *alloc_stream);  // I1 (M9): a foreign consumer's use
  }
}

SpillOrder spill_write_order(const at::Tensor& src, SideStreams& streams) {
  // The I/O thread holds the device bytes until it has copied them to staging, so no allocator bookkeeping is
  // needed; it waits for `ready` on the copy stream before reading them (stage_to_host).
  SpillOrder order;
  if (src.is_cpu()) {
    return order;
  }
  c10::impl::VirtualGuardImpl impl(src.device().type());
  const c10::Stream compute = impl.getStream(src.device());
  order.copy_stream = streams.for_copy(src.device(), Direction::kToHost, compute);
  order.ready = std::make_shared<c10::Event>(src.device().type());
  order.ready->record(compute);
  return order;
}

SpillOrder spill_read_order(const at::Tensor& dst, SideStreams& streams) {
  // The I/O thread copies into `dst` on the copy stream once the allocation point has passed (stage_to_device);
  // unpack waits for the read and then for its event (consume).
  SpillOrder order;
  if (dst.is_cpu()) {
    return order;
  }
  c10::impl::VirtualGuardImpl impl(dst.device().type());
  const c10::Stream compute = impl.getStream(dst.device());
  order.alloc_stream = compute;
  order.ready = std::make_shared<c10::Event>(dst.device().type());
  order.ready->record(compute);
  order.copy_stream = streams.for_copy(dst.device(), Direction::kToDevice, compute);
  return order;
}

void wait_host_copy(const c10::Event* d2h_done) {
  const bool host_copy_done = !d2h_done || wait_event(*d2h_done);  // I2 (M20): the host block holds the bytes before the file write reads it
  TORCH_CHECK(host_copy_done, "hsoffload: spill write: the device failed while copying the tensor to host memory "
              "(its event query raised); nothing was written");
}

void stage_to_host(const at::Tensor& staging, const at::Tensor& src, const std::optional<c10::Stream>& stream,
                   const c10::Event* produced) {
  if (src.is_cpu()) {
    std::memcpy(staging.data_ptr(), src.data_ptr(), static_cast<size_t>(src.numel()));
    return;
  }
  TORCH_INTERNAL_ASSERT(stream.has_value());
  c10::StreamGuard guard(*stream);
  if (produced) produced->block(*stream);  // I1 (M14): src is complete on its stream
  staging.copy_(src, /*non_blocking=*/true);
  c10::Event copied(src.device().type());
  copied.record(*stream);
  const bool staged = wait_event(copied);  // I2 (M15): this I/O thread's wait before pwrite, not the compute stream's (I4)
  TORCH_CHECK(staged, "hsoffload: spill write: the device failed while copying to the staging buffer (its event query raised)");
}

std::shared_ptr<c10::Event> stage_to_device(const at::Tensor& dst, const at::Tensor& staging,
                                            const std::optional<c10::Stream>& stream, const c10::Event* allocated) {
  if (dst.is_cpu()) {
    std::memcpy(dst.data_ptr(), staging.data_ptr(), static_cast<size_t>(dst.numel()));
    return nullptr;
  }
  TORCH_INTERNAL_ASSERT(stream.has_value());
  c10::StreamGuard guard(*stream);
  if (allocated) allocated->block(*stream);  // I1 (M16): dst's block is ours from this point
  dst.copy_(staging, /*non_blocking=*/true);
  auto done = std::make_shared<c10::Event>(dst.device().type());
  done->record(*stream);
  const bool copied_back = wait_event(*done);  // I2 (M17): the staging chunk is reused by the next transfer only after this copy
  TORCH_CHECK(copied_back, "hsoffload: spill read: the device failed while copying from the staging buffer (its event query raised)");
  return done;
}

}  // namespace hsoffload
