"""Fixtures of the emulated-device suite. Loads the emulated accelerator into this (child) process.

Run through tests/device/test_emu_device.py (a child pytest, so the main suite's process never gets an accelerator),
or directly: `python -m pytest tests/device/emu` (builds the emulator for the running torch if needed).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hsemu  # noqa: E402

hsemu.load()

# The race window every test runs with unless it sets its own: each queued copy sleeps this long.
DEFAULT_DELAY_US = 300


@pytest.fixture(autouse=True)
def _emu_hygiene():
    """Every test starts with the default delays, unlimited copy rates, on stream 0 and must leave no failed queued job behind."""
    errors_before = hsemu.stats()["job_errors"]
    hsemu.set_copy_delay(DEFAULT_DELAY_US, DEFAULT_DELAY_US, DEFAULT_DELAY_US)
    hsemu.set_copy_rate(0, 0, 0)
    torch.ops.hsemu.set_stream(0)
    yield
    hsemu.synchronize()
    torch.ops.hsemu.set_stream(0)
    assert hsemu.stats()["job_errors"] == errors_before, "a queued copy failed on the emulated device (see stderr)"


@pytest.fixture
def dev() -> torch.device:
    return torch.device(hsemu.DEVICE, 0)
