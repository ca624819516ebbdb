"""Core offload semantics on CPU with offload_cpu_tensors=True, so data really moves through the host pool."""

from __future__ import annotations

import copy
import gc
import threading
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint


import hsoffload
from hsoffload import OffloadScope
from support.rewrites import STALE_CASES, two_saves

mark = torch.ops.hsoffload.mark_hidden_state


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 2 * dim)
        self.fc2 = torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Stack(torch.nn.Module):
    """A tiny decoder-like stack: each block checkpointed, its input marked."""

    def __init__(self, dim: int = 32, layers: int = 3, reentrant: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(dim, dim)
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = checkpoint(block, mark(h), use_reentrant=self.reentrant)
        return self.head(h).pow(2).mean()


def _train(model: torch.nn.Module, inputs: list[torch.Tensor], scope_kwargs: dict | None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads, stats = [], [], []
    for x in inputs:
        opt.zero_grad()
        if scope_kwargs is None:
            loss = model(x)
            loss.backward()
        else:
            with OffloadScope(**scope_kwargs) as scope:
                loss = model(x)
                loss.backward()
            stats.append(scope.stats)
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return losses, grads, stats


@pytest.mark.parametrize("reentrant", [False, True])
def test_bit_identical_over_three_steps(reentrant, cpu_scope_kwargs):
    torch.manual_seed(0)
    ref = Stack(reentrant=reentrant)
    off = copy.deepcopy(ref)
    inputs = [torch.randn(4, 8, 32) for _ in range(3)]
    ref_losses, ref_grads, _ = _train(ref, inputs, None)
    losses, grads, stats = _train(off, inputs, cpu_scope_kwargs)
    for a, b in zip(ref_losses, losses):
        assert torch.equal(a, b)
    for ga, gb in zip(ref_grads, grads):
        assert all(torch.equal(a, b) for a, b in zip(ga, gb))
    for s in stats:
        assert s.marked_tensors == 3 and s.offloaded_tensors == 3 and s.restored_tensors == 3
        assert s.offloaded_bytes == 3 * 4 * 8 * 32 * 4 == s.restored_bytes
        assert s.prefetch_hits == 2  # the last block's input is restored on demand, the rest prefetched


def test_cpu_tensors_skipped_by_default():
    model = Stack()
    with OffloadScope(min_offload_size=0) as scope:
        model(torch.randn(2, 4, 32)).backward()
    s = scope.stats
    assert s.marked_tensors == 3 and s.skipped_marked_tensors == 3 and s.offloaded_tensors == 0


def test_min_offload_size_skips_small(cpu_scope_kwargs):
    model = Stack()
    kwargs = dict(cpu_scope_kwargs, min_offload_size=2 * 4 * 32 * 4 + 1)
    with OffloadScope(**kwargs) as scope:
        model(torch.randn(2, 4, 32)).backward()
    assert scope.stats.skipped_marked_tensors == 3 and scope.stats.offloaded_tensors == 0


def _roundtrip(x: torch.Tensor, cpu_scope_kwargs: dict) -> tuple[torch.Tensor, hsoffload.OffloadStats]:
    """Save x for backward (marked) and return what backward's unpack produced."""
    got: list[torch.Tensor] = []
    alignment: list[int] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t, dummy):
            ctx.save_for_backward(t)
            return dummy.clone()

        @staticmethod
        def backward(ctx, grad):
            (t,) = ctx.saved_tensors
            alignment.append(t.data_ptr() % 64)
            got.append(t.detach().clone())
            # Also compare layout: strides are part of what is restored.
            got.append(torch.tensor(list(t.stride())))
            return None, grad

    dummy = torch.zeros(1, requires_grad=True)
    with OffloadScope(**cpu_scope_kwargs) as scope:
        out = Probe.apply(mark(x), dummy)
        out.sum().backward()
    # The restored data pointer keeps the original's alignment (CPU storages are 64-byte aligned).
    assert x.numel() == 0 or alignment[0] == x.data_ptr() % 64
    return got[0], got[1], scope.stats


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(6, 5),
        lambda: torch.randn(6, 5)[:, 1:],  # view with offset, non-contiguous
        lambda: torch.randn(6, 5)[2:],
        lambda: torch.randn(6, 5).t(),
        lambda: torch.randn(4, 6, 8)[:, 1:].transpose(0, 2),
        lambda: torch.randn(6, 5)[::2],
        lambda: torch.zeros(0, 5),
        lambda: torch.randn(6, 5) > 0,
        lambda: torch.randint(-100, 100, (6, 5)),
        lambda: torch.randn(6, 5).half(),
        lambda: torch.randn(6, 5).bfloat16(),
        lambda: torch.randn(6, 5, dtype=torch.complex64),
        lambda: torch.randn(6, 5, dtype=torch.float64)[1:, 1:],
        lambda: torch.tensor(3.5),
    ],
)
def test_roundtrip_views_and_dtypes(make, cpu_scope_kwargs):
    x = make()
    got, strides, stats = _roundtrip(x, cpu_scope_kwargs)
    assert got.dtype == x.dtype and got.device == x.device and got.shape == x.shape
    assert torch.equal(got, x)
    assert strides.tolist() == list(x.stride())
    if x.numel() > 0:
        assert stats.offloaded_tensors == 1 and stats.restored_tensors == 1
    else:
        assert stats.skipped_marked_tensors == 1


