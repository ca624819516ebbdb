// The record index (records.h): live offload records by pack order and by source storage. CPU bookkeeping only.
#include "hsoffload/records.h"

#include <algorithm>
#include <iterator>

namespace hsoffload {

bool SourceSpan::covers(const c10::StorageImpl* s, int64_t b, int64_t e) const {
  return begin <= b && e <= end && storage.lock().get() == s;
}

void RecordIndex::add(const std::shared_ptr<OffloadRecord>& record) {
  records_.push_back(record);
  by_storage_.emplace(record->source.storage.lock().get(), record);
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
  for (const auto& r : records_) n += r.expired() ? 0 : 1;
  return n;
}

void RecordIndex::prune() {
  records_.erase(std::remove_if(records_.begin(), records_.end(),
                                [](const std::weak_ptr<OffloadRecord>& r) { return r.expired(); }),
                 records_.end());
  for (auto it = by_storage_.begin(); it != by_storage_.end();) {
    it = it->second.expired() ? by_storage_.erase(it) : std::next(it);
  }
}

}  // namespace hsoffload
