"""Integrations of hidden-state offload with training frameworks, together:

- `trainer`: HF `Trainer` / TRL (`HiddenStateOffloadMixin`, `enable_hidden_state_offload`);
- `axolotl`: the drop-in for Axolotl's hidden-state offload module, also importable as `hsoffload.axolotl`;
- `axolotl_plugin`: the Axolotl plugin, also importable as `hsoffload.axolotl_plugin` (the name configs use).

The Axolotl modules are imported on demand (their names are aliases of these modules)."""

from .trainer import (
    HiddenStateOffloadMixin,
    enable_hidden_state_offload,
    offload_log_values,
    with_hidden_state_offload,
)

__all__ = [
    "HiddenStateOffloadMixin",
    "enable_hidden_state_offload",
    "offload_log_values",
    "with_hidden_state_offload",
]
