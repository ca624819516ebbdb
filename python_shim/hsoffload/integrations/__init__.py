"""Integrations of hidden-state offload with training frameworks (HF Trainer / TRL; Axolotl lives in
`hsoffload.axolotl` and `hsoffload.axolotl_plugin`)."""

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
