"""The three ways one storage's bytes reach two saves with a write between them that bumps no version counter
(`.data`, a kernel writing through a raw pointer): the copy-sharing cases of docs/design.md ("Copy sharing"), shared
by the CPU tests (tests/engine/test_core.py) and the emulated device's (tests/device/emu/test_offload_emu.py)."""

from __future__ import annotations

import torch

# two separate slices of one output, the two halves of one chunk(), the whole output and then one half
STALE_CASES = ("slices", "chunk", "whole_then_half")


def two_saves(base: torch.Tensor, case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and the second tensor saved, for `case`; the second's bytes are the ones rewritten between."""
    if case == "whole_then_half":
        return base, base[:, base.shape[1] // 2:]
    if case == "chunk":
        first, second = base.chunk(2, dim=1)
        return first, second
    half = base.shape[1] // 2
    return base[:, :half], base[:, half:]
