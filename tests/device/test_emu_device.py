"""Runs tests/device/emu (hsoffload's accelerator path on the emulated asynchronous device) in a child pytest.

The emulated device registers itself as the process's accelerator (PrivateUse1: pinned memory, torch.accelerator),
so it lives in a process of its own and the rest of the suite keeps a CPU-only process. The child builds
libhsoffload_emu.so for the running torch (tests/device/emu/hsemu.py) and runs every copy with a delay.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.environ.get("HSOFFLOAD_EMU_CHILD") == "1", reason="already inside the emulated-device run")
def test_emulated_device_suite() -> None:
    env = dict(os.environ, HSOFFLOAD_EMU_CHILD="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "tests/device/emu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    tail = (result.stdout + result.stderr)[-8000:]
    assert result.returncode == 0, tail
    match = re.search(r"(\d+) passed", result.stdout)
    assert match and int(match.group(1)) >= 30, tail
