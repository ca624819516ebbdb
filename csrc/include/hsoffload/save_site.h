// Where a save happens: the autograd node being built when the pack hook runs. Two saves at one site are made by one
// node (one op's SavedVariables, one Function's save_for_backward), with no user code between them; saves at two
// sites may have any code between them, a write that bypasses the version counter included.
//
// One exception (docs/design.md, "Copy sharing"): a custom autograd Function whose forward runs ops with grad
// enabled gets its sequence number before its forward, and saves after it; its saves then share the site of the
// last node its forward created, with the rest of its forward between them.
//
// Thread-safety: `now` reads the calling thread's state only; a SaveSite is a value.
#pragma once

#include <cstdint>

namespace hsoffload {

struct SaveSite {
  uint64_t thread = 0;  // this thread's number: unique in the process (a std::thread::id is reused, and a new
                        // thread's sequence numbers start again at 0)
  // at::sequence_number::peek() at the save: autograd numbers every node it creates from this per-thread counter
  // (Node's constructor), and a node's saves come after its creation, so it changes between any two nodes' saves.
  uint64_t sequence_nr = 0;

  // The site of a save made now, on this thread.
  static SaveSite now();
  bool operator==(const SaveSite& other) const {
    return thread == other.thread && sequence_nr == other.sequence_nr;
  }
};

}  // namespace hsoffload
