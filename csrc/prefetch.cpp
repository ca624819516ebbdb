// Prefetch scheduling (prefetch.h): the choice of records to restore ahead of backward. Starts no copies itself.
#include "hsoffload/prefetch.h"

namespace hsoffload {

namespace {

// Admits records of up to `depth` groups counted from `last_group` (distance 0: that group itself).
struct Quota {
  int64_t depth;
  int64_t last_group;
  int64_t distance = 0;
  bool admits(int64_t group) {
    if (depth == 0) {
      return false;  // no prefetch of this kind
    }
    if (group != last_group) {
      last_group = group;
      ++distance;
    }
    return distance <= depth;
  }
  bool more() const { return depth > 0 && distance <= depth; }
};

}  // namespace

std::vector<std::shared_ptr<OffloadRecord>> records_to_prefetch(const RecordIndex& index,
                                                                const OffloadRecord& current, PrefetchDepths depths) {
  std::vector<std::shared_ptr<OffloadRecord>> out;
  Quota host{depths.host, current.group}, spilled{depths.spill, current.group};
  // Without spilled records the loop stops after the host quota (O(prefetch_depth)).
  const auto more = [&] { return host.more() || spilled.more(); };
  const auto& records = index.in_pack_order();
  for (auto it = records.rbegin(); it != records.rend() && more(); ++it) {
    auto record = it->lock();
    if (!record || record->group > current.group || record.get() == &current) {
      continue;  // later groups were restored before (reverse order); the rest of this group comes next
    }
    if (record->epoch != current.epoch) {
      break;  // records are in pack order: everything before belongs to an earlier entry
    }
    if (!(record->spilled() ? spilled : host).admits(record->group)) {
      continue;
    }
    if (record->restore.prefetched.defined() || !record->restore.restored.expired()) {
      continue;
    }
    if (record->group == current.group && record->seq > current.seq && record->restore.restored_once) {
      continue;  // packed after the current one and restored already: backward is past it (reverse order)
    }
    out.push_back(std::move(record));
  }
  return out;
}

}  // namespace hsoffload
