// C++ unit tests of the mark set (csrc/marks.cpp): identity, alias and version matching, weak references, pruning.
// CPU only, no streams, no scope.
#include "hsoffload/marks.h"

#include "test_expect.h"

#include <ATen/ATen.h>

namespace {

using hsoffload::MarkSet;

void test_identity_and_dedup() {
  MarkSet marks;
  at::Tensor x = at::randn({8});
  EXPECT(marks.empty() && marks.find(x) == nullptr);
  EXPECT(marks.add(x));
  EXPECT(!marks.add(x));  // marked already: one mark
  EXPECT(marks.size() == 1 && marks.live() == 1);
  EXPECT(marks.find(x) != nullptr);
  EXPECT(marks.find(at::randn({8})) == nullptr);
}

void test_aliases() {
  MarkSet marks;
  at::Tensor x = at::randn({4, 6});
  marks.add(x);
  EXPECT(marks.find(x.detach()) != nullptr);     // same storage, geometry and version
  EXPECT(marks.find(x.view({4, 6})) != nullptr);  // a view with identical geometry is an alias
  EXPECT(marks.find(x.view({24})) == nullptr);    // other sizes
  EXPECT(marks.find(x.slice(1, 1)) == nullptr);   // other offset
  EXPECT(marks.find(x.t()) == nullptr);           // other strides
  EXPECT(marks.find(x.view(at::kInt)) == nullptr);  // other dtype
  // A leaf that requires grad is how a reentrant checkpoint re-saves its detached inputs: not the marked save.
  at::Tensor leaf = x.detach().requires_grad_(true);
  EXPECT(marks.find(leaf) == nullptr);
}

void test_version() {
  MarkSet marks;
  at::Tensor x = at::randn({8});
  marks.add(x);
  x.add_(1);  // new contents: the mark was for the old ones
  EXPECT(marks.find(x) == nullptr);
  EXPECT(marks.add(x));  // marking again at the new version
  EXPECT(marks.find(x) != nullptr);
}

void test_weak_and_prune() {
  MarkSet marks;
  {
    at::Tensor x = at::randn({16});
    marks.add(x);
    EXPECT(marks.live() == 1);
  }
  EXPECT(marks.live() == 0 && marks.size() == 1);  // the mark kept nothing alive
  // A new tensor (perhaps at the freed address) never matches the expired mark.
  at::Tensor y = at::randn({16});
  EXPECT(marks.find(y) == nullptr);
  marks.prune();
  EXPECT(marks.size() == 0);
  marks.add(y);
  marks.clear();
  EXPECT(marks.empty());
}

void test_counted_flag_lives_on_the_mark() {
  MarkSet marks;
  at::Tensor x = at::randn({8});
  marks.add(x);
  hsoffload::Mark* m = marks.find(x);
  EXPECT(m != nullptr && !m->counted);
  m->counted = true;
  EXPECT(marks.find(x.detach())->counted);  // an alias finds the same mark
}

}  // namespace

int main() {
  test_identity_and_dedup();
  test_aliases();
  test_version();
  test_weak_and_prune();
  test_counted_flag_lives_on_the_mark();
  EXPECT_DONE("test_marks");
}
