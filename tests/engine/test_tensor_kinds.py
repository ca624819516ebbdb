"""Every kind of tensor a user can mark either round-trips exactly through offload or passes through untouched.

"Exactly": values, dtype, device, sizes, strides, conj and neg bits. "Passes through": the very tensor object comes
back and `skipped_marked_tensors` counts it; never a crash, never a wrong value.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import hsoffload
from hsoffload import OffloadScope
from support.subclasses import Wrapper

pack_op = torch.ops.hsoffload.offload_pack
unpack_op = torch.ops.hsoffload.offload_unpack


def _roundtrip(x: torch.Tensor) -> tuple[torch.Tensor, hsoffload.OffloadStats]:
    scope = OffloadScope(offload_cpu_tensors=True, min_offload_size=0)
    with scope:
        scope.mark(x)
        handle = pack_op(x, int(scope._scope.id()))
    return unpack_op(handle), scope.stats


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    assert a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg()
    assert torch.equal(a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg())


@pytest.mark.parametrize("kind", ["conj", "neg", "conj_slice", "conj_of_transpose"])
def test_conj_and_neg_views_keep_their_bit(kind):
    z = torch.randn(6, 8, dtype=torch.complex64)
    x = {
        "conj": lambda: z.conj(),
        "neg": lambda: z.conj().imag,  # imag of a conj view is a neg view
        "conj_slice": lambda: z.conj()[1:4, 2:],
        "conj_of_transpose": lambda: z.t().conj(),
    }[kind]()
    assert x.is_conj() or x.is_neg()
    out, stats = _roundtrip(x)
    assert stats.offloaded_tensors == 1
    _same(out, x)


def test_conj_view_gradient_equals_stock():
    def run(offload: bool) -> torch.Tensor:
        torch.manual_seed(0)
        w = torch.randn(5, 5, dtype=torch.complex64, requires_grad=True)
        z = torch.randn(5, 5, dtype=torch.complex64) * 1
        h = z.conj()
        if offload:
            with OffloadScope(offload_cpu_tensors=True, min_offload_size=0) as scope:
                scope.mark(h)
                (h @ w).abs().sum().backward()
            assert scope.stats.offloaded_tensors == 1
        else:
            (h @ w).abs().sum().backward()
        return w.grad

    assert torch.equal(run(False), run(True))


def _passes_through(x: torch.Tensor) -> None:
    out, stats = _roundtrip(x)
    assert out is x, f"{type(x).__name__} did not pass through"
    assert stats.marked_tensors == 1 and stats.skipped_marked_tensors == 1 and stats.offloaded_tensors == 0


def test_wrapper_subclass_passes_through_instead_of_crashing():
    _passes_through(Wrapper(torch.randn(4, 4)))


def test_fake_tensor_made_outside_its_mode_passes_through():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.empty(8, 8)
    assert fake.fake_mode is mode
    _passes_through(fake)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]), id="nested_strided"),
        pytest.param(
            lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged),
            id="nested_jagged",
        ),
        pytest.param(lambda: torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8), id="quantized"),
        pytest.param(lambda: torch.randn(4, 4).to_sparse(), id="sparse_coo"),
        pytest.param(lambda: torch.randn(4, 4).to_sparse_csr(), id="sparse_csr"),
        pytest.param(lambda: torch.randn(4, 4, device="meta"), id="meta"),
        pytest.param(lambda: torch.randn(4, 4).to_mkldnn(), id="mkldnn",
                     marks=pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no mkldnn")),
    ],
)
def test_tensors_without_plain_storage_pass_through(make):
    _passes_through(make())


def test_zero_size_and_inference_tensors():
    _passes_through(torch.empty(0, 3))  # nothing to copy: kept, counted
    with torch.inference_mode():
        x = torch.randn(16)
    out, stats = _roundtrip(x)
    assert stats.offloaded_tensors == 1
    _same(out, x)


def test_config_refuses_bools_for_every_integer_option():
    for name in ("min_offload_size", "prefetch_depth", "max_pool_bytes"):
        with pytest.raises(ValueError, match=name):
            hsoffload.OffloadConfig(**{name: True})


@pytest.mark.slow
def test_warnings_reach_stderr_without_logging_setup_once():
    code = (
        "import torch, hsoffload\n"
        "for _ in range(3):\n"
        "    with hsoffload.OffloadScope():\n"
        "        x = torch.randn(4, requires_grad=True)\n"
        "        (x * x).sum().backward()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "none was marked" in line]
    assert len(lines) == 1 and lines[0].startswith("WARNING hsoffload:"), out.stderr


@pytest.mark.slow
def test_warnings_go_through_the_applications_handlers_when_configured():
    code = (
        "import logging, sys, torch\n"
        "logging.basicConfig(stream=sys.stdout, format='APP %(name)s %(message)s')\n"
        "import hsoffload\n"
        "with hsoffload.OffloadScope():\n"
        "    x = torch.randn(4, requires_grad=True)\n"
        "    (x * x).sum().backward()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "APP hsoffload" in out.stdout and "none was marked" in out.stdout
    assert "none was marked" not in out.stderr  # once, through the application's handler only

