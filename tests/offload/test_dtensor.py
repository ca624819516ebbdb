"""DTensor hidden states (tensor/sequence parallel): the local shard is offloaded and a DTensor comes back.

A 1-rank gloo mesh on the CPU: the DTensor machinery (mesh, placements, redistribution in backward) is real; one
rank keeps the test in-process. The process group is destroyed afterwards so later tests see none.
"""

from __future__ import annotations


import pytest
import torch

from hsoffload import OffloadScope

pytest.importorskip("torch.distributed.tensor")
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402


@pytest.fixture
def mesh(one_rank_mesh):  # tests/conftest.py
    return one_rank_mesh


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate()], ids=str)
def test_dtensor_round_trip_and_gradients(mesh, placement):
    torch.manual_seed(0)
    w_full = torch.randn(16, 16)

    def run(offload: bool):
        w = distribute_tensor(w_full.clone(), mesh, [Replicate()]).requires_grad_()
        x = distribute_tensor(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), mesh, [placement])
        h = x * 1.5  # a non-leaf DTensor, like a layer's input
        seen = []
        if offload:
            scope = OffloadScope(offload_cpu_tensors=True, min_offload_size=0)
            with scope:
                scope.mark(h)
                loss = (torch.tanh(h @ w) * h).sum()
                loss.backward()
            seen.append(scope.stats)
        else:
            loss = (torch.tanh(h @ w) * h).sum()
            loss.backward()
        return loss.full_tensor(), w.grad.full_tensor(), seen

    ref_loss, ref_grad, _ = run(False)
    loss, grad, (stats,) = run(True)
    assert torch.equal(ref_loss, loss) and torch.equal(ref_grad, grad)
    # h is saved by the matmul and by the mul: a copy per saving node (each save restores its own bytes)
    assert stats.offloaded_tensors == 2 and stats.restored_tensors >= 2 and stats.skipped_marked_tensors == 0, stats


def test_restored_dtensor_keeps_mesh_placements_and_metadata(mesh):
    x = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    scope = OffloadScope(offload_cpu_tensors=True, min_offload_size=0)
    with scope:
        scope.mark(x)
        packed = scope.pack_hook(x)
    out = scope.unpack_hook(packed)
    assert isinstance(out, DTensor)
    assert out.device_mesh == x.device_mesh and out.placements == x.placements
    assert out.shape == x.shape and out.stride() == x.stride() and out.dtype == x.dtype
    assert torch.equal(out.to_local(), x.to_local())
    assert scope.stats.offloaded_tensors == 1


@pytest.mark.slow
def test_two_ranks_mark_a_dtensor_with_the_op_the_function_or_the_scope(tmp_path):
    """A real 2-process gloo mesh (tests/support/dtensor_worker.py under torchrun): whichever way the DTensor hidden
    state is marked, its later save through a non-reentrant checkpoint offloads the local shard on every rank,
    bitwise."""
    import json
    from pathlib import Path

    from support import launch

    worker = Path(__file__).resolve().parents[1] / "support" / "dtensor_worker.py"
    proc = launch.two_ranks(worker, ["--out-dir", str(tmp_path)], timeout=240, deepspeed=False)
    written = sorted(p.name for p in tmp_path.glob("rank*.json"))
    assert proc.returncode == 0, f"results written: {written}\n" + launch.tail(proc)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert {r["marker"] for r in results} == {"op", "function", "scope.mark"} and len(results) == 9
        for r in results:
            assert r["bitwise"], (rank, r)
            assert r["offloaded_tensors"] == 1 and r["restored_tensors"] == 1, (rank, r)
            assert r["skipped_marked_tensors"] == 0, (rank, r)


def test_a_dtensor_whose_local_shard_is_marked_offloads_it(mesh):
    """The pack hook accepts a mark on the wrapper or on its local shard (whichever the op's kernel saw)."""
    x = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    scope = OffloadScope(offload_cpu_tensors=True, min_offload_size=0)
    with scope:
        scope._scope.mark(x._local_tensor)
        packed = scope.pack_hook(x)
    out = scope.unpack_hook(packed)
    assert isinstance(out, DTensor) and torch.equal(out.to_local(), x.to_local())
    assert scope.stats.offloaded_tensors == 1 and scope.stats.skipped_marked_tensors == 0
