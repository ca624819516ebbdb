"""`hsoffload.axolotl_plugin`: the name Axolotl configs use for the plugin (`hsoffload.axolotl_plugin.HsOffloadPlugin`).

The code lives in `hsoffload.integrations.axolotl_plugin`; this name is that very module.
"""

import sys

from .integrations import axolotl_plugin as _module

sys.modules[__name__] = _module
