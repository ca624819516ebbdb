"""Graph capture without a GPU: the decision path. While the current stream captures, a marked tensor passes
through (counted in captured_passthrough, logged once), whether the engine tells capture itself (torch >= 2.13's
device guard; proved on the emulated device, tests/device/emu/test_capture_emu.py) or the shim tells it through
`offload_pack(..., capturing=True)` (torch 2.11-2.12, where the engine cannot ask)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import hsoffload
from hsoffload import OffloadScope
from hsoffload.offload import cuda_capture as capture
from hsoffload._logging import forget_logged
from support.device_model import LinearStack

mark = torch.ops.hsoffload.mark_hidden_state


def Stack(dim: int = 16, layers: int = 3) -> LinearStack:  # noqa: N802  (the model's name in these tests)
    return LinearStack(dim, layers)


@pytest.fixture
def probe_says_capturing():
    before = capture._probe
    capture.set_capture_probe_for_tests(lambda: True)
    try:
        yield
    finally:
        capture._probe = before


def test_pack_with_capturing_flag_passes_the_marked_tensor_through() -> None:
    x = torch.randn(64, 64)
    acquires = hsoffload.pool_stats().acquires
    with OffloadScope(offload_cpu_tensors=True, min_offload_size=0) as scope:
        mark(x)
        handle = torch.ops.hsoffload.offload_pack(x, scope.id, True)
        y = torch.ops.hsoffload.offload_unpack(handle)
    assert y is x or y.data_ptr() == x.data_ptr()  # the very tensor, never copied
    stats = scope.stats
    assert stats.captured_passthrough == 1 and stats.offloaded_tensors == 0, stats
    assert hsoffload.pool_stats().acquires == acquires


def test_without_the_flag_the_same_pack_offloads() -> None:
    x = torch.randn(64, 64)
    with OffloadScope(offload_cpu_tensors=True, min_offload_size=0) as scope:
        mark(x)
        y = torch.ops.hsoffload.offload_unpack(torch.ops.hsoffload.offload_pack(x, scope.id))
    assert y.data_ptr() != x.data_ptr() and torch.equal(x, y)
    assert scope.stats.captured_passthrough == 0 and scope.stats.offloaded_tensors == 1


def test_shim_probe_route_passes_a_checkpointed_stack_through(probe_says_capturing, caplog) -> None:
    torch.manual_seed(0)
    ref = Stack()
    model = copy.deepcopy(ref)
    x = torch.randn(8, 16)
    ref(x).backward()
    acquires = hsoffload.pool_stats().acquires
    forget_logged()
    with caplog.at_level(logging.INFO, logger="hsoffload"):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with OffloadScope(offload_cpu_tensors=True, min_offload_size=0) as scope:
                model(x).backward()
            assert scope.stats.captured_passthrough == 3 and scope.stats.offloaded_tensors == 0
    assert hsoffload.pool_stats().acquires == acquires
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    lines = [r for r in caplog.records if "captured" in r.getMessage()]
    assert len(lines) == 1  # logged once, not per scope


def test_engine_says_whether_it_detects_capture_itself() -> None:
    detects = bool(torch.classes.hsoffload.OffloadScope.engine_detects_capture())
    # torch >= 2.13 declares DeviceGuardImplInterface::isStreamCapturing; the engine detects it by signature.
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    assert detects == ((major, minor) >= (2, 13))
    # Where the engine detects capture (or there is no accelerator), the shim never probes: no per-pack Python cost.
    if detects or not torch.accelerator.is_available():
        assert capture._choose_probe() is None


@pytest.fixture
def cached_tensor_registry():
    """torch's registry of tensors a CUDA-graph tree hands out on replay (process-global: restored after)."""
    import torch._inductor.cudagraph_trees  # noqa: F401  (what makes trees possible in this process)

    added: list[torch.Tensor] = []
    torch._C._set_cached_tensors_enabled(True)
    try:
        yield added
    finally:
        for t in added:
            torch._C._remove_cached_tensor(t)
        torch._C._set_cached_tensors_enabled(False)


def test_a_tensor_a_cudagraph_tree_hands_out_is_recognised(cached_tensor_registry) -> None:
    """The decision of reduce-overhead pass-through: a replayed tree output (registered as a cached tensor by the
    tree) is tree memory; another tensor is not; with no tree manager for the device, nothing else is."""
    from hsoffload.offload.cuda_graph_trees import in_tree_memory, owned_by_cudagraph_tree

    out = torch.randn(32, 32)
    torch._C._add_cached_tensor(out)
    cached_tensor_registry.append(out)
    assert in_tree_memory(out, 0)
    assert not in_tree_memory(torch.randn(32, 32), 0)  # no manager exists for device 0: not a tree's
    assert not owned_by_cudagraph_tree(out)  # a CPU tensor: trees are CUDA-only


def test_pack_passes_tree_memory_through_and_counts_it(cached_tensor_registry, monkeypatch) -> None:
    """What the pack hook does with a tensor the decision calls tree memory (here a CPU tensor registered as a tree
    would register its output on a GPU; the CUDA-only gate is lifted): it stays where it is, counted in
    captured_passthrough, while the other saved activation moves; gradients equal no offload."""
    from hsoffload.offload import cuda_graph_trees as cudagraphs
    from hsoffload.offload import scope as scope_module

    monkeypatch.setattr(scope_module, "owned_by_cudagraph_tree", lambda t: cudagraphs.in_tree_memory(t, 0))
    monkeypatch.setattr(scope_module, "trees_loaded", lambda: True)  # as once inductor's trees are imported

    def f(x: torch.Tensor, tree_output: bool) -> torch.Tensor:
        h = x * 2  # "the cudagraphed graph's output"
        if tree_output:
            torch._C._add_cached_tensor(h)
            cached_tensor_registry.append(h)
        return (h.sin() * x.cos()).sum()  # sin saves h (tree memory), cos saves x (ordinary)

    x0 = torch.randn(64, 64, requires_grad=True)
    f(x0, False).backward()
    x = x0.detach().clone().requires_grad_(True)
    with OffloadScope(offload_cpu_tensors=True, min_offload_size=0, policy="all") as scope:
        f(x, True).backward()
    assert torch.equal(x.grad, x0.grad)
    s = scope.stats
    assert s.captured_passthrough == 1 and s.offloaded_tensors >= 1, s


@pytest.mark.parametrize("trees", [False, True])
def test_the_tree_question_is_asked_only_of_marked_tensors_once_trees_exist(trees, monkeypatch) -> None:
    """The CUDA-graph-tree check costs Python work per save: the pack hook asks it only once inductor's trees are
    imported, and then only for tensors the engine would offload (marked), not for every saved tensor."""
    from hsoffload.offload import scope as scope_module

    asked: list[torch.Size] = []
    monkeypatch.setattr(scope_module, "owned_by_cudagraph_tree", lambda t: asked.append(t.shape) or False)
    monkeypatch.setattr(scope_module, "trees_loaded", lambda: trees)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    with OffloadScope(offload_cpu_tensors=True, min_offload_size=0) as scope:
        h = torch.ops.hsoffload.mark_hidden_state(x * 1)
        torch.tanh(lin(h)).sum().backward()  # saves h (marked), and tanh's output and the weight (not marked)
    assert scope.stats.saved_tensors_seen >= 3 and scope.stats.offloaded_tensors == 1, scope.stats
    assert asked == ([torch.Size([8, 16])] if trees else []), asked
