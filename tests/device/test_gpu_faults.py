"""GPU-only checks of the faults off the happy path (what only a GPU can show; the emulated device proves the same
rules in CI, tests/device/emu/test_faults_emu.py): a device-side assert after a packed forward, a device too small
for prefetch, reduce-overhead compile inside a scope, and the side streams' ownership.

Skipped (with a reason) without CUDA; run on a GPU machine by scripts/gpu_check.sh (its `pytest_faults` step).
"""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hsoffload
from hsoffload import OffloadScope
from support import hf_tiny
from support.device_model import Block, LinearStack

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _figure(test: str, **values) -> None:
    from test_gpu import _figure as figure  # one writer of the figures file

    figure(test, **values)


def test_a_device_side_assert_after_a_packed_forward_is_the_users_error_not_a_terminate():
    """After a device-side assert (an out-of-range index, as a bad label gives) the context is dead and every event
    query raises. Freeing the graph then returns host blocks whose events the pool asks: the process must raise the
    user's error and exit normally (rc 0), not std::terminate."""
    script = textwrap.dedent(
        f"""
        import gc, sys
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        import torch, hsoffload
        from hsoffload import OffloadScope
        from support.device_model import LinearStack
        model = LinearStack(1024, 4).cuda()
        x = torch.randn(512, 1024, device="cuda")
        with OffloadScope(min_offload_size=0) as scope:
            loss = model(x)
        try:
            torch.zeros(4, device="cuda")[torch.tensor([10], device="cuda")].sum().item()
        except RuntimeError as exc:
            print("user error:", str(exc).splitlines()[0])
        del loss; gc.collect()
        try:
            hsoffload.reserve_host(1 << 20)
        except RuntimeError:
            pass
        print("handled", scope.stats.offloaded_tensors)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    _figure("device_side_assert", rc=result.returncode, tail=(result.stdout + result.stderr)[-300:])
    assert result.returncode == 0 and "handled 4" in result.stdout, result.stdout + result.stderr[-3000:]


_ASSERT_IN_LOSS_SCRIPT = """
import gc, sys
sys.path.insert(0, {tests!r})
import torch, hsoffload
from hsoffload import OffloadScope
from support.device_model import LinearStack
offload = sys.argv[1] == "offload"
torch.manual_seed(0)
model = LinearStack(2048, 6).cuda()
x = torch.randn(4096, 2048, device="cuda")
scope = OffloadScope(min_offload_size=0, prefetch_depth=2) if offload else None
if scope is not None:
    scope.__enter__()
h = model.blocks[0](x)
for block in model.blocks[1:]:
    h = torch.utils.checkpoint.checkpoint(lambda t, b=block: torch.tanh(b(t)),
                                          torch.ops.hsoffload.mark_hidden_state(h), use_reentrant=False)
labels = torch.full((h.shape[0],), 10**6, device="cuda")  # out of range: the loss kernel asserts on the device
loss = torch.nn.functional.cross_entropy(h, labels)
error = None
try:
    loss.backward()  # no synchronisation since the assert: backward restores blocks before a call fails
    torch.cuda.synchronize()
except RuntimeError as exc:
    error = str(exc).splitlines()[0]
del loss, h; gc.collect()
if scope is not None:
    scope.__exit__(None, None, None)
print("error:", error)
print("tracked:", int(scope._scope.tracked_state()) if scope is not None else 0)
print("offloaded:", scope.stats.offloaded_tensors if scope is not None else 0)
print("survived")
"""


def test_an_assert_in_the_loss_then_backward_without_sync_surfaces_the_users_error():
    """The sequence no earlier GPU test ran: a device-side assert in the loss (an out-of-range label), then
    `loss.backward()` with no synchronisation, offload on. Backward restores (and prefetches) blocks before the first
    CUDA call reports the dead context; unwinding frees them. The user's CUDA error must surface as it does without
    offload -- not std::terminate from a block tagged in the caching allocator -- and the scope must track nothing
    after its exit. Each run in a subprocess (the error leaves the context unusable)."""
    script = _ASSERT_IN_LOSS_SCRIPT.format(tests=str(ROOT / "tests"))
    runs = {}
    for mode in ("plain", "offload"):
        result = subprocess.run([sys.executable, "-c", script, mode], cwd=ROOT, capture_output=True, text=True,
                                timeout=180)
        runs[mode] = result
        _figure(f"assert_in_loss_{mode}", rc=result.returncode, tail=(result.stdout + result.stderr)[-300:])
    for mode, result in runs.items():
        assert result.returncode == 0 and "survived" in result.stdout, (mode, result.stdout, result.stderr[-3000:])
    lines = {mode: dict(line.split(": ", 1) for line in r.stdout.splitlines() if ": " in line)
             for mode, r in runs.items()}
    assert lines["plain"]["error"] != "None", lines
    assert lines["offload"]["error"] == lines["plain"]["error"], lines
    assert lines["offload"]["tracked"] == "0" and lines["offload"]["offloaded"] == "5", lines


def _llama_step(model, ids, scope_kwargs):
    model.zero_grad(set_to_none=True)
    if scope_kwargs is None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        stats = None
    else:
        with hsoffload.offload_hidden_states(model, **scope_kwargs) as scope:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        stats = scope.stats
    torch.cuda.synchronize()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()], stats


def test_a_prefetch_that_cannot_fit_never_fails_a_step_that_fits():
    """set_per_process_memory_fraction at what the step reserves with prefetch_depth 0: with prefetch_depth 2 the
    prefetches that find no memory are skipped (prefetch_oom) and the step succeeds, bitwise."""
    model = hf_tiny.tiny_model("llama").cuda()
    ids = torch.randint(3, hf_tiny.VOCAB, (1, 4096), device="cuda")
    kwargs = {"policy": "all", "min_offload_size": 0}
    ref = _llama_step(model, ids, None)
    total = torch.cuda.get_device_properties(0).total_memory
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    depth0 = _llama_step(model, ids, {**kwargs, "prefetch_depth": 0})
    reserved0 = torch.cuda.max_memory_reserved()
    torch.cuda.empty_cache()
    try:
        torch.cuda.set_per_process_memory_fraction((reserved0 + 2 * MiB) / total)
        got = _llama_step(model, ids, {**kwargs, "prefetch_depth": 2})
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    _figure("prefetch_oom", reserved_depth0_mib=reserved0 / MiB, prefetch_oom=got[2].prefetch_oom,
            prefetch_dropped=got[2].prefetch_dropped, prefetch_hits=got[2].prefetch_hits)
    for a, b in zip([depth0[0], *depth0[1]], [ref[0], *ref[1]]):
        assert torch.equal(a, b)
    for a, b in zip([got[0], *got[1]], [ref[0], *ref[1]]):
        assert torch.equal(a, b)


def test_reduce_overhead_compile_inside_a_scope_passes_tree_memory_through():
    """A checkpointed layer under torch.compile(mode="reduce-overhead") in a scope: the activations a CUDA-graph tree
    owns pass through (captured_passthrough), 5 steps bitwise equal to the same compiled model without a scope."""
    torch.manual_seed(0)
    dim = 1024
    model = LinearStack(dim, 4).cuda()
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, mode="reduce-overhead")
    compiled_twin = torch.compile(twin, mode="reduce-overhead")
    xs = [torch.randn(512, dim, device="cuda") for _ in range(5)]
    peaks = {}
    stats = None
    for name, m, scoped in (("no scope", compiled_twin, False), ("scope", compiled, True)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        grads = []
        for x in xs:
            m.zero_grad(set_to_none=True)
            if scoped:
                with OffloadScope(min_offload_size=0, policy="all") as scope:
                    m(x).backward()
                stats = scope.stats
            else:
                m(x).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() / MiB
        if scoped:
            got = grads
        else:
            ref = grads
    _figure("reduce_overhead", peak_mib=peaks, captured_passthrough=stats.captured_passthrough,
            offloaded=stats.offloaded_tensors)
    for step_ref, step_got in zip(ref, got):
        assert all(torch.equal(a, b) for a, b in zip(step_ref, step_got))
    assert stats.captured_passthrough > 0, stats


def test_side_streams_are_one_pair_per_process_among_other_streams():
    """3 scopes, 32 torch.cuda.Stream()s made between them: the side streams are the same pair every time, the
    restore stream at high priority."""
    model = LinearStack(256, 2).cuda()
    x = torch.randn(64, 256, device="cuda")
    seen = []
    others = []
    for _ in range(3):
        others += [torch.cuda.Stream() for _ in range(32)]
        with OffloadScope(min_offload_size=0):
            model(x).backward()
        seen.append(tuple(torch.classes.hsoffload.OffloadScope.side_streams(torch.device("cuda", 0))))
    torch.cuda.synchronize()
    other_ids = {s.stream_id for s in others}
    _figure("side_streams", pairs=seen, collisions_with_user_streams=sorted(set(seen[0]) & other_ids))
    assert len(set(seen)) == 1, seen
    d2h, h2d = seen[0]
    assert d2h != h2d
