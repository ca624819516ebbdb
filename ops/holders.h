// TorchScript custom classes that carry engine objects across the op boundary.
//
// Note on the handle type: pack returns a typed custom class rather than an
// integer key. Autograd owns the object it gets from the pack hook, so a class
// ties the host copy's lifetime to the graph that saved it (a graph that is
// never run backward frees its copies when it is dropped), and it works the
// same from Python hooks and from TorchScript. An integer key would need a
// table whose entries outlive dropped graphs.
#pragma once

#include "hsoffload/scope.h"

#include <torch/custom_class.h>

#include <memory>

namespace hsoffload::ops {

// `torch.classes.hsoffload.OffloadScope`: one offload scope.
struct OffloadScopeHolder : torch::CustomClassHolder {
  explicit OffloadScopeHolder(std::shared_ptr<OffloadScope> s) : scope(std::move(s)) {}
  std::shared_ptr<OffloadScope> scope;
};

// `torch.classes.hsoffload.SavedHandle`: what `offload_pack` returns.
struct SavedHandleHolder : torch::CustomClassHolder {
  explicit SavedHandleHolder(std::shared_ptr<SavedHandle> h) : handle(std::move(h)) {}
  std::shared_ptr<SavedHandle> handle;
};

}  // namespace hsoffload::ops