@pytest.mark.parametrize("share_copies", [False, True])
def test_same_tensor_saved_twice_and_views_copied_once(share_copies, cpu_scope_kwargs):
    """One node's saves of one tensor share a copy (`h * h`); a view saved by another node (`a * a`, a inside h)
    shares h's copy only with the opt-in `share_copies`: by default it restores its own bytes."""
    def f(base: torch.Tensor) -> torch.Tensor:
        h = mark(base * 1.0)
        a = mark(h[:, :8])  # views of one storage: their spans lie inside h's
        return (h * h).sum() + (a * a).sum()  # h saved twice by mul, a twice

    ref = torch.randn(8, 16, requires_grad=True)
    f(ref).backward()
    base = ref.detach().clone().requires_grad_(True)
    with OffloadScope(share_copies=share_copies, **cpu_scope_kwargs) as scope:
        f(base).backward()
    s = scope.stats
    assert s.marked_tensors == 2  # two marks, each counted once although saved twice
    copies = 1 if share_copies else 2  # a spans >= 3/4 of the storage: its own copy is the whole storage too (M21)
    assert s.offloaded_tensors == copies and s.offloaded_bytes == copies * 8 * 16 * 4, s
    assert s.restored_tensors == 4
    assert torch.equal(base.grad, ref.grad)


def test_parameters_and_unmarked_pass_through(cpu_scope_kwargs):
    lin = torch.nn.Linear(8, 8)
    with OffloadScope(**cpu_scope_kwargs) as scope:
        assert hsoffload.mark_hidden_state(lin.weight) is lin.weight  # refused: parameters are never offloaded
        x = torch.randn(8, 8, requires_grad=True)
        (lin(x) * lin.weight).sum().backward()  # mul saves the weight itself
    s = scope.stats
    assert s.saved_tensors_seen >= 4 and s.marked_tensors == 0 and s.offloaded_tensors == 0


def test_marked_leaf_input_that_requires_grad_is_offloaded(cpu_scope_kwargs):
    """An embedding output under enable_input_require_grads() is a leaf that requires grad: still offloaded."""
    x = torch.randn(4, 32, requires_grad=True)
    with OffloadScope(**cpu_scope_kwargs) as scope:
        (mark(x) * x).sum().backward()
    assert scope.stats.offloaded_tensors == 1 and scope.stats.restored_tensors == 2
    assert torch.equal(x.grad, 2 * x.detach())


def test_retain_graph_and_double_unpack(cpu_scope_kwargs):
    torch.manual_seed(0)
    ref, off = Stack(), None
    off = copy.deepcopy(ref)
    x = torch.randn(2, 4, 32)
    l1 = ref(x)
    l1.backward(retain_graph=True)
    l1.backward()
    with OffloadScope(**cpu_scope_kwargs) as scope:
        l2 = off(x)
        l2.backward(retain_graph=True)
        l2.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), off.parameters()))
    assert scope.stats.restored_tensors == 6 and scope.stats.offloaded_tensors == 3


