"""Runs the transformers-facing suites again under every extra transformers version of the matrix.

Each `.deps/<name>` installed by tests/install_extra_transformers.sh (from
tests/extra_transformers.txt) is prepended to PYTHONPATH of a child pytest, so `make test` covers
both the venv's transformers and e.g. 4.57.6. The child first proves which version it imports, so
the matrix cannot silently rerun the venv's version.
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
REQUIREMENTS = ROOT / "tests" / "extra_transformers.txt"
# Suites that need only transformers + peft (Trainer pulls datasets, which pins newer hubs).
# In two groups, each a child of its own, so that pytest-xdist runs them side by side.
SUITES = {"models": ["tests/offload/test_transformers_models.py", "tests/offload/test_patch.py",
                     "tests/offload/test_layer_hooks.py", "tests/offload/test_policies.py"],
          "auto": ["tests/offload/auto/test_auto_versions.py", "tests/offload/auto/test_auto_budget.py",
                   "tests/offload/auto/test_auto_cpu.py"]}
# Entries of extra_transformers.txt this matrix runs (others are used by their own suites).
MATRIX = ("tf457",)


def _pinned_versions() -> dict[str, str]:
    versions = {}
    for line in REQUIREMENTS.read_text().splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        match = next((re.fullmatch(r"transformers==(\S+)", f) for f in fields[1:] if f.startswith("transformers==")), None)
        if match:
            versions[fields[0]] = match.group(1)
    return versions


def _child_env(deps: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(deps), env.get("PYTHONPATH", "")) if p)
    env["HSOFFLOAD_MATRIX_CHILD"] = "1"
    return env


@pytest.mark.skipif(os.environ.get("HSOFFLOAD_MATRIX_CHILD") == "1", reason="already inside a matrix run")
@pytest.mark.parametrize("group", sorted(SUITES))
@pytest.mark.parametrize("name", MATRIX)
def test_suites_under_extra_transformers(name: str, group: str) -> None:
    version = _pinned_versions().get(name)
    assert version, f"{name} has no transformers== pin in {REQUIREMENTS}"
    deps = ROOT / ".deps" / name
    if not (deps / ".stamp").exists():
        pytest.skip(f"{deps} not installed; run: bash tests/install_extra_transformers.sh (make test does)")
    env = _child_env(deps)
    probe = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert probe.stdout.strip() == version, probe.stdout + probe.stderr
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITES[group]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, f"transformers {version}:\n{tail}"
    assert re.search(r"\d+ passed", result.stdout), tail
