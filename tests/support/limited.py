"""Run a Python script in a child process whose address space is capped (`RLIMIT_AS`) and whose run is timed out, so
that a regression that grows without end (issue 52, item 6: a walk over a mock object) fails as a MemoryError in the
child instead of bringing the OOM killer onto a machine shared with others."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import hsoffload

GIB = 1 << 30


def _cap(address_space: int) -> Callable[[], None]:
    def apply() -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    return apply


def run_python(script: Path, args: Sequence[str], *, address_space: int, timeout: float,
               env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    """`python script args...` with at most `address_space` bytes of virtual memory and `timeout` seconds (output
    captured; raises subprocess.TimeoutExpired past the timeout). The package is importable as in this process."""
    full_env = dict(os.environ)
    full_env.pop("PYTEST_XDIST_WORKER", None)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(hsoffload.__file__).resolve().parents[1])] + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH")
                                                                else []))
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(script), *args], env=full_env, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=_cap(address_space))
