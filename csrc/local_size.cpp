// The number of ranks on this node (local_size.h).
#include "hsoffload/local_size.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>

namespace hsoffload {

const char* const kLocalSizeVars[] = {
    "HSOFFLOAD_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
    "SLURM_NTASKS_PER_NODE",      "SLURM_TASKS_PER_NODE",
};
const int kLocalSizeVarCount = static_cast<int>(sizeof(kLocalSizeVars) / sizeof(kLocalSizeVars[0]));

namespace {

// A decimal integer >= 0, the whole string (surrounding blanks allowed).
std::optional<int64_t> non_negative(const std::string& text) {
  const auto first = text.find_first_not_of(" \t");
  const auto last = text.find_last_not_of(" \t");
  if (first == std::string::npos) return std::nullopt;
  const std::string digits = text.substr(first, last - first + 1);
  if (digits.size() > 9 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  return std::stoll(digits);
}

std::optional<int64_t> positive(const std::string& text) {
  const std::optional<int64_t> n = non_negative(text);
  return n && *n > 0 ? n : std::nullopt;
}

// Slurm's compressed per-node counts, "2(x3),1": nodes 0-2 run 2 tasks, node 3 runs 1. This node's count
// (`node`: SLURM_NODEID, or -1 when unknown: then the largest), or nullopt when malformed or out of range.
std::optional<int64_t> slurm_tasks_on_node(const std::string& spec, int64_t node) {
  std::stringstream in(spec);
  std::string item;
  int64_t index = 0;
  int64_t largest = 0;
  while (std::getline(in, item, ',')) {
    const auto paren = item.find('(');
    const std::optional<int64_t> count = positive(item.substr(0, paren));
    int64_t repeat = 1;
    if (paren != std::string::npos) {
      if (item.size() < paren + 4 || item[paren + 1] != 'x' || item.back() != ')') return std::nullopt;
      const std::optional<int64_t> r = positive(item.substr(paren + 2, item.size() - paren - 3));
      if (!r) return std::nullopt;
      repeat = *r;
    }
    if (!count) return std::nullopt;
    if (node >= index && node < index + repeat) return count;
    index += repeat;
    largest = std::max(largest, *count);
  }
  if (node >= 0 || largest == 0) return std::nullopt;  // this node is not in the list
  return largest;
}

}  // namespace

LocalSize local_size_from(const std::function<const char*(const char*)>& getenv) {
  for (const char* name : kLocalSizeVars) {
    const char* raw = getenv(name);
    if (raw == nullptr || *raw == '\0') continue;
    const std::string value(raw);
    std::optional<int64_t> n;
    std::string source = name;
    if (source == "SLURM_TASKS_PER_NODE") {
      const char* node_id = getenv("SLURM_NODEID");
      const std::optional<int64_t> node = node_id ? non_negative(node_id) : std::nullopt;
      n = slurm_tasks_on_node(value, node.value_or(-1));
      if (n && !node) source += " (no SLURM_NODEID: the largest count)";
    } else {
      n = positive(value);
    }
    if (source == "HSOFFLOAD_LOCAL_WORLD_SIZE") {
      TORCH_CHECK_VALUE(n.has_value(), "HSOFFLOAD_LOCAL_WORLD_SIZE must be the number of ranks on this node (an int ",
                        ">= 1), got '", value, "'; unset it to let the launcher's variables decide");
    }
    if (n) return LocalSize{*n, source};
  }
  return LocalSize{};
}

LocalSize local_size() {
  return local_size_from([](const char* name) { return std::getenv(name); });
}

}  // namespace hsoffload
