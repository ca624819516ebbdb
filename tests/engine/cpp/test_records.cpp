// C++ unit tests of the record index (csrc/records.cpp) and prefetch scheduling (csrc/prefetch.cpp): dedup by
// storage and span, weak entries, pruning, regrouping, rounds of unpacks, and which records a restore prefetches.
// CPU only, no streams, no copies.
#include "hsoffload/prefetch.h"
#include "hsoffload/records.h"

#include "test_expect.h"

#include <thread>

#include <ATen/ATen.h>

#include <memory>
#include <vector>

namespace {

using hsoffload::OffloadRecord;
using hsoffload::RecordIndex;

std::shared_ptr<OffloadRecord> record_of(const at::Tensor& x, int64_t begin, int64_t end, int64_t seq = 0,
                                         int64_t group = 0, int64_t epoch = 0) {
  auto r = std::make_shared<OffloadRecord>();
  r->seq = seq;
  r->group = group;
  r->epoch = epoch;
  r->source.device = x.device();
  r->source.storage = x.storage().getWeakStorageImpl();
  r->source.begin = begin;
  r->source.end = end;
  return r;
}

const c10::StorageImpl* storage_of(const at::Tensor& x) { return x.storage().unsafeGetStorageImpl(); }

void test_find_covers_spans() {
  RecordIndex index;
  at::Tensor x = at::randn({256});  // 1024 bytes
  auto r = record_of(x, 0, 1024);
  index.add(r);
  EXPECT(index.find(storage_of(x), 0, 1024) == r);
  EXPECT(index.find(storage_of(x), 512, 600) == r);   // a view inside the span shares the record
  EXPECT(index.find(storage_of(x), 512, 1100) == nullptr);  // overlapping only: not covered
  at::Tensor y = at::randn({256});
  EXPECT(index.find(storage_of(y), 0, 1024) == nullptr);  // another storage
  EXPECT(index.live() == 1 && index.size() == 1);
}

void test_weak_entries_and_prune() {
  RecordIndex index;
  at::Tensor x = at::randn({64});
  {
    auto r = record_of(x, 0, 256);
    index.add(r);
    EXPECT(index.live() == 1);
  }
  EXPECT(index.live() == 0 && index.size() == 1);  // the index keeps no record alive
  EXPECT(index.find(storage_of(x), 0, 256) == nullptr);
  index.prune();
  EXPECT(index.size() == 0);
}

void test_dead_storage_never_matches() {
  RecordIndex index;
  const c10::StorageImpl* address = nullptr;
  std::shared_ptr<OffloadRecord> r;
  {
    at::Tensor x = at::randn({64});
    address = storage_of(x);
    r = record_of(x, 0, 256);
    index.add(r);
  }
  // The record lives (a handle holds it) but its storage is gone: a lookup by the old address, which a new
  // storage may reuse, is confirmed through the weak reference and fails.
  EXPECT(index.find(address, 0, 256) == nullptr);
}

void test_prefetch_order_and_depths() {
  RecordIndex index;
  at::Tensor x = at::randn({1024});
  std::vector<std::shared_ptr<OffloadRecord>> held;
  for (int64_t i = 0; i < 5; ++i) {  // one record per group, packed in order 0..4
    held.push_back(record_of(x, i * 512, (i + 1) * 512, /*seq=*/i, /*group=*/i));
    index.add(held.back());
  }
  // Restoring group 4 with host depth 2 brings back groups 3 and 2, newest first (reverse pack order).
  auto next = hsoffload::records_to_prefetch(index, *held[4], {2, 0});
  EXPECT(next.size() == 2 && next[0] == held[3] && next[1] == held[2]);
  // Records already prefetched are skipped, and the quota counts groups, not records.
  held[3]->restore.prefetched = at::empty({512}, at::kByte);
  next = hsoffload::records_to_prefetch(index, *held[4], {2, 0});
  EXPECT(next.size() == 1 && next[0] == held[2]);
  // Depth 0: nothing.
  EXPECT(hsoffload::records_to_prefetch(index, *held[4], {0, 0}).empty());
  // Another scope entry (epoch) is never prefetched.
  held[2]->epoch = -1;
  next = hsoffload::records_to_prefetch(index, *held[4], {3, 0});
  EXPECT(next.empty());
}

void test_prefetch_rest_of_group() {
  RecordIndex index;
  at::Tensor x = at::randn({1024});
  std::vector<std::shared_ptr<OffloadRecord>> held;
  for (int64_t i = 0; i < 4; ++i) {  // groups {0, 1} and {2, 3}
    held.push_back(record_of(x, i * 512, (i + 1) * 512, /*seq=*/i, /*group=*/i / 2));
    index.add(held.back());
  }
  // A recompute reads its layer's tensors in forward order: restoring record 2 brings back record 3 (distance 0)
  // and, with depth 1, group 0.
  auto next = hsoffload::records_to_prefetch(index, *held[2], {1, 0});
  EXPECT(next.size() == 3 && next[0] == held[3] && next[1] == held[1] && next[2] == held[0]);
  // Packed after the current one and restored already: backward is past it.
  held[3]->restore.restored_once = true;
  next = hsoffload::records_to_prefetch(index, *held[2], {1, 0});
  EXPECT(next.size() == 2 && next[0] == held[1]);
}

void test_regroup_moves_a_record_to_its_last_group() {
  // Groups 0, 1, 2 (one record each, layers in forward order) and a record first packed in group 0 that groups 1
  // and 2 saved again (rotary cos/sin): it moves to group 2 at the end of pack order, its first entry goes stale.
  RecordIndex index;
  at::Tensor x = at::randn({1024});
  std::vector<std::shared_ptr<OffloadRecord>> layer;
  auto shared = record_of(x, 0, 512, /*seq=*/0, /*group=*/0);
  index.add(shared);
  for (int64_t g = 0; g < 3; ++g) {
    layer.push_back(record_of(x, 512 + g * 512, 1024 + g * 512, /*seq=*/1 + g, /*group=*/g));
    index.add(layer.back());
    if (g > 0) index.regroup(shared, g, /*seq=*/10 + g, /*epoch=*/0);
  }
  EXPECT(shared->group == 2 && shared->seq == 12);
  EXPECT(index.live() == 4 && index.size() == 6);  // two stale entries, each record counted once
  index.regroup(shared, 1, 20, 0);  // an earlier group: no move
  EXPECT(shared->group == 2 && index.size() == 6);
  // Its unpack (in the last layer's backward) prefetches the rest of group 2 and group 1 -- not group 0.
  auto next = hsoffload::records_to_prefetch(index, *shared, {1, 0});
  EXPECT(next.size() == 2 && next[0] == layer[2] && next[1] == layer[1]);
  index.prune();
  EXPECT(index.size() == 4);  // stale entries go with pruning
}

void test_unpack_round_holds_the_restore_for_every_handle() {
  using hsoffload::UnpackRound;
  const auto storage_of_new = [] { return at::empty({64}, at::kByte).storage().getWeakStorageImpl().lock(); };
  UnpackRound round;
  round.add_handle();
  round.add_handle();
  int64_t a = -1, b = -1;
  auto restored = storage_of_new();
  const c10::StorageImpl* address = restored.get();
  EXPECT(!round.unpacked(a, restored));           // b has not unpacked: the restore is held for it
  EXPECT(restored.use_count() == 2);
  EXPECT(!round.unpacked(a, restored));           // a second unpack of one handle does not end the round
  auto freed = round.unpacked(b, restored);       // the last handle: the round ends, the held storage comes back
  EXPECT(freed.get() == address && restored.use_count() == 2);
  freed.reset();
  EXPECT(restored.use_count() == 1);
  // The next round (a retained graph's second backward): a handle that dies without unpacking ends it.
  EXPECT(!round.unpacked(a, restored));
  EXPECT(restored.use_count() == 2);
  EXPECT(round.drop_handle(b).get() == address);
  // One handle left: its next unpack ends a round of one at once, holding nothing.
  EXPECT(round.unpacked(a, restored).get() == nullptr);
  EXPECT(restored.use_count() == 1);
  EXPECT(round.drop_handle(a).get() == nullptr);
}

void test_unpack_round_ends_early_when_its_graph_task_does() {
  using hsoffload::UnpackRound;
  UnpackRound round;
  round.add_handle();
  round.add_handle();
  int64_t a = -1, b = -1;
  auto restored = at::empty({64}, at::kByte).storage().getWeakStorageImpl().lock();
  EXPECT(round.end_round().get() == nullptr);      // nothing unpacked: nothing to end
  EXPECT(!round.unpacked(a, restored));            // held for b, which never unpacks in this pass
  EXPECT(round.end_round().get() == restored.get());  // the graph task ended: the held storage is given back
  EXPECT(!round.unpacked(b, restored));            // a new pass: b is the first to unpack, held for a
  EXPECT(round.unpacked(a, restored).get() == restored.get());  // and a ends it
}

void test_share_policy_admits_referenced_bytes_and_same_node_siblings() {
  hsoffload::SaveFootprint dense{0, 4096, 4, {32, 32}, {32, 1}, true};
  hsoffload::SaveFootprint half{0, 4096 - 64, 4, {32, 16}, {32, 1}, false};  // columns 0..15 of the same rows
  hsoffload::SaveFootprint other_half{64, 4096, 4, {32, 16}, {32, 1}, false};
  hsoffload::SaveFootprint inner{1024, 2048, 4, {8, 32}, {32, 1}, true};
  const hsoffload::SaveSite here{1, 7};
  const hsoffload::SaveSite later{1, 8};
  hsoffload::SharePolicy whole;
  whole.first(dense, hsoffload::ProducerRef(), here);
  EXPECT(whole.admits(inner, nullptr, here, false));  // the same node's saves share by default
  EXPECT(!whole.admits(inner, nullptr, later, false) && !whole.admits(dense, nullptr, later, false));  // no opt-in
  EXPECT(whole.admits(inner, nullptr, later, true) && whole.admits(half, nullptr, later, true));  // referenced bytes
  hsoffload::SharePolicy strided;
  strided.first(half, hsoffload::ProducerRef(), here);
  EXPECT(strided.admits(half, nullptr, later, true));             // the same elements
  EXPECT(!strided.admits(other_half, nullptr, later, true));      // bytes only the copy spans, no save referenced
  EXPECT(!strided.admits(inner, nullptr, later, true));
  strided.add(other_half);
  EXPECT(strided.admits(other_half, nullptr, later, true));       // once a save referenced them
  EXPECT(!strided.admits(other_half, nullptr, later, false));     // but only with the opt-in
}

}  // namespace

int main() {
  test_find_covers_spans();
  test_weak_entries_and_prune();
  test_dead_storage_never_matches();
  test_prefetch_order_and_depths();
  test_prefetch_rest_of_group();
  test_regroup_moves_a_record_to_its_last_group();
  test_unpack_round_holds_the_restore_for_every_handle();
  test_unpack_round_ends_early_when_its_graph_task_does();
  test_share_policy_admits_referenced_bytes_and_same_node_siblings();
  EXPECT_DONE("test_records");
}
