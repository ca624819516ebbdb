// The mark set: which tensors a scope was asked to offload, matched at pack by tensor identity or by alias.
//
// A mark matches the marked TensorImpl, or an alias of it (not a leaf that requires grad): the same live storage
// viewed with the same dtype, storage offset, sizes and strides at the same version. TorchScript's profiling
// executor, detach() inside custom Functions and functionalization hand autograd such aliases instead of the
// marked tensor. Weak references only: a mark never keeps memory alive, and a new storage at a reused address
// never matches (an empty `storage` locks to null, so a mark without plain storage matches only itself).
//
// Thread-safety: none of its own. The owner (OffloadScope) calls every method under its mutex.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <vector>

namespace hsoffload {

// One mark. Pure CPU bookkeeping: no streams, no copies.
struct Mark {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl{c10::intrusive_ptr<c10::TensorImpl>()};
  c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
  uint32_t version = 0;
  at::ScalarType dtype = at::kByte;
  int64_t storage_offset = 0;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  bool counted = false;  // marked_tensors counts a mark once, however often autograd saves its tensor
  // Addresses at mark time, for a quick reject without touching the weak references' atomics (a match needs the
  // same TensorImpl or the same StorageImpl; equal addresses alone prove nothing, the weak references decide).
  const void* impl_address = nullptr;
  const void* storage_address = nullptr;

  // The mark of `x` as it is now.
  static Mark of(const at::Tensor& x);
  // True if packing `x` (at version `x_version`) should find this mark: `x` is the marked tensor or an alias.
  bool matches(const at::Tensor& x, uint32_t x_version) const;
  // Neither the tensor nor its storage is alive: the mark can never match again.
  bool expired() const { return impl.expired() && storage.expired(); }
};

// The marks of one scope entry, newest last.
class MarkSet {
 public:
  // Marks `x` unless a mark already matches it. Returns true if a mark was added.
  bool add(const at::Tensor& x);
  // The newest mark that matches `x` now, or null. Stays valid until the next add/prune/clear.
  Mark* find(const at::Tensor& x);
  bool empty() const { return marks_.empty(); }
  // Entries held, expired ones included (what pruning is scheduled by).
  size_t size() const { return marks_.size(); }
  // Marks that can still match.
  int64_t live() const;
  // Drops expired marks.
  void prune();
  // Drops every mark (scope exit).
  void clear() { marks_.clear(); }

 private:
  std::vector<Mark> marks_;
};

}  // namespace hsoffload
