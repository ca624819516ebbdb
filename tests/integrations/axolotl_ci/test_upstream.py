"""Axolotl's own unit tests for its hidden-state offload module, run against `hsoffload.axolotl`.

The test files come from the source distribution of the Axolotl version installed here (downloaded from the package
index at test time; nothing of Axolotl is committed). They run twice in child pytests: as shipped (against Axolotl's
module: proves they run here) and with `axolotl.monkeypatch.checkpoint_activation_offload` resolved to
`hsoffload.axolotl`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

import pytest

UPSTREAM_TESTS = ("tests/monkeypatch/test_checkpoint_activation_offload.py",)
REDIRECT = '''
import sys
import hsoffload.axolotl
sys.modules["axolotl.monkeypatch.checkpoint_activation_offload"] = hsoffload.axolotl
'''


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    version = metadata.version("axolotl")
    dl = tmp_path_factory.mktemp("sdist")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", f"axolotl=={version}", "--no-binary", ":all:", "--no-deps",
         "--no-build-isolation", "-d", str(dl)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"could not download the axolotl {version} sdist:\n{proc.stderr[-3000:]}"
    (sdist,) = dl.glob("axolotl-*.tar.gz")
    out = tmp_path_factory.mktemp("upstream")
    with tarfile.open(sdist) as tar:
        for name in UPSTREAM_TESTS:
            member = tar.getmember(f"axolotl-{version}/{name}")
            member.name = Path(name).name
            tar.extract(member, out, filter="data")
    return out


def _pytest(directory: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(directory)],
        capture_output=True, text=True, timeout=600, env=env, cwd=directory,
    )


def test_axolotls_tests_pass_against_axolotl(upstream: Path) -> None:
    proc = _pytest(upstream)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_axolotls_tests_pass_against_hsoffload(upstream: Path, tmp_path: Path) -> None:
    for f in upstream.glob("test_*.py"):
        (tmp_path / f.name).write_text(f.read_text())
    (tmp_path / "conftest.py").write_text(REDIRECT)
    proc = _pytest(tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "PASSED" in proc.stdout
    check = subprocess.run(
        [sys.executable, "-c", REDIRECT + "from axolotl.monkeypatch.checkpoint_activation_offload import "
         "CheckpointHiddenStatesOffload as C; print(C.__module__)"],
        capture_output=True, text=True, timeout=120,
    )
    assert check.stdout.strip() == "hsoffload.integrations.axolotl", check.stdout + check.stderr
