// The record index (records.h): live offload records by pack order and by source storage. CPU bookkeeping only.
#include "hsoffload/records.h"

#include <algorithm>
#include <iterator>

namespace hsoffload {

bool SourceSpan::covers(const c10::StorageImpl* s, int64_t b, int64_t e) const {
  return begin <= b && e <= end && storage.lock().get() == s;
}

bool SaveFootprint::contains(const SaveFootprint& other) const {
  if (dense) {
    return begin <= other.begin && other.end <= end;
  }
  return begin == other.begin && itemsize == other.itemsize && sizes == other.sizes && strides == other.strides;
}

void SharePolicy::first(SaveFootprint save, ProducerRef producer, SaveSite site) {
  saves_.assign(1, std::move(save));
  producer_ = std::move(producer);
  site_ = site;
}

bool SharePolicy::admits(const SaveFootprint& save, const void* producer, const SaveSite& site,
                         bool share_copies) const {
  if (site == site_) {
    return true;  // saved by the same node as the first save: nothing ran between the two saves
  }
  if (!share_copies) return false;  // (M24) any code may have run since the copy: this save gets its own

  if (producer != nullptr && producer_.get() == producer) {
    return true;  // a sibling view made by the same node as the first save
  }
  return std::any_of(saves_.begin(), saves_.end(), [&](const SaveFootprint& s) { return s.contains(save); });
}

void SharePolicy::add(SaveFootprint save) {
  for (const SaveFootprint& s : saves_) {
    if (s.contains(save)) return;  // nothing new referenced
  }
  saves_.push_back(std::move(save));
}

std::shared_ptr<OffloadRecord> PackEntry::lock() const {
  auto r = record.lock();
  return r && r->group == group ? r : nullptr;
}

void UnpackRound::add_handle() {
  std::lock_guard<std::mutex> lock(mutex_);
  ++live_handles_;
}

c10::intrusive_ptr<c10::StorageImpl> UnpackRound::unpacked(int64_t& handle_round,
                                                           c10::intrusive_ptr<c10::StorageImpl> restored) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (handle_round != round_) {
    handle_round = round_;
    ++unpacked_;
  }
  if (unpacked_ < live_handles_) {
    held_ = std::move(restored);  // (M22) later handles of this record reuse this restore instead of copying again
    return {};
  }
  return end_if_done_locked();
}

c10::intrusive_ptr<c10::StorageImpl> UnpackRound::drop_handle(int64_t handle_round) {
  std::lock_guard<std::mutex> lock(mutex_);
  --live_handles_;
  if (handle_round == round_) {
    --unpacked_;
  }
  return end_if_done_locked();
}

c10::intrusive_ptr<c10::StorageImpl> UnpackRound::end_round() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (unpacked_ == 0 && !held_) {
    return {};  // nothing unpacked in this round: nothing to end
  }
  ++round_;
  unpacked_ = 0;
  return std::move(held_);
}

c10::intrusive_ptr<c10::StorageImpl> UnpackRound::end_if_done_locked() {
  if (live_handles_ > 0 && unpacked_ < live_handles_) {
    return {};
  }
  // Every handle left has unpacked in this round (or none is left): it is over.
  ++round_;
  unpacked_ = 0;
  return std::move(held_);
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

std::shared_ptr<OffloadRecord> RecordIndex::find(const c10::StorageImpl* storage, int64_t begin, int64_t end,
                                                 const std::function<bool(const OffloadRecord&)>& accept) const {
  auto range = by_storage_.equal_range(storage);
  for (auto it = range.first; it != range.second; ++it) {
    auto record = it->second.lock();
    if (record && record->source.covers(storage, begin, end) && (!accept || accept(*record))) {
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
