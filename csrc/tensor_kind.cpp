// Which tensors are plain bytes of their own storage (tensor_kind.h).
#include "hsoffload/tensor_kind.h"

#include <c10/core/DispatchKey.h>
#include <torch/csrc/autograd/function.h>  // the node type, complete, to hold a weak reference to one

#include <memory>
#include <type_traits>

namespace hsoffload {

bool has_plain_storage(const at::Tensor& t) {
  if (!t.defined() || t.layout() != c10::kStrided || t.is_nested() || t.is_quantized() || t.is_meta()) {
    return false;
  }
  const c10::DispatchKeySet keys = t.key_set();
  if (keys.has(c10::DispatchKey::Python) || keys.has(c10::DispatchKey::PythonTLSSnapshot)) {
    return false;  // a __torch_dispatch__ subclass: its storage (if any) is not where its data is
  }
  if (!t.has_storage()) {
    return false;
  }
  const c10::Storage& storage = t.storage();
  if (storage.device_type() != t.device().type()) {
    return false;  // e.g. a fake tensor made outside its mode: a CPU tensor over a meta storage
  }
  return storage.nbytes() == 0 || storage.data_ptr().get() != nullptr;
}

uint32_t version_of(const at::Tensor& x) {
  const auto& vc = x.unsafeGetTensorImpl()->version_counter();
  return vc.enabled() ? vc.current_version() : 0;
}

namespace {

// torch holds autograd nodes by intrusive_ptr (>= 2.12) or shared_ptr (older): a weak reference of the same kind.
template <class Node>
c10::weak_intrusive_ptr<Node> weak_of(const c10::intrusive_ptr<Node>& node) {
  return c10::weak_intrusive_ptr<Node>(node);
}
template <class Node>
std::weak_ptr<Node> weak_of(const std::shared_ptr<Node>& node) {
  return node;
}

}  // namespace

ProducerRef ProducerRef::of(const at::Tensor& x) {
  ProducerRef ref;
  if (!x.defined() || !x.requires_grad()) {
    return ref;
  }
  const auto& node = x.grad_fn();
  if (!node) {
    return ref;
  }
  ref.lock_ = [weak = weak_of(node)]() -> const void* { return static_cast<const void*>(weak.lock().get()); };
  return ref;
}

}  // namespace hsoffload
