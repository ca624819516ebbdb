"""`make test`'s spread over pytest-xdist workers: a module whose tests share one expensive fixture (a 2-rank launch)
runs on one worker, so that fixture is set up once (tests/support/scheduling.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Every test here launches processes (tests/durations.json: the measured seconds).
pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1]

CONFTEST = """
import pytest
from support.scheduling import make_scheduler

@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return make_scheduler(config, log, ("test_a_shared.py",))
"""

SHARED = """
import os
import pytest

@pytest.fixture(scope="module")
def launch():
    with open(os.environ["LAUNCHES"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.parametrize("i", range(6))
def test_case(launch, i):
    pass
"""

OTHER = """
import pytest

@pytest.mark.parametrize("i", range(6))
def test_other(i):
    pass
"""


def test_a_module_with_a_shared_fixture_runs_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_a_shared.py").write_text(SHARED)
    (tmp_path / "test_b_other.py").write_text(OTHER)
    launches = tmp_path / "launches.txt"
    env = {**os.environ, "PYTHONPATH": str(TESTS), "LAUNCHES": str(launches)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "."],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "12 passed" in proc.stdout, proc.stdout
    assert launches.read_text().splitlines() == [launches.read_text().split()[0]], (
        f"the shared module fixture was set up once per worker that ran one of its tests: {launches.read_text()!r}"
    )
