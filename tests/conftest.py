"""Shared fixtures. The package must be importable (installed by `make test`, or PYTHONPATH=python_shim).

Puts tests/ on sys.path so that every suite, whatever its folder, imports the shared helpers as `support.*`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import hsoffload  # noqa: F401  (loads the op library once for every test)

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

# Under pytest-xdist (`make test`: one worker per core) each worker computes on one thread: intra-op threads of two
# workers spinning on the same cores made the suite slower, not faster. Offload on vs off is compared within one
# process, so the thread count is the same on both sides of every comparison.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


# What only the full run (`make test`) needs is marked `slow` on the test itself (`@pytest.mark.slow` or a module's
# `pytestmark`): the tests that launch processes (2-rank torchrun, child pytests, the documented shell commands, the
# CLI's benchmarks, the C++ build), trace real widths or compile with inductor. `make test-fast` (pytest -m "not slow")
# leaves them out and still touches every module. tests/tools/test_slow_marks.py checks the marks against the measured
# durations in tests/durations.json (tests/support/durations.py: the threshold, the budget, how to refresh the file).


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-durations", action="store_true", default=False,
                     help="merge each test's seconds into tests/durations.json (tests/support/durations.py)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--record-durations"):
        from support.durations import DURATIONS, Recorder

        config.pluginmanager.register(Recorder(DURATIONS, list(config.invocation_params.args)), "hsoffload-durations")


# Modules whose tests share one expensive module fixture (a 2-rank launch that runs every case): under pytest-xdist
# (`make test` runs `-n auto --dist loadgroup`) each is sent whole to one worker, so that its launch happens once
# (tests/support/scheduling.py says how, and why not with xdist_group marks).
ONE_WORKER = (
    "tests/integrations/test_composition.py",
    "tests/integrations/test_deepspeed.py",
    "tests/loading/test_zero3_loading.py",
    "tests/integrations/axolotl_ci/test_upstream.py",  # the Axolotl leg: one download of Axolotl's sources for both
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from support.scheduling import make_scheduler

    return make_scheduler(config, log, ONE_WORKER)


# First among the hooks, so that the marks of every collected test are recorded before `-m`/`-k` deselect any.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from support.durations import MARKS_KEY, marks_of

    missing = [m for m in ONE_WORKER if not (config.rootpath / m).is_file()]
    if missing:  # a renamed module would silently be spread over the workers again, its launch repeated
        raise pytest.UsageError(f"tests/conftest.py ONE_WORKER names modules that do not exist: {missing}")
    config.stash[MARKS_KEY] = marks_of(items)
    if os.environ.get("HSOFFLOAD_MARKS_JSON"):  # tests/tools/test_slow_marks.py collecting the suite in a child
        Path(os.environ["HSOFFLOAD_MARKS_JSON"]).write_text(json.dumps(config.stash[MARKS_KEY]))
    # The slow tests first (stable otherwise): the workers start on the long ones and end on short ones together,
    # instead of one worker finishing a 20-second trace alone.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_rank_mesh() -> Any:
    """A 1-rank gloo process group and CPU device mesh in this process (DTensor, FSDP2 in process), destroyed after the
    test so that later tests see none."""
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def cpu_scope_kwargs() -> dict:
    """Scope options that make data really move on a CPU-only machine."""
    return {"offload_cpu_tensors": True, "min_offload_size": 0}


@pytest.fixture(autouse=True)
def _no_scope_left_behind():
    yield
    from hsoffload.offload.current import current_scope

    assert current_scope() is None, "a test left an offload scope active on this thread"
