// The counters' generated operations that are not inline (see stats.h: one X-macro list per struct).
#include "hsoffload/stats.h"

namespace hsoffload {

void OffloadStats::add(const OffloadStats& o) {
#define HSOFFLOAD_STATS_ADD(name, doc) name += o.name;
  HSOFFLOAD_OFFLOAD_STATS(HSOFFLOAD_STATS_ADD)
#undef HSOFFLOAD_STATS_ADD
}

}  // namespace hsoffload
