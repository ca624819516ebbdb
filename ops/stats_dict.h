// A stats struct of hsoffload/stats.h as the ops return it: Dict(str, int), name -> value, in its list's order.
//
// Thread-safety: a pure function of its argument.
#pragma once

#include "hsoffload/stats.h"

#include <ATen/core/Dict.h>

#include <cstdint>
#include <string>

namespace hsoffload::ops {

template <class Stats>
c10::Dict<std::string, int64_t> to_dict(const Stats& s) {
  c10::Dict<std::string, int64_t> out;
  for (const auto& [name, value] : fields(s)) {
    out.insert(name, value);
  }
  return out;
}

}  // namespace hsoffload::ops
