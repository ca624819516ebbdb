"""hsoffload: hidden-state offload for gradient-checkpointed training, and FSDP RAM-efficient loading.

`import hsoffload` loads the op library (namespace `torch.ops.hsoffload`) once.
"""

from __future__ import annotations

import logging

from ._loader import load_library
from ._logging import install_default_handler

logger = logging.getLogger("hsoffload")
install_default_handler()  # warnings reach stderr even when the application configured no logging

__version__ = "0.1.0"


def _ensure_loaded() -> None:
    load_library()


_ensure_loaded()

from .config import OffloadConfig  # noqa: E402  (the ops must be registered first)
from .stats import BudgetStats, OffloadStats, PoolStats, SpillStats  # noqa: E402
from .host import (  # noqa: E402
    budget_stats,
    cumulative_stats,
    empty_pool,
    pool_stats,
    process_stats,
    reserve_host,
    set_host_budget,
    set_host_room,
    set_pool_limit,
)
from .scope import OffloadScope, mark_hidden_state  # noqa: E402
from .patch import check_model, is_patched, offload_hidden_states, patch, unpatch  # noqa: E402
from . import fsdp  # noqa: E402  (FSDP RAM-efficient loading: hsoffload.fsdp.patch())
from .fsdp import patch_initialize_missing_keys_for_fsdp  # noqa: E402

__all__ = [
    "BudgetStats",
    "budget_stats",
    "set_host_budget",
    "OffloadConfig",
    "check_model",
    "is_patched",
    "offload_hidden_states",
    "patch",
    "unpatch",
    "OffloadScope",
    "OffloadStats",
    "PoolStats",
    "cumulative_stats",
    "process_stats",
    "set_pool_limit",
    "SpillStats",
    "empty_pool",
    "fsdp",
    "patch_initialize_missing_keys_for_fsdp",
    "load_library",
    "mark_hidden_state",
    "pool_stats",
    "reserve_host",
    "set_host_room",
]
