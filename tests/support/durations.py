"""The suite's measured durations (tests/durations.json) and the check of the `slow` mark against them.

A test is marked `slow` on itself (`@pytest.mark.slow`, or `pytestmark = pytest.mark.slow` for a whole module);
`make test-fast` (`pytest -m "not slow"`) leaves those out. tests/tools/test_slow_marks.py fails when a test that is
slow by the recorded run is not marked, and when the unmarked tests add up to more than FAST_BUDGET_S. Every key is
a pytest node id, so a moved or renamed test is simply unrecorded until the next refresh.

Each test has two figures: its wall seconds and its CPU seconds (its process's and the children it waited for,
setup to teardown). On a 2-core machine shared with other work the wall seconds of a CPU-bound test stretch with the
load, its CPU seconds hardly: a test is slow when its CPU seconds pass SLOW_OVER_S, or its wall seconds pass
WAIT_OVER_S (a test that mostly waits: sleeps, timeouts, a launch).

Refresh (after adding a test, moving one, or making one faster), preferably on an otherwise idle machine:
`make test-durations` (the whole suite, one worker per core, `--record-durations`; about 6 minutes on 2 cores idle).
`pytest -n 2 --record-durations tests/some/test_file.py` refreshes only the ids it runs and keeps the others.
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
# A test over either (setup, call and teardown together, on the 2-core machine that recorded the file, one
# pytest-xdist worker per core) must be marked slow.
SLOW_OVER_S = 5.0
WAIT_OVER_S = 15.0
# `make test-fast`'s pytest must stay within 2 minutes of wall time on that machine idle: the unmarked tests' CPU
# seconds, spread over its workers, plus pytest-xdist's start (each worker collects the suite).
FAST_BUDGET_S = 120.0
FAST_WORKERS = 2
WORKER_START_S = 15.0

# Where the collection hook puts {node id: marked slow} for tests/tools/test_slow_marks.py.
MARKS_KEY = pytest.StashKey[dict]()
# Where the recorder keeps a test's CPU seconds at its setup.
_CPU_START = pytest.StashKey[float]()


def load(path: Path = DURATIONS) -> dict[str, Any]:
    """The recorded file: {"recorded": {...how...}, "seconds": {node id: wall s}, "cpu_seconds": {node id: CPU s}}."""
    return json.loads(path.read_text())


def marks_of(items: list[pytest.Item]) -> dict[str, bool]:
    """{node id: whether the test carries the `slow` mark} for the collected items."""
    return {item.nodeid: item.get_closest_marker("slow") is not None for item in items}


def unmarked_slow(marked: dict[str, bool], data: dict[str, Any]) -> list[tuple[str, float, float]]:
    """The collected tests the recorded run found slow that do not carry the mark: (id, CPU s, wall s), longest
    first. A test with no CPU figure (recorded before there were) is judged by its wall seconds alone."""
    wall, cpu = data["seconds"], data.get("cpu_seconds", {})
    late = []
    for nodeid, slow in marked.items():
        if slow or nodeid not in wall:
            continue
        own = cpu.get(nodeid, wall[nodeid])
        if own > SLOW_OVER_S or wall[nodeid] > WAIT_OVER_S:
            late.append((nodeid, own, wall[nodeid]))
    return sorted(late, key=lambda entry: -entry[1])


def fast_wall_s(marked: dict[str, bool], data: dict[str, Any]) -> float:
    """What `make test-fast`'s pytest should take idle: the unmarked tests' CPU seconds (else wall) over
    FAST_WORKERS, plus the start."""
    wall, cpu = data["seconds"], data.get("cpu_seconds", {})
    own = sum(cpu.get(nodeid, wall.get(nodeid, 0.0)) for nodeid, slow in marked.items() if not slow)
    return own / FAST_WORKERS + WORKER_START_S


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class Recorder:
    """`--record-durations`: each test's wall seconds (setup, call and teardown reports) and CPU seconds (measured in
    the process that runs it, a pytest-xdist worker or this one, and sent with its teardown report), merged into
    tests/durations.json at the end by the controller."""

    def __init__(self, path: Path, args: list[str]) -> None:
        self.path = path
        self.args = args
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Any:
        item.stash[_CPU_START] = _cpu_s()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Any:
        yield
        if _CPU_START in item.stash:  # the teardown report, made after this, carries the item's user_properties
            item.user_properties.append(("cpu_s", _cpu_s() - item.stash[_CPU_START]))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        for name, value in report.user_properties:
            if name == "cpu_s" and report.when == "teardown":
                self.cpu[report.nodeid] = value

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput") or not self.seconds:
            return  # a pytest-xdist worker: the controller writes
        old = load(self.path) if self.path.is_file() else {}
        wall = {**old.get("seconds", {}), **{nodeid: round(s, 2) for nodeid, s in self.seconds.items()}}
        cpu = {**old.get("cpu_seconds", {}), **{nodeid: round(s, 2) for nodeid, s in self.cpu.items()}}
        recorded = {
            "how": "pytest " + " ".join(self.args),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
            "load": "1/5/15-minute load average at the end: " + " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "note": "seconds: wall, setup + call + teardown per node id; cpu_seconds: the process's and its waited-for"
                    " children's; how/when/machine/load: the last refresh, which kept the ids it did not run;"
                    " refresh: tests/support/durations.py",
        }
        data = {"recorded": recorded, "seconds": dict(sorted(wall.items())), "cpu_seconds": dict(sorted(cpu.items()))}
        self.path.write_text(json.dumps(data, indent=0) + "\n")

