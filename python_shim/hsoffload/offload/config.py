"""`OffloadConfig`: every knob of an offload scope, validated once.

The knobs, their defaults, ranges and doc lines live in one table, `hsoffload.options` (the fields below take their
defaults from it and are checked against it by tests/offload/test_options.py). The engine's own config (csrc
`OffloadConfig`, generated from the same table) holds the knobs the engine acts on (sizes, streams, prefetch, spill);
the fields here that it does not have (policy, the layer budget, the head rule, the pool limit, the host budget and
the reservation) are the shim's: the policy decides what to mark, the limits are process-wide and applied when a
scope is entered.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from .. import options
from ..options import PolicyName
from .policy import Policy


def _default(name: str) -> Any:
    """A field whose default is the table's, read when an OffloadConfig is made (an environment variable may set it)."""
    return dataclasses.field(default_factory=lambda: options.default(name))


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Every knob of an offload scope, validated once (docs/usage.md, "Knobs"; the table: hsoffload.options)."""

    min_offload_size: int = _default("min_offload_size")
    offload_cpu_tensors: bool = _default("offload_cpu_tensors")
    pin_memory: bool = _default("pin_memory")
    use_streams: bool = _default("use_streams")
    prefetch_depth: int = _default("prefetch_depth")
    # The pool limit: bound of the process-wide host pool (bytes), applied when the scope is entered and kept for
    # every later scope (None: keep the pool's limit as it is).
    max_pool_bytes: Optional[int] = _default("max_pool_bytes")
    # Host bytes to reserve (pin) in the pool at scope entry, before the first pack (hsoffload.reserve_host): the
    # `hsoffload plan` host figure. None: the pool grows on demand (outside every lock, but during the step).
    reserve_host_bytes: Union[int, str, None] = _default("reserve_host_bytes")
    # Process-wide bound of offloaded bytes in host memory, applied when the scope is entered: bytes, or "auto"
    # (options.AUTO_HOST_BUDGET_FRACTION of MemAvailable at first use / the ranks on the node). Default:
    # $HSOFFLOAD_MAX_HOST_BYTES, else None: keep the process's budget as it is (auto, resolved at first use, unless
    # set_host_budget or a scope set it).
    max_host_bytes: Union[int, str, None] = _default("max_host_bytes")
    # Directory for packs over the host budget (None: they stay on the device). Default: $HSOFFLOAD_SPILL_DIR.
    spill_dir: Optional[str] = _default("spill_dir")
    spill_prefetch_depth: int = _default("spill_prefetch_depth")  # spilled tensors read back ahead of their use
    # When packs outrun the disk and the host budget is full of copies being written out: how long a pack waits for
    # room (ms); past it, or with 0, the tensor stays on the device (counted in kept_on_device_tensors).
    spill_wait_ms: int = _default("spill_wait_ms")
    # Let a later save share an earlier save's host copy beyond one autograd node's saves (a tensor several ops save,
    # a view inside a saved tensor, the chunks of one split): fewer copies and host bytes, but a write that bypasses
    # the version counter (`.data`, a kernel writing through a raw pointer) between two saves then restores the first
    # save's bytes. False: each saved tensor restores the bytes it had at its own save (docs/design.md, "Copy sharing").
    share_copies: bool = _default("share_copies")
    # What is offloaded: the name of a policy ("hidden_states", "sac", "all"; kept as that string, its behaviour is
    # `policy_name`'s, a PolicyName) or a callable
    # (tensor, module_qualified_name) -> bool (see hsoffload.offload.policy and docs/usage.md, "Offload policies").
    policy: Policy = _default("policy")
    keep_last_layers: int = _default("keep_last_layers")  # the last k decoder layers keep their tensors on the device
    offload_fraction: float = _default("offload_fraction")  # share of the other decoder layers (the first) that offload
    offload_output_head: bool = _default("offload_output_head")  # policy "all": also the saves of the output head
    # Policy "auto" (hsoffload.offload.auto): the device bytes a step may peak at (None: the one rule,
    # hsoffload.offload.auto.default_budget), the steps that measure before the first decision, deciding without
    # applying, and where its measurements are kept.
    device_budget: Optional[int] = _default("device_budget")
    auto_calibration_steps: int = _default("auto_calibration_steps")
    auto_report_only: bool = _default("auto_report_only")
    auto_state_path: Optional[str] = _default("auto_state_path")  # measurements saved and reused across restarts

    def __post_init__(self) -> None:
        for option in options.CONFIG_OPTIONS:
            value = options.validate(option, getattr(self, option.name))
            object.__setattr__(self, option.name, value)

    @property
    def policy_name(self) -> Optional[PolicyName]:
        """The named policy, or None for a callable one."""
        return None if callable(self.policy) else PolicyName(self.policy)

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine's options by name (the OffloadScope class constructor's arguments)."""
        return options.engine_kwargs(self)
