"""hsoffload's accelerator path on the emulated device: bitwise parity with training without offload.

Every test runs with delayed copies (conftest: DEFAULT_DELAY_US per copy) so that side-stream copies really overlap
compute and freed device blocks are really reused (poisoned) while copies are in flight.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from support import hf_tiny
import hsemu
import hsoffload
from hsoffload import OffloadScope
from support.device_model import Block  # the model every device test shares
from support.rewrites import STALE_CASES, two_saves

mark = torch.ops.hsoffload.mark_hidden_state


class Boom(RuntimeError):
    pass


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fail: bool) -> torch.Tensor:
        ctx.fail = fail
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.fail:
            raise Boom("raised in the middle of backward")
        return grad, None


class Stack(torch.nn.Module):
    def __init__(self, dim: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor, reentrant: bool = False, fail_at: int = -1, stall_us: int = 0) -> torch.Tensor:
        h = x * 1  # a non-leaf first input, like an embedding output
        for i, block in enumerate(self.blocks):
            if stall_us:
                hsemu.sleep(stall_us)  # the compute stream lags the host: every copy must wait on it
            h = checkpoint(block, mark(h), use_reentrant=reentrant)
            if i == fail_at:
                h = _FailInBackward.apply(h, True)
        return h.float().pow(2).mean()


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().cpu().clone() for p in model.parameters()]


def _step(model: Stack, x: torch.Tensor, scope: OffloadScope | None, **forward_kwargs):
    model.zero_grad(set_to_none=True)
    if scope is None:
        loss = model(x, **forward_kwargs)
        loss.backward()
    else:
        with scope:
            loss = model(x, **forward_kwargs)
            loss.backward()
    return loss.detach().cpu(), _grads(model)


def _assert_same(a, b) -> None:
    assert torch.equal(a[0], b[0]), f"loss {a[0]} != {b[0]}"
    for i, (ga, gb) in enumerate(zip(a[1], b[1])):
        assert torch.equal(ga, gb), f"gradient {i} differs (max abs {(ga - gb).abs().max()})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reentrant", [False, True])
def test_stack_bitwise_over_steps(dev, dtype, reentrant):
    torch.manual_seed(0)
    ref = Stack().to(dev, dtype)
    off = copy.deepcopy(ref)
    for step in range(3):
        x = torch.randn(4, 16, 32, dtype=dtype).to(dev).requires_grad_()
        scope = OffloadScope(min_offload_size=0)
        _assert_same(_step(ref, x, None, reentrant=reentrant), _step(off, x, scope, reentrant=reentrant))
        s = scope.stats
        assert s.offloaded_tensors == 4 and s.restored_tensors == 4, s
        assert s.offloaded_bytes == 4 * x.numel() * x.element_size()
        assert s.prefetch_hits == 3, s  # prefetch in reverse pack order: every layer but the last-packed


def test_stalled_compute_stream_and_poisoned_reuse(dev):
    """The compute stream lags before every layer; sentinels take freed blocks between forward and backward."""
    torch.manual_seed(1)
    ref = Stack().to(dev)
    off = copy.deepcopy(ref)
    x = torch.randn(4, 16, 32).to(dev).requires_grad_()
    expected = _step(ref, x, None)
    off.zero_grad(set_to_none=True)
    before = hsemu.stats()
    with OffloadScope(min_offload_size=0, prefetch_depth=2) as scope:
        loss = off(x, stall_us=2_000)
        junk = [torch.full_like(x, -7.0) for _ in range(8)]  # reuse every freed block of the layer size
        hsemu.sleep(5_000)
        del junk
        loss.backward()
    _assert_same(expected, (loss.detach().cpu(), _grads(off)))
    after = hsemu.stats()
    assert after["async_copies"] - before["async_copies"] >= 8, "copies did not run asynchronously"
    assert after["cross_stream_waits"] > before["cross_stream_waits"]
    # Blocks a side stream copies are held by the engine until the copy is done, never tagged in the allocator
    # (keepalive.h: a tagged block's free can raise after a sticky error).
    assert scope.stats.side_use_holds >= 8, scope.stats  # 4 sources read, 4 restores written on side streams
    assert after["deferred_frees"] == before["deferred_frees"], "a block was tagged with a side stream's use"
    assert scope.stats.offloaded_tensors == 4


def test_forward_and_backward_never_block_the_host(dev):
    """Invariant I4: no host synchronisation inside the hooks (every copy non-blocking, no stream/device sync)."""
    torch.manual_seed(2)
    model = Stack().to(dev)
    x = torch.randn(4, 16, 32).to(dev).requires_grad_()
    scope = OffloadScope(min_offload_size=0)
    hsemu.synchronize()
    before = hsemu.stats()
    with scope:
        loss = model(x)
        loss.backward()
    after = hsemu.stats()
    assert after["sync_copies"] == before["sync_copies"], "a copy in the hooks made the host wait"
    assert after["host_syncs"] == before["host_syncs"], "the hooks synchronised a stream, an event or the device"
    assert after["async_copies"] - before["async_copies"] == 8  # 4 offloads + 4 restores
    assert scope.stats.restored_tensors == 4


@pytest.mark.parametrize("prefetch_depth", [0, 1, 2])
def test_tiny_llama_trains_bitwise(dev, prefetch_depth):
    model = hf_tiny.tiny_model("llama").to(dev)
    hf_tiny.enable_checkpointing(model, reentrant=False)
    twin = hf_tiny.twin(model)
    data = [{k: v.to(dev) for k, v in b.items()} for b in hf_tiny.batches(3)]
    kwargs = {"min_offload_size": 0, "use_streams": True, "prefetch_depth": prefetch_depth}
    ref = hf_tiny.train_steps(model, data, offload=False)
    got = hf_tiny.train_steps(twin, data, offload=True, scope_kwargs=kwargs)
    hf_tiny.assert_bitwise_equal(ref, got)
    layers = hf_tiny.decoder_layers(twin)
    for s in got[2]:
        assert s.offloaded_tensors == layers and s.restored_tensors == layers, s
        assert s.prefetch_hits == (layers - 1 if prefetch_depth else 0), s


def test_views_and_slices_of_one_storage(dev):
    base = torch.randn(8, 64).to(dev)
    w = torch.randn(64, 64).to(dev).requires_grad_()

    def loss_of(views: list[torch.Tensor]) -> torch.Tensor:
        return sum(((v @ w[: v.shape[-1], :]) ** 2).sum() for v in views)

    def run(offload: bool):
        w.grad = None
        h = base * 1
        views = [h, h[:, 8:], h[2:5], h.t().contiguous().t(), h[:, ::2]]
        scope = OffloadScope(min_offload_size=0) if offload else None
        if scope:
            with scope:
                for v in views:
                    scope.mark(v)
                loss = loss_of(views)
                loss.backward()
        else:
            loss = loss_of(views)
            loss.backward()
        return loss.detach().cpu(), [w.grad.cpu()], scope

    a, b = run(False), run(True)
    _assert_same(a[:2], b[:2])
    assert b[2].stats.offloaded_tensors >= 1 and b[2].stats.restored_tensors == 5


def test_retain_graph_backward_twice(dev):
    torch.manual_seed(3)
    ref = Stack().to(dev)
    off = copy.deepcopy(ref)
    x = torch.randn(4, 16, 32).to(dev).requires_grad_()
    results = []
    for model, offload in ((ref, False), (off, True)):
        model.zero_grad(set_to_none=True)
        scope = OffloadScope(min_offload_size=0)
        with scope if offload else _null():
            loss = model(x)
            loss.backward(retain_graph=True)
            first = _grads(model)
            loss.backward()
        results.append((loss.detach().cpu(), first + _grads(model)))
        if offload:
            assert scope.stats.restored_tensors == 8
    _assert_same(*results)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_exception_mid_backward_then_a_correct_step(dev):
    torch.manual_seed(4)
    ref = Stack().to(dev)
    off = copy.deepcopy(ref)
    x = torch.randn(4, 16, 32).to(dev).requires_grad_()
    scope = OffloadScope(min_offload_size=0, prefetch_depth=2)
    with pytest.raises(Boom):
        with hsemu.copy_delay(h2d_us=5_000, d2h_us=300, d2d_us=300):
            _step(off, x, scope, fail_at=2)  # prefetches are in flight when the graph is dropped
    for _ in range(2):
        _assert_same(_step(ref, x, None), _step(off, x, OffloadScope(min_offload_size=0, prefetch_depth=2)))
    assert scope.tracked_state() == 0


def test_host_pool_reused_across_steps(dev):
    torch.manual_seed(5)
    model = Stack().to(dev)
    x = torch.randn(4, 16, 32).to(dev).requires_grad_()
    _step(model, x, OffloadScope(min_offload_size=0))
    hsemu.synchronize()
    pool0 = hsoffload.pool_stats()
    for _ in range(4):
        _step(model, x, OffloadScope(min_offload_size=0))
        hsemu.synchronize()
    pool = hsoffload.pool_stats()
    assert pool.reuses - pool0.reuses >= 16, (pool0, pool)  # 4 steps x 4 layers served from the pool
    assert pool.allocations == pool0.allocations
    assert pool.held_bytes == pool0.held_bytes


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8,
           torch.bool, torch.complex64]


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("view", ["whole", "slice", "transpose", "strided", "offset_row"])
def test_dtypes_and_views_round_trip_exactly(dev, dtype, view):
    """Pack/unpack through the accelerator path returns the same values, dtype, sizes and strides."""
    g = torch.Generator().manual_seed(7)
    base = (torch.randn(24, 40, generator=g) * 50).to(dtype) if dtype != torch.bool else torch.rand(24, 40, generator=g) > 0.5
    x = {"whole": lambda t: t, "slice": lambda t: t[3:17, 5:], "transpose": lambda t: t.t(),
         "strided": lambda t: t[::3, ::2], "offset_row": lambda t: t[7]}[view](base.to(dev))
    scope = OffloadScope(min_offload_size=0)
    with scope:
        scope.mark(x)
        handle = torch.ops.hsoffload.offload_pack(x, int(scope._scope.id()))
    out = torch.ops.hsoffload.offload_unpack(handle)
    assert scope.stats.offloaded_tensors == 1
    assert out.device == x.device and out.dtype == x.dtype
    assert out.shape == x.shape and out.stride() == x.stride()
    assert torch.equal(out.cpu(), x.cpu())


@pytest.mark.parametrize("use_streams", [True, False])
def test_spill_tier_on_the_device_is_bitwise(dev, tmp_path, use_streams):
    """Budget for one layer of four: the copies go device -> host block (side stream) -> file (an I/O thread, once
    the copy is done) and back file -> staging -> device, while the compute stream lags and sentinels take the freed
    blocks. The three that must make room are written; the last may stay in host, within the budget, if the write
    before it is still running when it is packed (a write in progress counts as room on its way)."""
    torch.manual_seed(5)
    ref = Stack().to(dev)
    off = copy.deepcopy(ref)
    x = torch.randn(4, 16, 32).to(dev).requires_grad_()
    layer_bytes = x.numel() * x.element_size()
    expected = _step(ref, x, None)
    for step in range(2):
        off.zero_grad(set_to_none=True)
        scope = OffloadScope(min_offload_size=0, max_host_bytes=layer_bytes, spill_dir=str(tmp_path),
                             use_streams=use_streams)
        with scope:
            loss = off(x, stall_us=1_000)
            junk = [torch.full_like(x, -7.0) for _ in range(8)]
            hsemu.sleep(3_000)
            del junk
            loss.backward()
        _assert_same(expected, (loss.detach().cpu(), _grads(off)))
        s = scope.stats
        assert s.offloaded_tensors == 4 and s.spilled_tensors in (3, 4) and s.restored_tensors == 4, s
        assert s.spilled_from_device_tensors == 0 and s.kept_on_device_tensors == 0, s
    del loss
    import gc

    gc.collect()
    assert scope.spill_stats()["files"] == 0
    assert list(tmp_path.iterdir()) == []
    hsoffload.set_host_budget("auto")


@pytest.mark.parametrize("policy", ["all", "sac"])
@pytest.mark.parametrize("prefetch_depth", [1, 2])
def test_tiny_llama_policies_bitwise_with_layer_prefetch(dev, policy, prefetch_depth):
    """Many offloaded tensors per decoder layer, restored a whole layer (prefetch group) ahead on the side stream
    while freed device blocks are poisoned and reused: bitwise equal to training without offload."""
    model = hf_tiny.tiny_model("qwen3").to(dev)
    if policy == "sac":
        hf_tiny.enable_sac(model)
    twin = hf_tiny.twin(model)
    data = [{k: v.to(dev) for k, v in b.items()} for b in hf_tiny.batches(3)]
    kwargs = {"min_offload_size": 0, "use_streams": True, "prefetch_depth": prefetch_depth, "policy": policy}
    ref = hf_tiny.train_steps(model, data, offload=False)
    got = hf_tiny.train_steps(twin, data, offload=True, scope_kwargs=kwargs)
    hf_tiny.assert_bitwise_equal(ref, got)
    layers = hf_tiny.decoder_layers(twin)
    for s in got[2]:
        assert s.offloaded_tensors > 3 * layers, s
        assert s.prefetch_hits > s.restored_tensors // 2, s


@pytest.mark.parametrize("share_copies", [False, True])
def test_sibling_chunks_share_one_copy_and_one_restore(dev, share_copies):
    """The two halves of a fused projection (gate/up, as Phi-3's gate_up_proj gives them) each span nearly all of
    one storage without covering each other, and two ops save them (silu, mul). With share_copies they share one host
    copy of the whole storage (M21), and the one restore of it serves both backward nodes, which run apart (M22). By
    default each save restores its own bytes: a copy each. Bitwise equal to no offload either way."""
    torch.manual_seed(0)
    x0 = torch.randn(256, 64, device=dev, requires_grad=True)
    w0 = torch.randn(64, 512, device=dev, requires_grad=True)

    def step(x: torch.Tensor, w: torch.Tensor, scope: OffloadScope | None) -> torch.Tensor:
        fused = x @ w  # 256 x 512: gate and up side by side
        gate, up = fused.chunk(2, dim=-1)
        if scope is not None:
            gate, up = scope.mark(gate), scope.mark(up)
        return (torch.nn.functional.silu(gate) * up).sum()  # silu saves gate; mul saves silu(gate) and up

    ref = step(x0, w0, None)
    ref.backward()
    x, w = x0.detach().clone().requires_grad_(), w0.detach().clone().requires_grad_()
    with OffloadScope(min_offload_size=0, use_streams=True, share_copies=share_copies) as scope:
        loss = step(x, w, scope)
        loss.backward()
    hsemu.synchronize()
    assert torch.equal(loss, ref) and torch.equal(x.grad, x0.grad) and torch.equal(w.grad, w0.grad)
    s = scope.stats
    fused_bytes = 256 * 512 * 4
    copies = 1 if share_copies else 2  # one copy, not two overlapping spans; by default one whole copy per save
    assert s.offloaded_tensors == copies and s.offloaded_bytes == copies * fused_bytes, s
    assert s.restored_tensors == 2 and s.restored_bytes == copies * fused_bytes, s  # one restore for both consumers


@pytest.mark.parametrize("case", STALE_CASES)
def test_a_rewrite_between_saves_restores_what_each_save_had(dev, case):
    """One fused output saved twice, its second half rewritten through `.data` (no version bump, as a kernel writing
    into a preallocated buffer does) between the saves: two separate slices, the halves of one chunk(), the whole
    output then one half. Each save restores the bytes it had at its own save (M24), with every copy delayed: the
    gradients equal `save_on_cpu`'s (which copies each saved tensor at its own save), bit for bit."""
    torch.manual_seed(0)
    x0 = torch.randn(64, 32, device=dev, requires_grad=True)
    w0 = torch.randn(32, 96, device=dev, requires_grad=True)

    def step(x: torch.Tensor, w: torch.Tensor, scope: OffloadScope | None) -> None:
        first, second = two_saves(x @ w, case)
        y1 = (scope.mark(first) if scope else first).sin()
        if case == "whole_then_half":
            # The write lands in bytes the first save holds: the contract covers bytes not written after their own
            # save (the copy runs on the side stream after it), so the first copy must have landed before it.
            hsemu.synchronize()
        second.data.mul_(2.0)
        y2 = (scope.mark(second) if scope else second).cos()
        (y1.sum() + y2.sum()).backward()

    with torch.autograd.graph.save_on_cpu():
        step(x0, w0, None)
    x, w = x0.detach().clone().requires_grad_(), w0.detach().clone().requires_grad_()
    with OffloadScope(min_offload_size=0, use_streams=True) as scope:
        step(x, w, scope)
    hsemu.synchronize()
    assert scope.stats.offloaded_tensors == 2, scope.stats
    assert torch.equal(x.grad, x0.grad) and torch.equal(w.grad, w0.grad)


def test_a_tensor_every_layer_saves_comes_back_with_the_last_layer(dev):
    """Rotary cos/sin are computed once and saved by every decoder layer: with share_copies, one record, first packed
    in layer 0 (by default each layer's saves copy their own).
    Backward of the last layer must bring back one layer ahead (prefetch_depth 1), not layer 0's group as well
    (M23); the device bytes held when the last layer's backward ends are what it proves."""
    model = hf_tiny.tiny_model("llama").to(dev)
    ids = torch.randint(3, hf_tiny.VOCAB, (1, 256)).to(dev)
    layers = model.model.layers
    held_after: dict[int, int] = {}

    def after_backward(index: int):  # noqa: ANN202
        def hook(module, grad_in, grad_out):  # noqa: ANN001, ANN202
            hsemu.synchronize()
            held_after[index] = hsemu.stats()["allocated_bytes"]
        return hook

    handles = [layer.register_full_backward_hook(after_backward(i)) for i, layer in enumerate(layers)]
    try:
        with hsoffload.offload_hidden_states(model, policy="all", min_offload_size=0, prefetch_depth=1,
                                             share_copies=True) as scope:  # one record for every layer's save
            loss = model(input_ids=ids, labels=ids).loss
            hsemu.synchronize()
            before_backward = hsemu.stats()["allocated_bytes"]
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    per_layer = [scope.layer_tracker.layers[n].offloaded_bytes for n in scope.layer_tracker.layers]
    assert len(per_layer) == len(layers) == 3 and min(per_layer) > 0, per_layer
    last = len(layers) - 1
    # Held when the last layer's backward ends: the previous layer, prefetched -- not two layers.
    grown = held_after[last] - before_backward
    assert grown < 1.5 * per_layer[last - 1], (grown, per_layer)
    assert scope.stats.restored_bytes == scope.stats.offloaded_bytes, scope.stats  # every record restored once
