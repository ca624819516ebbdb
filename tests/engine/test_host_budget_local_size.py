"""The auto host budget on nodes shared by several ranks, whatever launched them (issue 28 item 4, issue 33 item 4):
one decider of the local size (the engine's, csrc/local_size.cpp) for every launcher's variable, the same before any
scope and inside one, with a stated precedence; a warning when a rank has a local rank but no local size; the room
left to ZeRO-Offload's host states."""

from __future__ import annotations

import logging
from typing import Iterator

import pytest
import torch

import hsoffload
from hsoffload.offload import host
from hsoffload._logging import forget_logged
from hsoffload.integrations import deepspeed as hds
from hsoffload.offload.scope import OffloadScope
from support import hf_tiny as H

CPU = {"offload_cpu_tensors": True, "min_offload_size": 0}
# The explicit override, torchrun, DeepSpeed's launcher, Open MPI, Intel MPI / MPICH, Slurm (listed here, not read
# from hsoffload, so that a variable hsoffload stops reading fails its test)
SIZE_VARS = ("HSOFFLOAD_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
             "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


@pytest.fixture(autouse=True)
def _clean_budget(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in SIZE_VARS + host.LOCAL_RANK_VARS + ("HSOFFLOAD_MAX_HOST_BYTES", "WORLD_SIZE", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    forget_logged()
    hsoffload.set_host_room(0)
    hsoffload.set_host_budget("auto")
    yield
    hsoffload.set_host_room(0)
    hsoffload.set_host_budget("auto")


def _auto_budget(caplog: pytest.LogCaptureFixture) -> tuple[hsoffload.BudgetStats, list[str]]:
    hsoffload.set_host_budget("auto")  # resolved again at its next use, with the variables the test set
    with caplog.at_level(logging.INFO, logger="hsoffload"):
        for _ in range(2):  # resolved once, kept by the next entry
            with OffloadScope(max_host_bytes="auto", **CPU):
                pass
    lines = [r.getMessage() for r in caplog.records if "max_host_bytes=auto" in r.getMessage()]
    return hsoffload.budget_stats(), lines


def _before_and_inside_a_scope() -> tuple[int, int]:
    """The local size budget_stats() reports before any scope (a fresh auto budget) and inside one."""
    hsoffload.set_host_budget("auto")
    before = hsoffload.budget_stats().local_world_size
    with OffloadScope(max_host_bytes="auto", **CPU):
        inside = hsoffload.budget_stats().local_world_size
    return before, inside


@pytest.mark.parametrize("name", SIZE_VARS)
def test_each_launchers_local_size_splits_the_auto_budget(
    name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(name, "4")
    b, lines = _auto_budget(caplog)
    assert b.is_auto and b.local_world_size == 4
    assert b.limit == int(b.mem_available * 0.8) // 4
    assert len(lines) == 1 and f"/ {name}" in lines[0] and lines[0].endswith(" 4"), lines
    assert _before_and_inside_a_scope() == (4, 4)


@pytest.mark.parametrize("spec, node, expected", [
    ("8(x2)", "1", 8), ("2(x3),1", "0", 2), ("2(x3),1", "2", 2), ("2(x3),1", "3", 1), ("2(x3),1", None, 2),
    ("4,6", "1", 6),
])
def test_slurm_tasks_per_node_reads_this_nodes_count(
    spec: str, node: str | None, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", spec)
    if node is not None:
        monkeypatch.setenv("SLURM_NODEID", node)
    assert _before_and_inside_a_scope() == (expected, expected)
    assert hsoffload.offload.host.local_size() == (expected, "SLURM_TASKS_PER_NODE" if node is not None else
                                           "SLURM_TASKS_PER_NODE (no SLURM_NODEID: the largest count)")


def test_torchrun_wins_over_the_others(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "8")
    b, _ = _auto_budget(caplog)
    assert b.local_world_size == 2 and b.limit == int(b.mem_available * 0.8) // 2


def test_srun_then_torchrun_counts_torchruns_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """srun starts one torchrun per node, which starts 8 ranks: Slurm's allocation says 1 task per node, the launcher
    that started this process says 8; the launcher wins."""
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "1")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1(x4)")
    monkeypatch.setenv("SLURM_NODEID", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert _before_and_inside_a_scope() == (8, 8)
    assert hsoffload.offload.host.local_size() == (8, "LOCAL_WORLD_SIZE")


def test_the_explicit_override_wins_and_a_bad_one_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("HSOFFLOAD_LOCAL_WORLD_SIZE", "3")
    assert _before_and_inside_a_scope() == (3, 3)
    monkeypatch.setenv("HSOFFLOAD_LOCAL_WORLD_SIZE", "eight")
    with pytest.raises(ValueError, match="HSOFFLOAD_LOCAL_WORLD_SIZE must be the number of ranks on this node.*'eight'"):
        hsoffload.offload.host.local_size()
    with pytest.raises(ValueError, match="HSOFFLOAD_LOCAL_WORLD_SIZE"):  # at scope entry, not in a pack
        hsoffload.set_host_budget("auto")
        with OffloadScope(max_host_bytes="auto", **CPU):
            pass
    monkeypatch.delenv("HSOFFLOAD_LOCAL_WORLD_SIZE")


def test_a_malformed_launcher_variable_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    assert hsoffload.offload.host.local_size() == (2, "SLURM_NTASKS_PER_NODE")


@pytest.mark.parametrize("rank_var", ["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"])
def test_local_rank_without_local_size_warns_once(
    rank_var: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(rank_var, "1")
    b, _ = _auto_budget(caplog)
    warnings = [r.getMessage() for r in caplog.records if "no local size" in r.getMessage()]
    assert len(warnings) == 1 and rank_var in warnings[0] and "LOCAL_WORLD_SIZE" in warnings[0]
    assert b.local_world_size == 1


def test_no_warning_when_alone(caplog: pytest.LogCaptureFixture) -> None:
    _auto_budget(caplog)
    assert not [r for r in caplog.records if "no local size" in r.getMessage()]


def test_room_left_to_another_library(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("LOCAL_SIZE", "2")
    hsoffload.set_host_room("64MiB")
    b, lines = _auto_budget(caplog)
    assert b.is_auto and b.limit == int((b.mem_available - 2 * (64 << 20)) * 0.8) // 2
    assert "left to other host users" in lines[0]
    hsoffload.set_host_budget(12345)  # an explicit budget is the user's: room does not change it
    hsoffload.set_host_room("1MiB")
    assert hsoffload.budget_stats().limit == 12345 and not hsoffload.budget_stats().is_auto


def test_zero_offload_host_bytes_per_rank() -> None:
    model = H.tiny_model()
    n = sum(p.numel() for p in model.parameters())
    stage3 = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "cpu"}}}
    assert hds.zero_offload_host_bytes(stage3, model, world_size=2) == -(-n * 16 // 2)  # fp32: weights = masters
    assert hds.zero_offload_host_bytes({**stage3, "bf16": {"enabled": True}}, model, world_size=2) == -(-n * 18 // 2)
    stage2 = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert hds.zero_offload_host_bytes(stage2, model, world_size=4) == -(-n * 16 // 4)
    assert hds.zero_offload_host_bytes({"zero_optimization": {"stage": 3}}, model, world_size=2) == 0
    assert hds.zero_offload_host_bytes({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
                                       model, world_size=1) == 0  # offload_param is ZeRO-3's only
    # A ZeRO-3 partitioned parameter counts its full size (ds_numel), not its 0-element partition.
    p = torch.nn.Parameter(torch.empty(0))
    p.ds_numel = 1000
    holder = torch.nn.Module()
    holder.w = p
    assert hds.parameter_count(holder) == 1000


def test_leave_room_for_zero_offload_sets_the_room(caplog: pytest.LogCaptureFixture) -> None:
    model = H.tiny_model()

    class _Config:  # what DeepSpeedEngine._config holds
        _param_dict = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}

    class _Engine:
        module = model
        _config = _Config()

    nbytes = hds.leave_room_for_zero_offload(_Engine(), world_size=1)
    assert nbytes > 0 and host.host_room() == nbytes
    b, _ = _auto_budget(caplog)
    assert b.limit == int((b.mem_available - nbytes) * 0.8)
