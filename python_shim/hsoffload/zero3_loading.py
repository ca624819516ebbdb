"""`hsoffload.zero3_loading`: DeepSpeed ZeRO-3 RAM-efficient loading, the public name of `hsoffload.loading.zero3`.

This name is that very module (one set of objects, whichever name was imported).
"""

import sys

from .loading import zero3 as _module

sys.modules[__name__] = _module
