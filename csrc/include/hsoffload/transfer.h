// The transfer protocol: every copy between a device and host memory (a host block, or a spill store's staging
// chunk), and the only code of the engine that records events or orders streams (StreamGuard, Event::block); the
// event queries of destructors and I/O threads are in events.h, and blocks a side stream uses are held in a KeepAlive
// (keepalive.h), never tagged in the allocator.
//
// Three steps, each with the rules of docs/design.md ("Stream and event protocol", invariants I1-I4) tagged on the
// line that enforces them (and the mutation-check id, Mn, that proves a test fails without it):
//   copy_to_host    device -> host, at pack          (e_prod, side-stream use, d2h_done)
//   copy_to_device  host -> device, at restore/prefetch (e_alloc, d2h_done, side-stream use, h2d_done)
//   consume         at unpack: the consumer's stream waits h2d_done; a foreign consumer's block is held
// The spill tier takes its stream order from `spill_write_order` / `spill_read_order` at pack/restore, and its I/O
// threads copy through `stage_to_host` / `stage_to_device`, or wait for a pack's host copy (`wait_host_copy`) before
// writing a host block to a file. "The compute stream" is always the stream current on
// the tensor's device at the time of the call, never a cached one. CPU tensors take the synchronous path: no events.
//
// Graph capture (CUDA graphs): none of the entry points below may run while the current stream is capturing (they
// fork side streams, record and query events, allocate pinned memory). The scope asks `stream_capturing` before
// it starts a transfer and passes the tensor through instead (docs/design.md, "Graph capture").
// Pinned memory: `acquire_host_block` only lends; the scope makes room in the pool (HostPool::reserve) before it
// takes its lock, so no pinned allocation happens under a lock in the common case (docs/design.md).
//
// Thread-safety: the free functions hold no state (they touch only their arguments, which the caller owns or
// guards). SideStreams and side_stream are thread-safe.
#pragma once

#include "hsoffload/host_pool.h"
#include "hsoffload/keepalive.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace hsoffload {

enum class Direction { kToHost, kToDevice };

// Spans start at this boundary of their storage, and restored spans keep every address modulo it: the CUDA caching
// allocator's block alignment (kernels choose code paths by data-pointer alignment).
constexpr int64_t kSpanAlignment = 512;

// The side stream copies in `direction` on `device` run on: one pair per device per process (docs/design.md, "Stream
// ownership"), taken once from torch's pools -- copies to host at normal priority, restores at high priority --
// and the same for every scope, step and thread. Thread-safe.
c10::Stream side_stream(c10::Device device, Direction direction);

// Which stream a scope's copies run on.
class SideStreams {
 public:
  // `enabled` false: every copy runs on the compute stream (OffloadConfig::use_streams).
  explicit SideStreams(bool enabled) : enabled_(enabled) {}
  // The process's side stream (side_stream), or `compute` when disabled.
  c10::Stream for_copy(c10::Device device, Direction direction, c10::Stream compute);

 private:
  bool enabled_;
};

// True if the stream current on `device` is capturing a graph (CUDA graphs, torch.compile "reduce-overhead").
// Device-generic: asks torch's device guard (`DeviceGuardImplInterface::isStreamCapturing`, torch >= 2.13). False
// for CPU devices, and always false where the running torch's headers lack the query (torch 2.11-2.12): there the
// Python shim asks `torch.<accelerator>.is_current_stream_capturing()` and passes pack a flag
// (`engine_detects_capture()` tells it which).
bool stream_capturing(c10::Device device);
// True if this build can tell capture on its own (`stream_capturing` is not constantly false).
bool engine_detects_capture();

// A uint8 tensor aliasing bytes [begin, end) of `storage` on `device`.
at::Tensor byte_view(const c10::Storage& storage, c10::Device device, int64_t begin, int64_t end);

// Copies between `device_bytes` (a contiguous uint8 span, CPU or device) and `host`'s extents, one copy_ per extent
// in order, on the current stream.
void copy_extents(Direction direction, const at::Tensor& device_bytes, const HostBlock& host, bool non_blocking);