def test_create_graph_double_backward(cpu_scope_kwargs):
    def f(x: torch.Tensor) -> torch.Tensor:
        h = mark(x * 1.5)
        return (h.tanh() * h).sum()

    x0 = torch.randn(5, 7, dtype=torch.float64)
    x_ref = x0.clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(f(x_ref), x_ref, create_graph=True)
    g_ref.sum().backward()
    x_off = x0.clone().requires_grad_(True)
    with OffloadScope(**cpu_scope_kwargs) as scope:
        (g,) = torch.autograd.grad(f(x_off), x_off, create_graph=True)
        g.sum().backward()
    assert torch.equal(g, g_ref) and torch.equal(x_off.grad, x_ref.grad)
    assert scope.stats.offloaded_tensors >= 1


def test_gradcheck_through_hooks(cpu_scope_kwargs):
    lin = torch.nn.Linear(4, 4).double()

    def f(x: torch.Tensor) -> torch.Tensor:
        with OffloadScope(**cpu_scope_kwargs):
            return checkpoint(lambda h: lin(h).sin(), mark(x * 2), use_reentrant=False)

    assert torch.autograd.gradcheck(f, (torch.randn(3, 4, dtype=torch.float64, requires_grad=True),))


class Boom(RuntimeError):
    pass


def test_exception_in_forward_then_next_step_correct(cpu_scope_kwargs):
    torch.manual_seed(0)
    model = Stack()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4, 32)
    with pytest.raises(Boom):
        with OffloadScope(**cpu_scope_kwargs) as scope:
            h = model.emb(x)
            checkpoint(model.blocks[0], mark(h), use_reentrant=False)
            raise Boom("forward failed")
    assert not scope.active
    gc.collect()
    assert scope.tracked_state() == 0
    assert hsoffload.pool_stats().in_use_bytes == 0
    ref(x).backward()
    with OffloadScope(**cpu_scope_kwargs) as scope2:
        model(x).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), model.parameters()))
    assert scope2.stats.offloaded_tensors == 3


def test_exception_in_backward_keeps_type_and_frees(cpu_scope_kwargs):
    class Fail(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            raise Boom("backward failed")

    model = Stack()
    with pytest.raises(Boom):
        with OffloadScope(**cpu_scope_kwargs) as scope:
            loss = Fail.apply(model(torch.randn(2, 4, 32)))
            loss.backward()
    del loss
    gc.collect()
    assert scope.tracked_state() == 0
    assert hsoffload.pool_stats().in_use_bytes == 0


def test_inplace_after_save_raises(cpu_scope_kwargs):
    for marked in (True, False):
        x = torch.randn(4, 4, requires_grad=True)
        with OffloadScope(**cpu_scope_kwargs):
            h = x * 2
            if marked:
                mark(h)
            y = (h * h).sum()
            h.add_(1)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.backward()


def test_inplace_on_saved_output_raises(cpu_scope_kwargs):
    x = torch.randn(4, 4, requires_grad=True)
    with OffloadScope(**cpu_scope_kwargs):
        y = x.exp()  # exp saves its output
        y.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_nested_scopes(cpu_scope_kwargs):
    x0 = torch.randn(4, 64)
    ref = x0.clone().requires_grad_(True)
    a, b = ref * 2, ref * 3
    (a * a).sum().add((b * b).sum()).backward()
    x = x0.clone().requires_grad_(True)
    with OffloadScope(**cpu_scope_kwargs) as outer:
        a = mark(x * 2)
        with OffloadScope(offload_cpu_tensors=True, min_offload_size=1 << 20) as inner:
            b = mark(x * 3)
            yb = (b * b).sum()  # saved under inner: b is too small for it
        ya = (a * a).sum()  # saved under outer again
        ya.add(yb).backward()
    # b is saved twice by mul: one mark, two packs kept in place
    assert inner.stats.marked_tensors == 1 and inner.stats.skipped_marked_tensors == 2
    assert outer.stats.offloaded_tensors == 1 and outer.stats.restored_tensors == 2
    assert torch.equal(x.grad, ref.grad)


def test_threads_have_their_own_scopes(cpu_scope_kwargs):
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            torch.manual_seed(i)
            model = Stack()
            ref = copy.deepcopy(model)
            xs = [torch.randn(2, 4, 32) for _ in range(3)]
            ref_out = _train(ref, xs, None)
            out = _train(model, xs, cpu_scope_kwargs)
            results[i] = (ref_out, out)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (ref_losses, ref_grads, _), (losses, grads, stats) in results.values():
        assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
        assert all(torch.equal(a, b) for ga, gb in zip(ref_grads, grads) for a, b in zip(ga, gb))
        assert all(s.offloaded_tensors == 3 for s in stats)


def test_mark_without_scope_is_noop():
    x = torch.randn(3)
    assert mark(x) is x


def test_exit_on_other_thread_is_an_error(cpu_scope_kwargs):
    scope = OffloadScope(**cpu_scope_kwargs)
    scope.__enter__()
    err: list[BaseException] = []

    def other() -> None:
        try:
            scope._scope.exit()
        except BaseException as exc:
            err.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    scope.__exit__(None, None, None)
    assert err and "did not enter" in str(err[0])


def test_config_validation():
    with pytest.raises(ValueError, match="min_offload_size"):
        OffloadScope(min_offload_size=-1)
    with pytest.raises(TypeError, match="offload_cpu_tensors"):
        OffloadScope(offload_cpu_tensors="yes")
    with pytest.raises(TypeError, match="either config= or keyword"):
        OffloadScope(hsoffload.OffloadConfig(), min_offload_size=0)


def test_bad_handle_and_scope_messages():
    with pytest.raises(ValueError, match="offload_unpack: handle is not a handle tensor"):
        torch.ops.hsoffload.offload_unpack(torch.zeros(3))
    with pytest.raises(ValueError, match="offload_pack: no live offload scope has id 987654"):
        torch.ops.hsoffload.offload_pack(torch.zeros(3), 987654)
    with pytest.raises(ValueError, match="offload_pack: scope must be an OffloadScope id"):
        torch.ops.hsoffload.offload_pack(torch.zeros(3), -5)


def test_handles_work_after_the_scope_object_is_gone(cpu_scope_kwargs):
    """Backward may run after the scope (and its Python object) is gone: restores still work."""
    torch.manual_seed(0)
    ref = Stack()
    off = copy.deepcopy(ref)
    x = torch.randn(2, 4, 32)
    ref(x).backward()
    with OffloadScope(**cpu_scope_kwargs):  # no name kept: the Python scope object dies at exit
        loss = off(x)
    gc.collect()
    before = hsoffload.cumulative_stats()
    loss.backward()
    after = hsoffload.cumulative_stats()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), off.parameters()))
    # Restores still go through the scope's own machinery: prefetch keeps working.
    assert after.restored_tensors - before.restored_tensors == 3
    assert after.prefetch_hits - before.prefetch_hits == 2


