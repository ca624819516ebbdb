"""`hsoffload.fsdp`: FSDP RAM-efficient loading (`hsoffload.fsdp.patch()`), the public name of `hsoffload.loading.fsdp`.

This name is that very module (one set of objects, whichever name was imported).
"""

import sys

from .loading import fsdp as _module

sys.modules[__name__] = _module
