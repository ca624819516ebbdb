"""The `slow` marks against the measured durations (tests/durations.json; tests/support/durations.py says how to
refresh it): every test over SLOW_OVER_S CPU seconds or WAIT_OVER_S wall seconds carries the mark, and what `make
test-fast` runs fits its 2-minute budget. Keyed by node id: a test moved or added since the file was recorded is not
judged until the refresh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import durations as D

TESTS = Path(__file__).resolve().parents[1]


def _marks(config: pytest.Config, recorded: dict[str, float]) -> dict[str, bool]:
    """{node id: marked slow} for every test of the suite: from this session's collection when it collected every
    recorded module that still exists (`make test`, `make test-fast`), else from a child collecting the suite."""
    marked = config.stash.get(D.MARKS_KEY, {})
    files = {nodeid.split("::", 1)[0] for nodeid in recorded}
    wanted = {f for f in files if (TESTS.parent / f).is_file()}
    if wanted <= {nodeid.split("::", 1)[0] for nodeid in marked}:
        return marked
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"hsoffload-marks-{os.getpid()}.json"
    env = dict(os.environ, HSOFFLOAD_MARKS_JSON=str(out))
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "-p", "no:xdist", str(TESTS)], cwd=TESTS.parent, env=env, capture_output=True,
                            text=True, timeout=300)
    assert out.is_file(), (result.stdout + result.stderr)[-4000:]
    try:
        return json.loads(out.read_text())
    finally:
        out.unlink()


def _why(nodeid: str, cpu: float, wall: float, recorded: dict) -> str:
    return (f"{nodeid} took {cpu:.1f} CPU s, {wall:.1f} s wall (over {D.SLOW_OVER_S:.0f} CPU s or {D.WAIT_OVER_S:.0f} s"
            f" wall; tests/durations.json, {recorded['when']}, {recorded['machine']}) and is not marked slow")


def test_every_slow_test_is_marked_slow(request: pytest.FixtureRequest) -> None:
    data = D.load()
    late = D.unmarked_slow(_marks(request.config, data["seconds"]), data)
    assert not late, (
        "\n".join(_why(nodeid, cpu, wall, data["recorded"]) for nodeid, cpu, wall in late)
        + "\nmark each with @pytest.mark.slow (a whole module: pytestmark = pytest.mark.slow), or make it faster and"
          " refresh tests/durations.json (make test-durations)"
    )


def test_the_unmarked_tests_fit_make_test_fast(request: pytest.FixtureRequest) -> None:
    data = D.load()
    marked = _marks(request.config, data["seconds"])
    wall = D.fast_wall_s(marked, data)
    cpu = data.get("cpu_seconds", {})
    longest = sorted(((cpu.get(n, s), n) for n, s in data["seconds"].items() if n in marked and not marked[n]),
                     reverse=True)[:5]
    assert wall <= D.FAST_BUDGET_S, (
        f"`make test-fast` would take about {wall:.0f} s (the unmarked tests' recorded CPU seconds over "
        f"{D.FAST_WORKERS} workers, plus {D.WORKER_START_S:.0f} s to start), over its {D.FAST_BUDGET_S:.0f} s budget; "
        f"the longest unmarked: {longest}. Mark some slow, or make them faster."
    )


def test_the_check_names_an_unmarked_slow_test() -> None:
    marked = {"tests/a.py::test_busy": False, "tests/a.py::test_waits": False, "tests/a.py::test_marked": True,
              "tests/a.py::test_short": False, "tests/a.py::test_old": False}
    data = {"seconds": {"tests/a.py::test_busy": D.SLOW_OVER_S + 3, "tests/a.py::test_waits": D.WAIT_OVER_S + 1,
                        "tests/a.py::test_marked": 60.0, "tests/a.py::test_short": D.SLOW_OVER_S + 2,
                        "tests/a.py::test_old": D.SLOW_OVER_S + 1, "tests/gone.py::test_moved": 99.0},
            "cpu_seconds": {"tests/a.py::test_busy": D.SLOW_OVER_S + 1, "tests/a.py::test_waits": 0.5,
                            "tests/a.py::test_marked": 60.0, "tests/a.py::test_short": 1.0}}
    # busy: over in CPU seconds; waits: over in wall seconds; short: stretched wall, little CPU (a loaded machine);
    # old: no CPU figure, judged by its wall seconds.
    assert [nodeid for nodeid, _, _ in D.unmarked_slow(marked, data)] == [
        "tests/a.py::test_busy", "tests/a.py::test_old", "tests/a.py::test_waits"]
    own = (D.SLOW_OVER_S + 1) + 0.5 + 1.0 + (D.SLOW_OVER_S + 1)
    assert D.fast_wall_s(marked, data) == pytest.approx(own / D.FAST_WORKERS + D.WORKER_START_S)