def test_entering_an_active_scope_again_is_refused(cpu_scope_kwargs):
    scope = OffloadScope(**cpu_scope_kwargs)
    with scope:
        with pytest.raises(RuntimeError, match="already active"):
            scope.__enter__()
        assert scope.active
    with scope:  # sequential reuse is fine
        pass


def test_prefetch_stays_within_one_scope_entry(cpu_scope_kwargs):
    """Backward of graph B must not pull graph A's tensors back ahead of time."""
    model = Stack()
    scope = OffloadScope(**cpu_scope_kwargs)
    with scope:
        loss_a = model(torch.randn(2, 4, 32))
    with scope:
        loss_b = model(torch.randn(2, 4, 32))
    loss_b.backward()
    assert scope.stats.prefetch_hits == 2
    loss_a.backward()
    assert scope.stats.prefetch_hits == 4 and scope.stats.restored_tensors == 6


def test_never_unpacked_branch_does_not_leak(cpu_scope_kwargs):
    """A saved tensor whose node never runs backward is freed with the graph."""
    x = torch.randn(8, 64, requires_grad=True)
    frozen = torch.randn(8, 64)
    with OffloadScope(**cpu_scope_kwargs) as scope:
        for _ in range(20):
            used = mark(x * 2)
            unused = mark(frozen * 3 + x.detach())  # no grad: nothing saves it
            branch = (mark(x * 4) * x).sum()  # saved, but never backpropagated
            (used * used).sum().backward()
            del branch, unused, used
    gc.collect()
    assert scope.tracked_state() == 0
    assert hsoffload.pool_stats().in_use_bytes == 0


