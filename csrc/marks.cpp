// The mark set (marks.h): weak identity-or-alias matching of marked tensors. CPU bookkeeping only.
#include "hsoffload/marks.h"

#include "hsoffload/tensor_kind.h"

#include <algorithm>

namespace hsoffload {

Mark Mark::of(const at::Tensor& x) {
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
  return m;
}

bool Mark::matches(const at::Tensor& x, uint32_t x_version) const {
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

bool MarkSet::add(const at::Tensor& x) {
  if (find(x) != nullptr) {
    return false;
  }
  marks_.push_back(Mark::of(x));
  return true;
}

Mark* MarkSet::find(const at::Tensor& x) {
  const uint32_t version = version_of(x);
  // Newest first: a policy that marks a tensor right before autograd packs it finds its mark at once.
  for (auto it = marks_.rbegin(); it != marks_.rend(); ++it) {
    if (it->matches(x, version)) {
      return &*it;
    }
  }
  return nullptr;
}

int64_t MarkSet::live() const {
  int64_t n = 0;
  for (const auto& m : marks_) n += m.expired() ? 0 : 1;
  return n;
}

void MarkSet::prune() {
  marks_.erase(std::remove_if(marks_.begin(), marks_.end(), [](const Mark& m) { return m.expired(); }),
               marks_.end());
}

}  // namespace hsoffload
