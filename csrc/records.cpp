// The record index (records.h): live offload records by pack order and by source storage. CPU bookkeeping only.
#include "hsoffload/records.h"

#include <algorithm>
#include <iterator>

namespace hsoffload {

bool SourceSpan::covers(const c10::StorageImpl* s, int64_t b, int64_t e) const {
  return begin <= b && e <= end && storage.lock().get() == s;
}

std::shared_ptr<OffloadRecord> PackEntry::lock() const {
  auto r = record.lock();
  return r && r->group == group ? r : nullptr;
}

bool RestoreState::note_unpack(int64_t& handle_round) {
  if (handle_round != round) {
    handle_round = round;
    ++unpacked_this_round;
  }
  if (unpacked_this_round < live_handles) {
    return false;
  }
  ++round;
  unpacked_this_round = 0;
  return true;
}

c10::intrusive_ptr<c10::StorageImpl> RestoreState::drop_handle(int64_t handle_round) {
  --live_handles;
  if (handle_round == round) {
    --unpacked_this_round;
  }
  if (live_handles > 0 && unpacked_this_round < live_handles) {
    return {};
  }
  // Every handle left has unpacked in this round (or none is left): it is over.
  ++round;
  unpacked_this_round = 0;
  return std::move(held);
}

void RecordIndex::add(const std::shared_ptr<OffloadRecord>& record) {
  records_.push_back(PackEntry{record, record->group});
  by_storage_.emplace(record->source.storage.lock().get(), record);
}

void RecordIndex::regroup(const std::shared_ptr<OffloadRecord>& record, int64_t group, int64_t seq, int64_t epoch) {
  if (group <= record->group) {
    return;
  }
  record->group = group;
  record->seq = seq;
  record->epoch = epoch;
  records_.push_back(PackEntry{record, group});  // its earlier entry goes stale (PackEntry::lock)
}

std::shared_ptr<OffloadRecord> RecordIndex::find(const c10::StorageImpl* storage, int64_t begin, int64_t end) const {
  auto range = by_storage_.equal_range(storage);
  for (auto it = range.first; it != range.second; ++it) {
    auto record = it->second.lock();
    if (record && record->source.covers(storage, begin, end)) {
      return record;
    }
  }
  return nullptr;
}

int64_t RecordIndex::live() const {
  int64_t n = 0;
  for (const auto& e : records_) n += e.lock() ? 1 : 0;
  return n;
}

void RecordIndex::prune() {
  records_.erase(std::remove_if(records_.begin(), records_.end(),
                                [](const PackEntry& e) { return !e.lock(); }),
                 records_.end());
  for (auto it = by_storage_.begin(); it != by_storage_.end();) {
    it = it->second.expired() ? by_storage_.erase(it) : std::next(it);
  }
}

}  // namespace hsoffload
