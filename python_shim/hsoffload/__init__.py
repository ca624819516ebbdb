"""hsoffload: hidden-state offload for gradient-checkpointed training, and RAM-efficient loading.

The package by concept (docs/design.md, "Layout"):

- `hsoffload.offload`: the offload scope, its config and policies, the transformers patch, the host pool and budget;
- `hsoffload.loading`: RAM-efficient loading (`hsoffload.fsdp`, `hsoffload.zero3_loading`);
- `hsoffload.planning`: `hsoffload plan` (arithmetic on a config.json: needs neither torch nor the op library);
- `hsoffload.tools`: the `hsoffload` command, demo and benchmarks;
- `hsoffload.integrations`: HF Trainer/TRL, Axolotl (`hsoffload.axolotl`, `hsoffload.axolotl_plugin`), DeepSpeed.

`import hsoffload` is cheap: it imports neither torch nor the op library. The names below are resolved on first use,
and the offload and loading wings load the op library (`torch.ops.hsoffload`) when first imported. TorchScript code
that calls the ops without touching the Python API first calls `hsoffload.load_library()` before
`torch.jit.script` / `torch.jit.load`.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from ._loader import load_library
from ._logging import install_default_handler

logger = logging.getLogger("hsoffload")
install_default_handler()  # warnings reach stderr even when the application configured no logging

__version__ = "0.1.0"

# The public API: name -> the module that defines it (a name mapped to itself: that module). What is not here nor
# one of the alias modules (fsdp, zero3_loading, axolotl, axolotl_plugin, plan) is private and may move.
_PUBLIC: dict[str, str] = {
    "OffloadConfig": "offload.config",
    "OffloadScope": "offload.scope",
    "mark_hidden_state": "offload.scope",
    "check_model": "offload.patch",
    "is_patched": "offload.patch",
    "offload_hidden_states": "offload.patch",
    "patch": "offload.patch",
    "unpatch": "offload.patch",
    "budget_stats": "offload.host",
    "cumulative_stats": "offload.host",
    "empty_pool": "offload.host",
    "pool_stats": "offload.host",
    "process_stats": "offload.host",
    "reserve_host": "offload.host",
    "set_host_budget": "offload.host",
    "set_host_room": "offload.host",
    "set_pool_limit": "offload.host",
    "BudgetStats": "stats",
    "OffloadStats": "stats",
    "PoolStats": "stats",
    "SpillStats": "stats",
    "patch_initialize_missing_keys_for_fsdp": "loading.fsdp",
    # Modules (a name that is its module's own: the module itself): the wings, and the public aliases of modules
    # inside them (the same module object under both names).
    "offload": "offload",
    "loading": "loading",
    "planning": "planning",
    "tools": "tools",
    "integrations": "integrations",
    "options": "options",
    "stats": "stats",
    "targets": "targets",
    "fsdp": "fsdp",
    "zero3_loading": "zero3_loading",
    "plan": "plan",
    "axolotl": "axolotl",
    "axolotl_plugin": "axolotl_plugin",
}

__all__ = sorted([*_PUBLIC, "load_library"])


def __getattr__(name: str) -> Any:
    """Resolves a public name on first use (PEP 562) and keeps it in the package's namespace."""
    home = _PUBLIC.get(name)
    if home is None:
        raise AttributeError(f"module 'hsoffload' has no attribute {name!r}")
    module = importlib.import_module(f".{home}", __name__)
    value = module if home == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
