"""How a torchrun worker of the suite ends, once its results are written and its process group destroyed.

Under CI load a torch 2.14 rank once aborted with "terminate called without an active exception" and no Python frame
(a native thread torn down at interpreter finalization). That teardown is torch's, not what the tests measure, so a
worker leaves without finalizers, after flushing what it printed. Imported by the worker scripts as a sibling module
(torchrun puts the script's folder first on sys.path).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def leave(rc: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
