// The number of ranks on this node: the one decider of the local size, read by the host budget's "auto" (the ranks
// of a node share its RAM) and, through an op, by the Python shim's log line and the planner's defaults.
//
// Precedence (docs/usage.md, "Host budget"): HSOFFLOAD_LOCAL_WORLD_SIZE (the user's word); then the launcher that
// started this process -- torchrun's LOCAL_WORLD_SIZE, DeepSpeed's launcher's LOCAL_SIZE, Open MPI's
// OMPI_COMM_WORLD_LOCAL_SIZE, Intel MPI / MPICH's MPI_LOCALNRANKS --; then Slurm's allocation, which a launcher inside
// it overrides (srun + torchrun: SLURM_NTASKS_PER_NODE=1, LOCAL_WORLD_SIZE=8): SLURM_NTASKS_PER_NODE, then
// SLURM_TASKS_PER_NODE ("2(x3),1": this node's count through SLURM_NODEID; without it the largest count).
//
// Thread-safety: pure functions of the environment they are given; `local_size()` reads the process environment
// (getenv), which the caller must not change concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace hsoffload {

struct LocalSize {
  int64_t ranks = 1;   // ranks on this node (1 when no variable names it)
  std::string source;  // the variable it came from; "" when none did
};

// The variables read, in precedence order.
extern const char* const kLocalSizeVars[];
extern const int kLocalSizeVarCount;

// The local size given an environment lookup (`getenv`: the value or null). Raises c10::ValueError when
// HSOFFLOAD_LOCAL_WORLD_SIZE is set but not a positive integer; a launcher's malformed variable is skipped.
LocalSize local_size_from(const std::function<const char*(const char*)>& getenv);

// The local size of this process, from its environment now.
LocalSize local_size();

}  // namespace hsoffload