@pytest.mark.slow
def test_thousand_steps_flat(cpu_scope_kwargs):
    model = Stack(dim=16, layers=2)
    x = torch.randn(2, 4, 16)
    held: list[int] = []
    tracked: list[int] = []
    scope_ref = None
    for step in range(1000):
        with OffloadScope(**cpu_scope_kwargs) as scope:
            model(x).backward()
        if step % 100 == 99:
            held.append(hsoffload.pool_stats().held_bytes)
            tracked.append(scope.tracked_state())
        if step == 0:
            scope_ref = weakref.ref(scope)
        assert scope.stats.offloaded_tensors == 2
    gc.collect()
    assert len(set(held)) == 1, held
    assert set(tracked) == {0}
    assert scope_ref() is None  # scopes are not kept alive by the engine
    assert hsoffload.pool_stats().in_use_bytes == 0


def test_max_pool_bytes_applies_when_entered(cpu_scope_kwargs):
    limits = torch.classes.hsoffload.OffloadScope
    original = limits.pool_limit()
    try:
        scope = OffloadScope(max_pool_bytes=1 << 20, **cpu_scope_kwargs)
        assert limits.pool_limit() == original  # building a scope changes nothing process-wide
        with scope:
            assert limits.pool_limit() == 1 << 20
            x = torch.randn(1 << 19, requires_grad=True)  # 2 MiB: over the bound, served unpooled
            (mark(x * 1) * x).sum().backward()
        assert hsoffload.pool_stats().held_bytes <= 1 << 20
        assert scope.stats.offloaded_tensors == 1
    finally:
        limits.set_pool_limit(original)


def test_entering_a_scope_active_on_another_thread_says_scopes_are_per_thread(cpu_scope_kwargs):
    scope = OffloadScope(**cpu_scope_kwargs)
    err: list[BaseException] = []
    with scope:
        def other() -> None:
            try:
                with scope:
                    pass
            except RuntimeError as exc:
                err.append(exc)

        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert err and "per thread" in str(err[0]) and "one OffloadScope per thread" in str(err[0])


def test_exiting_scopes_out_of_order_is_refused_naming_both(cpu_scope_kwargs):
    outer, inner = OffloadScope(**cpu_scope_kwargs), OffloadScope(**cpu_scope_kwargs)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match=rf"exiting offload scope #{outer.id} while scope #{inner.id}"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    # The engine refuses it too (the raw class, as TorchScript users call it).
    a, b = torch.classes.hsoffload.OffloadScope(), torch.classes.hsoffload.OffloadScope()
    a.enter()
    b.enter()
    with pytest.raises(RuntimeError, match=rf"exiting offload scope #{int(a.id())} while scope #{int(b.id())}"):
        a.exit()
    b.exit()
    a.exit()




def _rewritten_between_saves(case: str, hooks: str, scope_kwargs: dict | None = None) -> tuple[torch.Tensor, ...]:
    """Gradients of x and w, and the number of host copies, for one fused output `x @ w` saved twice with its second
    half rewritten through `.data` between the two saves. hooks: "offload" (an OffloadScope with scope_kwargs), or
    "copy_at_save" (the reference: a pack hook that clones, as `save_on_cpu` copies each saved tensor at its own
    save)."""
    torch.manual_seed(0)
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 96, requires_grad=True)

    def run() -> None:
        first, second = two_saves(x @ w, case)
        y1 = mark(first).sin()  # first saved: its record copies the whole storage (it spans >= 3/4 of it)
        second.data.mul_(2.0)
        y2 = mark(second).cos()  # second saved, with its new bytes
        (y1.sum() + y2.sum()).backward()

    if hooks == "copy_at_save":
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            run()
        return x.grad, w.grad, 0
    with OffloadScope(**(scope_kwargs or {})) as scope:
        run()
    return x.grad, w.grad, scope.stats.offloaded_tensors


@pytest.mark.parametrize("case", STALE_CASES)
def test_each_save_restores_the_bytes_it_had_at_its_own_save(case, cpu_scope_kwargs):
    """By default no save shares another node's copy (M24): the gradients are the copy-at-save reference's, bit for
    bit, whichever way the rewritten bytes reached the second save."""
    ref_x, ref_w, _ = _rewritten_between_saves(case, "copy_at_save")
    got_x, got_w, copies = _rewritten_between_saves(case, "offload", cpu_scope_kwargs)
    assert copies == 2  # the second save got its own copy
    assert torch.equal(got_x, ref_x) and torch.equal(got_w, ref_w)


