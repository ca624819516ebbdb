"""Loading the op library: found once, and a clear error when missing or built for another torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hsoffload


def _import_in_subprocess(env_updates: dict[str, str], cwd: Path,
                          code: str = "import hsoffload; hsoffload.OffloadScope") -> subprocess.CompletedProcess:
    """Runs `code` in a fresh process: by default the first use of an offload feature, which loads the library
    (`import hsoffload` alone loads none)."""
    env = dict(os.environ, **env_updates)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )


def _another_build() -> dict[str, str]:
    """A supported build that is not the running one (on the GPU image, torch 2.11.0 with CUDA 13.0 *is* the running
    one): the torch release differs, so the loader must refuse it whatever CUDA either was built with."""
    running = torch.__version__.split("+")[0]
    torch_version = next(v for v in ("2.11.0", "2.14.1") if v != running)
    return {"torch": torch_version, "cuda": "13.0"}


@pytest.mark.slow
def test_mismatched_build_is_refused_with_versions_and_rebuild_command(tmp_path: Path) -> None:
    lib = tmp_path / "libhsoffload.so"
    shutil.copy(hsoffload.load_library(), lib)
    other = _another_build()
    (tmp_path / "_build_info.json").write_text(json.dumps(other))
    out = _import_in_subprocess({"HSOFFLOAD_LIBRARY": str(lib)}, tmp_path)
    assert out.returncode != 0, out.stderr
    assert f"built for torch {other['torch']} (CUDA 13.0)" in out.stderr
    assert f"running torch {torch.__version__}" in out.stderr
    assert "pip install --no-build-isolation" in out.stderr


@pytest.mark.slow
def test_missing_library_names_places_and_command(tmp_path: Path) -> None:
    # A copy of the package without its library, outside any checkout.
    pkg = tmp_path / "hsoffload"
    shutil.copytree(Path(hsoffload.__file__).parent, pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    env = {"PYTHONPATH": str(tmp_path), "HSOFFLOAD_LIBRARY": str(tmp_path / "nowhere.so")}
    out = _import_in_subprocess(env, tmp_path)
    assert out.returncode != 0
    assert "libhsoffload.so was not found" in out.stderr and "nowhere.so" in out.stderr
    assert "Build it with" in out.stderr
    # The package itself imports, and its planner runs, without the library.
    out = _import_in_subprocess(env, tmp_path, "import hsoffload, hsoffload.plan; print(hsoffload.plan.plan)")
    assert out.returncode == 0, out.stderr


def test_load_is_idempotent() -> None:
    assert hsoffload.load_library() == hsoffload.load_library()
