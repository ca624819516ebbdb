"""Shared fixtures. The package must be importable (installed by `make test`, or PYTHONPATH=python_shim).

Puts tests/ on sys.path so that every suite, whatever its folder, imports the shared helpers as `support.*`.
"""

from __future__ import annotations

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


# What only the full run (`make test`) needs: the tests that launch processes (2-rank torchrun, child pytests, the
# documented shell commands, the CLI's benchmarks, the C++ build) or trace real widths. `make test-fast` (pytest -m
# "not slow") leaves them out and still touches every module: the engine's concepts in process, the patch, each
# integration's in-process tests, the planner. Node-id prefixes, measured with `pytest --durations` (docs/benchmarks.md,
# "Test suite").
SLOW = (
    "tests/device/test_emu_device.py::test_emulated_device_suite",  # the whole emulated-device suite, in a child
    "tests/engine/test_cpp_engine.py::",  # builds and runs the C++ engine tests
    "tests/engine/test_core.py::test_thousand_steps_flat",  # a leak check over many steps
    "tests/offload/test_policies_compile.py::test_regional_inductor_every_policy",  # inductor compiles
    "tests/offload/test_policies_compile.py::test_regional_sac_offloads",
    "tests/offload/test_policies_compile.py::test_layer_compile_in_place",
    "tests/offload/test_policies_compile.py::test_whole_model_compile",
    "tests/offload/test_policies_compile.py::test_regional_compile_with_reentrant",
    "tests/engine/test_spill.py::test_disk_full_mid_step",  # child processes
    "tests/engine/test_spill.py::test_kill_9",
    "tests/engine/test_tensor_kinds.py::test_warnings_",  # child processes
    "tests/engine/test_torchscript_compile.py::test_torchscript_models_offload_on_every_step",  # 2 child processes
    "tests/offload/auto/test_auto_ranks.py::",  # 2-rank torchrun
    "tests/offload/auto/test_auto_budget.py::test_equal_tokens",  # policy auto's adversarial runs (issue 51): each
    "tests/offload/auto/test_auto_budget.py::test_alternating",  # measures fixed configurations, then several runs
    "tests/offload/auto/test_auto_budget.py::test_random_lengths",
    "tests/offload/auto/test_auto_budget.py::test_a_second_forward",
    "tests/offload/auto/test_auto_budget.py::test_a_state_file",
    "tests/offload/auto/test_auto_budget.py::test_a_layer_that_saves",
    "tests/integrations/test_composition.py::",  # 2-rank torchrun
    "tests/integrations/test_deepspeed.py::",  # 2-rank torchrun
    "tests/offload/test_dtensor.py::test_two_ranks",
    "tests/loading/test_fsdp.py::test_two_ranks",
    "tests/loading/test_fsdp.py::test_fsdp2_two_ranks",
    "tests/loading/test_fsdp.py::test_rank_failing_during_load",
    "tests/offload/test_transformers_matrix.py::",  # a child pytest under another transformers
    "tests/offload/test_transformers_peer_suite.py::test_transformers_own",  # a child process each
    "tests/offload/test_transformers_peer_suite.py::test_a_mocked_checkpoint",
    "tests/loading/test_zero3_loading.py::test_parameters_and_loss_equal_stock",  # these share one 2-rank launch
    "tests/loading/test_zero3_loading.py::test_rank1_receives",
    "tests/loading/test_zero3_loading.py::test_rank0_is_the_source",
    "tests/loading/test_zero3_loading.py::test_verify_compared",
    "tests/loading/test_zero3_loading.py::test_mismatched_checkpoint",
    "tests/loading/test_zero3_loading.py::test_a_failure",
    "tests/loading/test_zero3_loading.py::test_ignore_mismatched",
    "tests/loading/test_zero3_loading.py::test_verify_names",
    "tests/engine/test_loader.py::test_mismatched_build_is_refused",  # child processes
    "tests/engine/test_loader.py::test_missing_library_names_places",
    "tests/tools/test_cli.py::test_bench_gpu_suite_refuses",  # child processes
    "tests/tools/test_cli.py::test_demo_does_not_import",
    "tests/tools/test_cli.py::test_demo_on_cpu",
    "tests/tools/test_cli.py::test_bench_cpu_quick_json",
    "tests/tools/test_cli.py::test_bench_disk_quick",
    "tests/tools/test_cli.py::test_plan_and_bench_arguments_are_checked",
    "tests/tools/test_suite_scheduling.py::",  # a child pytest with two workers
    "tests/tools/test_doc_commands.py::",  # every documented command, as a shell would run it
    "tests/planning/test_plan.py::test_real_width_moe_peak",  # FakeTensorMode traces at real width
)


# Modules whose tests share one expensive module fixture (a 2-rank launch that runs every case): under pytest-xdist
# (`make test` runs `-n auto --dist loadgroup`) each is sent whole to one worker, so that its launch happens once
# (tests/support/scheduling.py says how, and why not with xdist_group marks).
ONE_WORKER = (
    "tests/integrations/test_composition.py",
    "tests/integrations/test_deepspeed.py",
    "tests/loading/test_zero3_loading.py",
    "tests/integrations/axolotl_ci/test_upstream.py",  # the Axolotl leg: one download of Axolotl's sources for both tests
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from support.scheduling import make_scheduler

    return make_scheduler(config, log, ONE_WORKER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = [m for m in ONE_WORKER if not (config.rootpath / m).is_file()]
    if missing:  # a renamed module would silently be spread over the workers again, its launch repeated
        raise pytest.UsageError(f"tests/conftest.py ONE_WORKER names modules that do not exist: {missing}")
    slow = pytest.mark.slow
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(slow)
    # The slow tests first (stable otherwise): the workers start on the long ones and end on short ones together,
    # instead of one worker finishing a 20-second trace alone.
    items.sort(key=lambda item: not item.nodeid.startswith(SLOW))
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
