"""Builds and runs the C++ engine tests (tests/engine/cpp) with CMake + ctest against the installed torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Every test here launches processes (tests/durations.json: the measured seconds).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_cpp_engine_tests_pass() -> None:
    cmake = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
    if not Path(cmake).exists() and shutil.which(cmake) is None:
        pytest.fail("cmake not found: install it (pip install cmake) to build the C++ engine tests")
    build = ROOT / "build" / "cpp-tests"
    generator = ["-G", "Ninja"] if shutil.which("ninja") or (Path(sys.executable).parent / "ninja").exists() else []
    env_path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    env = dict(os.environ, PATH=env_path)
    subprocess.run(
        [cmake, "-S", str(ROOT), "-B", str(build), *generator, "-DHSOFFLOAD_BUILD_TESTS=ON",
         f"-DHSOFFLOAD_PYTHON={sys.executable}"],
        check=True, capture_output=True, text=True, env=env,
    )
    built = subprocess.run([cmake, "--build", str(build)], capture_output=True, text=True, env=env)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    ctest = shutil.which("ctest", path=env_path) or "ctest"
    run = subprocess.run([ctest, "--test-dir", str(build), "--output-on-failure"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
