// Where a save happens (save_site.h).
#include "hsoffload/save_site.h"

#include <ATen/SequenceNumber.h>

namespace hsoffload {

SaveSite SaveSite::now() {
  return SaveSite{std::this_thread::get_id(), at::sequence_number::peek()};
}

}  // namespace hsoffload
