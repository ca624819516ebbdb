// Which tensors the engine may treat as bytes of their storage, and the facts about a tensor it keys on.
//
// Thread-safety: pure functions of their argument.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

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

}  // namespace hsoffload
