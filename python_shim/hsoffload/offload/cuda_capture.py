"""Graph capture (CUDA graphs, torch.compile "reduce-overhead", captured layers): whether the pack hook must tell the
engine that the current stream is capturing.

torch >= 2.13 lets the engine ask the device guard itself (`DeviceGuardImplInterface::isStreamCapturing`), and then
nothing is probed here. On torch 2.11-2.12 the engine cannot tell, so the pack hook asks the accelerator's Python
module (`torch.cuda.is_current_stream_capturing()`, or the same function of a PrivateUse1 backend's module) and
passes `offload_pack(..., capturing=True)`. Thread-safety: the probe is chosen once per process (a lock-free race
chooses the same one twice) and is itself thread-safe.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import engine as _engine

_UNSET = object()
_probe: object = _UNSET


def _choose_probe() -> Optional[Callable[[], bool]]:
    if _engine.engine_detects_capture():
        return None
    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else None
    if current is None:
        return None
    module = getattr(torch, current.type, None)
    query = getattr(module, "is_current_stream_capturing", None)
    available = getattr(module, "is_available", None)
    # A CUDA wheel on a machine without a driver still names CUDA as the accelerator: asking it would fail.
    if query is None or available is None or not available():
        return None
    return query


def capture_probe() -> Optional[Callable[[], bool]]:
    """A callable that tells whether the current stream is capturing, or None when the engine tells it itself (or
    no accelerator can capture)."""
    global _probe  # process-wide: the answer depends only on the torch build and the machine
    if _probe is _UNSET:
        _probe = _choose_probe()
    return _probe  # type: ignore[return-value]


def set_capture_probe_for_tests(probe: Optional[Callable[[], bool]]) -> None:
    """Replaces the probe (tests of the torch < 2.13 route on machines without an accelerator)."""
    global _probe  # see capture_probe
    _probe = probe
