"""Shared fixtures. The package must be importable (installed by `make test`, or PYTHONPATH=python_shim).

Puts tests/ on sys.path so that every suite, whatever its folder, imports the shared helpers as `support.*`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import hsoffload  # noqa: F401  (loads the op library once for every test)

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cpu_scope_kwargs() -> dict:
    """Scope options that make data really move on a CPU-only machine."""
    return {"offload_cpu_tensors": True, "min_offload_size": 0}


@pytest.fixture(autouse=True)
def _no_scope_left_behind():
    yield
    from hsoffload.current import current_scope

    assert current_scope() is None, "a test left an offload scope active on this thread"
