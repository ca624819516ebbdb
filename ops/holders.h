// How engine objects cross the op boundary: handle tensors (saved data) and the OffloadScope custom class.
//
// Thread-safety: a handle tensor owns a SavedHandle (immutable but for its round of unpacks, guarded by its record);
// the holder only forwards to the scope, which guards itself.
//
// Note on the handle type: `offload_pack` returns a *handle tensor*: a
// 0-element uint8 CPU tensor whose storage owns the engine's SavedHandle
// (through its DataPtr context). Autograd owns whatever the pack hook returns,
// so the host copy lives exactly as long as the graph that saved it (a graph
// that is never run backward frees its copies when it is dropped), with no
// table to clean up. A tensor crosses the Python/TorchScript boundary 4-8x
// faster than a custom-class object (measured, docs/ops.md: a handle tensor
// ~2 us per pack and ~1 us per unpack, a custom-class handle ~8 us each), and
// the hooks run once per saved tensor. An integer key would need a table whose
// entries outlive dropped graphs.
//
// The scope itself is a TorchScript custom class (`OffloadScope`): it is
// created and entered once per step, so its call cost does not matter. Hooks
// name it by its integer id.
#pragma once

#include "hsoffload/scope.h"

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <memory>

namespace hsoffload::ops {

// `torch.classes.hsoffload.OffloadScope`: one offload scope.
struct OffloadScopeHolder : torch::CustomClassHolder {
  explicit OffloadScopeHolder(std::shared_ptr<OffloadScope> s) : scope(std::move(s)) {}
  std::shared_ptr<OffloadScope> scope;
};

// Wraps `handle` into a handle tensor that owns it.
at::Tensor make_handle_tensor(std::shared_ptr<SavedHandle> handle);
// The handle owned by `t`, or null if `t` is not a handle tensor.
const SavedHandle* handle_of(const at::Tensor& t);

}  // namespace hsoffload::ops
