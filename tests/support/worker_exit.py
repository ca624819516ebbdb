"""How a torchrun worker of the suite ends: its results written as rank<N>.json, the ranks met at a barrier and the
process group destroyed (`finish`), then leaving the process (`leave`).

Under CI load a torch 2.14 rank once aborted with "terminate called without an active exception" and no Python frame
(a native thread torn down at interpreter finalization). That teardown is torch's, not what the tests measure, so a
worker leaves without finalizers, after flushing what it printed. Imported by the worker scripts as a sibling module
(torchrun puts the script's folder first on sys.path).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, NoReturn


def finish(out_dir: str, rank: int, results: Any, **dump: Any) -> None:
    """Write this rank's results to OUT_DIR/rank<N>.json (json.dump's keyword arguments in `dump`), wait for every
    rank at a barrier, destroy the process group."""
    import torch.distributed as dist

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, **dump)
    dist.barrier()
    dist.destroy_process_group()


def leave(rc: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
