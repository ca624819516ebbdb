// Which tensors the engine may treat as bytes of their storage, and the facts about a tensor it keys on.
//
// Thread-safety: pure functions of their argument; a ProducerRef may be read (`get`) from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace hsoffload {

// True iff `t`'s elements are plain bytes of its own storage on its own device,
// so that a byte copy of a span of that storage (and `set_` on a copy of it)
// reproduces `t`: defined, strided, not nested, sparse, quantized or mkldnn,
// not meta, not a tensor subclass with its own dispatch (`__torch_dispatch__`:
// DTensor and other wrappers keep their data in inner tensors, fake tensors in
// no memory at all), with a storage on `t`'s device and a data pointer.
// Everything else passes through the engine untouched.
bool has_plain_storage(const at::Tensor& t);

// `x`'s version counter now, or 0 if it has none (inference tensors): what marks and records compare.
uint32_t version_of(const at::Tensor& x);

// A weak reference to the autograd node that made a tensor (its grad_fn): names that node while it lives and never
// keeps it alive, so an address reused by a later node never compares equal. The engine compares producers only
// (copy sharing, records.h); it never calls into autograd.
class ProducerRef {
 public:
  ProducerRef() = default;
  // `x`'s grad_fn, or an empty reference when it has none (leaves, tensors made without grad, inference tensors).
  static ProducerRef of(const at::Tensor& x);
  // The node while it lives, else null.
  const void* get() const { return lock_ ? lock_() : nullptr; }

 private:
  std::function<const void*()> lock_;  // type-erased: torch's node pointer type differs between releases
};

}  // namespace hsoffload
