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

# Every test here launches processes (tests/durations.json: the measured seconds).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


# The suite in two children of about equal length, so that `make test`'s two workers can run them side by side:
# the planner and policy auto against the emulated allocator (test_device_peak.py, test_auto_emu.py), and everything
# else. Each part with the least number of tests it must pass (today 16 and 112).
PARTS = {
    "planner_vs_allocator": (["tests/device/emu/test_device_peak.py", "tests/device/emu/test_auto_emu.py"], 16),
    "auto_uses_its_budget": (["tests/device/emu/test_auto_uses_budget_emu.py"], 3),
    "streams_faults_offload": (["tests/device/emu", "--ignore", "tests/device/emu/test_device_peak.py",
                                "--ignore", "tests/device/emu/test_auto_emu.py",
                                "--ignore", "tests/device/emu/test_auto_uses_budget_emu.py"], 100),
}


@pytest.mark.skipif(os.environ.get("HSOFFLOAD_EMU_CHILD") == "1", reason="already inside the emulated-device run")
@pytest.mark.parametrize("part", sorted(PARTS))
def test_emulated_device_suite(part: str) -> None:
    env = dict(os.environ, HSOFFLOAD_EMU_CHILD="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-rf", *PARTS[part][0]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    tail = (result.stdout + result.stderr)[-8000:]
    assert result.returncode == 0, tail
    match = re.search(r"(\d+) passed", result.stdout)
    assert match and int(match.group(1)) >= PARTS[part][1], tail
