"""`OffloadConfig`: every knob of an offload scope, validated once, and the byte-size parser the knobs share.

The engine's own config (csrc `OffloadConfig`) holds the knobs the engine acts on (sizes, streams, prefetch, spill);
the fields here that it does not have (policy, the layer budget, the head rule, the pool limit and host budget) are
the shim's: the policy decides what to mark, the limits are process-wide and applied when a scope is entered.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional, Union

from .policy import Policy, validate_policy

_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_bytes(value: Union[int, str], what: str) -> Union[int, str]:
    """`value` as an int of bytes, or "auto". Accepts ints and strings like "64GiB", "500MB", "1e9" is refused."""
    if isinstance(value, bool):
        raise ValueError(f"hsoffload: {what} must be bytes (an int or a string like '64GiB') or 'auto', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"hsoffload: {what} must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        m = _BYTES.match(value)
        if m:
            unit = m.group(2).lower()
            base = 1024 if (m.group(3) or "").lower() == "ib" or not m.group(3) else 1000
            return int(float(m.group(1)) * base ** " kmgt".index(unit or " "))
    raise ValueError(f"hsoffload: {what} must be bytes (an int or a string like '64GiB') or 'auto', got {value!r}")


def _env_max_host_bytes() -> Union[int, str, None]:
    value = os.environ.get("HSOFFLOAD_MAX_HOST_BYTES")
    return None if value is None else parse_bytes(value, "HSOFFLOAD_MAX_HOST_BYTES")


def _env_spill_dir() -> Optional[str]:
    return os.environ.get("HSOFFLOAD_SPILL_DIR") or None


_MAX_SPILL_WAIT_MS = 3600 * 1000  # the engine's bound (OffloadConfig::kMaxSpillWaitMs)

@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Every knob of an offload scope, validated once."""

    min_offload_size: int = 1024
    offload_cpu_tensors: bool = False
    pin_memory: bool = True
    use_streams: bool = True
    prefetch_depth: int = 1
    # The pool limit: bound of the process-wide host pool (bytes), applied when the scope is entered and kept for
    # every later scope (None: keep the pool's limit as it is).
    max_pool_bytes: Optional[int] = None
    # Host bytes to reserve (pin) in the pool at scope entry, before the first pack (hsoffload.reserve_host): the
    # `hsoffload plan` host figure. None: the pool grows on demand (outside every lock, but during the step).
    reserve_host_bytes: Union[int, str, None] = None
    # Process-wide bound of offloaded bytes in host memory, applied when the scope is entered: bytes, or "auto"
    # (80 % of MemAvailable at first use / LOCAL_WORLD_SIZE). Default: $HSOFFLOAD_MAX_HOST_BYTES, else None: keep
    # the process's budget as it is (auto, resolved at first use, unless set_host_budget or a scope set it).
    max_host_bytes: Union[int, str, None] = dataclasses.field(default_factory=_env_max_host_bytes)
    # Directory for packs over the host budget (None: they stay on the device). Default: $HSOFFLOAD_SPILL_DIR.
    spill_dir: Optional[str] = dataclasses.field(default_factory=_env_spill_dir)
    spill_prefetch_depth: int = 2  # spilled tensors read back ahead of their use in backward
    # When packs outrun the disk and the host budget is full of copies being written out: how long a pack waits for
    # room (ms); past it, or with 0, the tensor stays on the device (counted in kept_on_device_tensors).
    spill_wait_ms: int = 30000
    # Let a later save share an earlier save's host copy beyond one autograd node's saves (a tensor several ops save,
    # a view inside a saved tensor, the chunks of one split): fewer copies and host bytes, but a write that bypasses
    # the version counter (`.data`, a kernel writing through a raw pointer) between two saves then restores the first
    # save's bytes. False: each saved tensor restores the bytes it had at its own save (docs/design.md, "Copy sharing").
    share_copies: bool = False
    # What is offloaded: "hidden_states", "sac", "all", or a callable (tensor, module_qualified_name) -> bool
    # (see hsoffload.policy and docs/usage.md, "Offload policies").
    policy: Policy = "hidden_states"
    keep_last_layers: int = 0  # the last k decoder layers keep their tensors on the device
    offload_fraction: float = 1.0  # share of the other decoder layers (the first ones) that offload
    offload_output_head: bool = False  # policy "all": also the saves outside decoder layers after one ran (the head)

    def __post_init__(self) -> None:
        validate_policy(self.policy)
        if not isinstance(self.offload_fraction, (int, float)) or isinstance(self.offload_fraction, bool) or not (
            0.0 <= float(self.offload_fraction) <= 1.0
        ):
            raise ValueError(f"hsoffload: offload_fraction must be a number in [0, 1], got {self.offload_fraction!r}")
        if not isinstance(self.offload_output_head, bool):
            raise TypeError(f"hsoffload: offload_output_head must be a bool, got {self.offload_output_head!r}")
        if self.max_host_bytes is not None:
            object.__setattr__(self, "max_host_bytes", parse_bytes(self.max_host_bytes, "max_host_bytes"))
        if self.reserve_host_bytes is not None:
            value = parse_bytes(self.reserve_host_bytes, "reserve_host_bytes")
            if value == "auto":
                raise ValueError("hsoffload: reserve_host_bytes must be bytes (an int or a string like '8GiB'), "
                                 "got 'auto'")
            object.__setattr__(self, "reserve_host_bytes", value)
        if self.spill_dir is not None:
            if not isinstance(self.spill_dir, (str, os.PathLike)) or not str(self.spill_dir):
                raise ValueError(f"hsoffload: spill_dir must be a directory path or None, got {self.spill_dir!r}")
            object.__setattr__(self, "spill_dir", os.fspath(self.spill_dir))
        for name in ("min_offload_size", "prefetch_depth", "spill_prefetch_depth", "spill_wait_ms", "keep_last_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"hsoffload: {name} must be a non-negative int, got {value!r}")
        if self.spill_wait_ms > _MAX_SPILL_WAIT_MS:
            raise ValueError(f"hsoffload: spill_wait_ms must be at most {_MAX_SPILL_WAIT_MS} (one hour), got "
                             f"{self.spill_wait_ms}")
        for name in ("offload_cpu_tensors", "pin_memory", "use_streams", "share_copies"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"hsoffload: {name} must be a bool, got {getattr(self, name)!r}")
        if self.max_pool_bytes is not None and (
            not isinstance(self.max_pool_bytes, int) or isinstance(self.max_pool_bytes, bool) or self.max_pool_bytes < 0
        ):
            raise ValueError(f"hsoffload: max_pool_bytes must be None or a non-negative int, got {self.max_pool_bytes!r}")