// A host block for `bytes` bytes copied from a tensor on `device`: pinned iff the device is an accelerator and
// `pin_memory` (an async copy needs pinned memory).
HostBlock acquire_host_block(HostPool& pool, int64_t bytes, c10::Device device, bool pin_memory);

// Pack: starts copying `src` (a byte view of the tensor's storage) into `host`; `src`'s storage is held in `uses`
// while a side stream (or, for memory the caching allocator does not own, any stream) reads it. Returns the event
// that completes with the copy (d2h_done), or null when the copy was synchronous (CPU).
std::shared_ptr<c10::Event> copy_to_host(const at::Tensor& src, HostBlock& host, SideStreams& streams,
                                         KeepAlive& uses);

// A device block for a restore: `bytes` bytes from the compute stream's pool, `bytes` at offset `pad` of `block`
// so that the span's first byte has address `align` modulo kSpanAlignment.
struct DeviceSpan {
  at::Tensor block;  // owns the allocation
  at::Tensor bytes;  // the span inside it
  int64_t pad = 0;
};
DeviceSpan allocate_device_span(c10::Device device, int64_t bytes, int64_t align);

// What a started restore leaves for its consumers.
struct RestoreOrder {
  std::shared_ptr<c10::Event> done;         // h2d_done; null when synchronous (CPU) or not yet known (spill read)
  std::optional<c10::Stream> alloc_stream;  // the stream whose pool owns the block
};

// Restore/prefetch: starts copying `host` into `dev` (allocated by allocate_device_span on the current stream),
// after `d2h_done` (the pack's copy) if set; `dev`'s storage is held in `uses` while the side stream writes it.
RestoreOrder copy_to_device(const at::Tensor& dev, HostBlock& host, const std::shared_ptr<c10::Event>& d2h_done,
                            SideStreams& streams, KeepAlive& uses);

// Unpack: makes the current stream wait for `done`; if it is not `alloc_stream`, `dev`'s storage is held in `uses`
// until `uses.release_all()` (the end of the graph task). Never blocks the host.
void consume(const at::Tensor& dev, const c10::Event& done, const std::optional<c10::Stream>& alloc_stream,
             KeepAlive& uses);

// The stream order a spill I/O job needs: `ready` (recorded on the compute stream) and the stream it copies on.
// Both empty for CPU tensors.
struct SpillOrder {
  std::shared_ptr<c10::Event> ready;
  std::optional<c10::Stream> copy_stream;
  std::optional<c10::Stream> alloc_stream;  // reads: the stream whose pool owns the destination
};
// Pack into the spill tier: `ready` = e_prod (src is produced), copies on the device->host side stream.
SpillOrder spill_write_order(const at::Tensor& src, SideStreams& streams);
// Restore from the spill tier into `dst` (allocated on the current stream): `ready` = e_alloc, copies on the
// host->device side stream.
SpillOrder spill_read_order(const at::Tensor& dst, SideStreams& streams);

// On a spill I/O thread, before it reads a host block to write it to a file: blocks this thread (never a device
// stream) until `d2h_done` (the pack's device->host copy into that block) has completed. Null: nothing to wait for.
void wait_host_copy(const c10::Event* d2h_done);

// On a spill I/O thread: copies `src` (CPU or device bytes) into `staging` (host, same size), on `stream` after
// `produced` if given, and blocks this thread (never a device stream) until the copy is done.
void stage_to_host(const at::Tensor& staging, const at::Tensor& src, const std::optional<c10::Stream>& stream,
                   const c10::Event* produced);
// On a spill I/O thread: copies `staging` into `dst` (CPU or device bytes, same size), on `stream` after
// `allocated` if given, and blocks this thread until it is done (the staging chunk is reused next). Returns the
// copy's event (null for CPU): what consumers wait on.
std::shared_ptr<c10::Event> stage_to_device(const at::Tensor& dst, const at::Tensor& staging,
                                            const std::optional<c10::Stream>& stream, const c10::Event* allocated);

}  // namespace hsoffload
