"""The suite's measured durations (tests/durations.json) and the check of the `slow` mark against them.

A test is marked `slow` on itself (`@pytest.mark.slow`, or `pytestmark = pytest.mark.slow` for a whole module);
`make test-fast` (`pytest -m "not slow"`) leaves those out. tests/tools/test_slow_marks.py fails when a test that
took longer than SLOW_OVER_S in the recorded run is not marked, and when the unmarked tests add up to more than
FAST_BUDGET_S. Every key is a pytest node id, so a moved or renamed test is simply unrecorded until the next refresh.

Refresh (after adding a test, moving one, or making one faster), on an otherwise idle machine:
`make test-durations` (the whole suite, one worker per core, `--record-durations`; about 6 minutes on 2 cores).
`pytest --record-durations tests/some/test_file.py` refreshes only the ids it runs and keeps the others.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"
# A test longer than this (setup, call and teardown together; seconds on the 2-core machine that recorded the file,
# with one pytest-xdist worker per core) must be marked slow.
SLOW_OVER_S = 5.0
# `make test-fast`'s pytest must stay within 2 minutes of wall time on that machine: the unmarked tests' recorded
# seconds, spread over its workers, plus pytest-xdist's start (each worker collects the suite).
FAST_BUDGET_S = 120.0
FAST_WORKERS = 2
WORKER_START_S = 15.0

# Where the collection hook puts {node id: marked slow} for tests/tools/test_slow_marks.py.
MARKS_KEY = pytest.StashKey[dict]()


def load(path: Path = DURATIONS) -> dict[str, Any]:
    """The recorded file: {"recorded": {...how...}, "seconds": {node id: seconds}}."""
    return json.loads(path.read_text())


def marks_of(items: list[pytest.Item]) -> dict[str, bool]:
    """{node id: whether the test carries the `slow` mark} for the collected items."""
    return {item.nodeid: item.get_closest_marker("slow") is not None for item in items}


def unmarked_slow(marked: dict[str, bool], seconds: dict[str, float]) -> list[tuple[str, float]]:
    """The collected tests recorded over SLOW_OVER_S that do not carry the mark, longest first."""
    late = [(nodeid, seconds[nodeid]) for nodeid, slow in marked.items()
            if not slow and seconds.get(nodeid, 0.0) > SLOW_OVER_S]
    return sorted(late, key=lambda pair: -pair[1])


def fast_wall_s(marked: dict[str, bool], seconds: dict[str, float]) -> float:
    """What `make test-fast`'s pytest should take: the unmarked tests' seconds over FAST_WORKERS, plus the start."""
    return sum(seconds.get(nodeid, 0.0) for nodeid, slow in marked.items() if not slow) / FAST_WORKERS + WORKER_START_S


class Recorder:
    """`--record-durations`: adds up each test's setup, call and teardown seconds (in the controller under
    pytest-xdist, which forwards every report) and merges them into tests/durations.json at the end."""

    def __init__(self, path: Path, args: list[str]) -> None:
        self.path = path
        self.args = args
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput") or not self.seconds:
            return  # a pytest-xdist worker: the controller writes
        old = load(self.path)["seconds"] if self.path.is_file() else {}
        merged = {**old, **{nodeid: round(s, 2) for nodeid, s in self.seconds.items()}}
        recorded = {
            "how": "pytest " + " ".join(self.args),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
            "note": "seconds = setup + call + teardown per node id; how/when/machine: the last refresh, which kept the"
                    " ids it did not run; refresh: tests/support/durations.py",
        }
        self.path.write_text(json.dumps({"recorded": recorded, "seconds": dict(sorted(merged.items()))}, indent=0)
                             + "\n")