@pytest.mark.parametrize("case", STALE_CASES)
def test_share_copies_shares_across_nodes_and_its_contract_says_what_that_costs(case, cpu_scope_kwargs):
    """The opt-in `share_copies=True`: without a write between the saves, one copy where sharing is allowed (a view
    inside a saved tensor, the chunks of one split) and gradients equal to no offload; with a version-bypassing write
    between them, what its contract says: the second save restores the first save's bytes."""
    shared = dict(cpu_scope_kwargs, share_copies=True)
    ref_x, _, _ = _rewritten_between_saves(case, "copy_at_save")
    got_x, _, copies = _rewritten_between_saves(case, "offload", shared)
    if case == "slices":  # two slicing nodes, neither inside the other's save: a copy each even when shared
        assert copies == 2 and torch.equal(got_x, ref_x)
    else:
        assert copies == 1 and not torch.equal(got_x, ref_x)  # the documented cost of the opt-in


class _SaveWithViews(torch.autograd.Function):
    """Saves a tensor and two views of it in one save_for_backward: one node's saves."""

    @staticmethod
    def forward(ctx, a: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(a, a[:, :32], a[:, 32:])
        return a * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        a, left, right = ctx.saved_tensors
        return grad * 2 + 0 * torch.cat([left, right], dim=1) * a


def test_one_nodes_saves_share_one_copy(cpu_scope_kwargs):
    """No code runs between the saves one autograd node makes (`x * x` saves x twice; one save_for_backward of a
    tensor and its views): they share one copy by default, bitwise equal to no offload."""
    x0 = torch.randn(64, 64, requires_grad=True)

    def step(x: torch.Tensor) -> None:
        h = x * 1.0
        ((h * h).sum() + _SaveWithViews.apply(h * 1.0).sum()).backward()

    step(x0)
    x = x0.detach().clone().requires_grad_()
    with OffloadScope(policy="all", **cpu_scope_kwargs) as scope:
        step(x)
    s = scope.stats
    assert s.saved_tensors_seen == 5 and s.offloaded_tensors == 2, s  # h twice by one mul; three by the Function
    assert torch.equal(x.grad, x0.grad)


class _SaveTwo(torch.autograd.Function):
    """Saves a then b; backward reads them in that order (as a layer's recompute reads its group)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        a, b = ctx.saved_tensors
        return grad * b, grad * a


def test_a_second_backward_over_a_retained_graph_prefetches_like_the_first(cpu_scope_kwargs):
    """Restoring the first tensor of a prefetch group brings the rest of the group back (same-group prefetch). Each
    pass of backward over a retained graph does so, the second as the first: a pass ends with its graph task, and
    with it what "restored already" means."""
    a0 = torch.randn(64, 64, requires_grad=True)
    b0 = torch.randn(64, 64, requires_grad=True)
    with OffloadScope(prefetch_depth=1, **cpu_scope_kwargs) as scope:
        scope._scope.begin_group()
        y = _SaveTwo.apply(mark(a0 * 1), mark(b0 * 1)).sum()
        scope._scope.end_group()
        y.backward(retain_graph=True)
        first = scope.stats
        y.backward()
        second = scope.stats
    assert first.offloaded_tensors == 2 and first.prefetch_hits == 1, first
    assert second.prefetch_hits == 2 and second.restored_tensors == 4, second
    assert torch.equal(a0.grad, 2 * b0) and torch.equal(b0.grad, 2 * a0)


def test_a_backward_that_raised_does_not_stop_later_early_ends_from_releasing(cpu_scope_kwargs):
    """A backward that raises never runs its end-of-task callbacks; the next entry of the same scope must still give
    back what an early-ending backward (autograd.grad on a middle input) leaves prefetched."""

    class Boom(RuntimeError):
        pass

    class FailInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            return x.clone()

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001, ANN205
            raise Boom("raised in backward")

    model = Stack(layers=4)
    x = torch.randn(16, 32)
    scope = OffloadScope(prefetch_depth=1, **cpu_scope_kwargs)
    with scope:
        with pytest.raises(Boom):
            FailInBackward.apply(model(x)).backward()
    with scope:
        h = model.emb(x)
        mids = []
        for block in model.blocks:
            mids.append(h)
            h = checkpoint(block, mark(h), use_reentrant=False)
        released = scope.stats.released_restores
        torch.autograd.grad(h.sum(), [mids[1]])  # blocks 2 and 1 only: block 0's prefetched input is never used
        assert scope.stats.released_restores > released, scope.stats
