"""`hsoffload.axolotl`: the drop-in name for Axolotl's hidden-state offload module.

The code lives in `hsoffload.integrations.axolotl`; this name is that very module (one set of classes, so
`isinstance` checks and monkeypatches see the same objects whichever name was imported).
"""

import sys

from .integrations import axolotl as _module

sys.modules[__name__] = _module
