"""A generated corpus: every tensor autograd can save comes back bit-identical or passes through untouched.

Cases are drawn (hypothesis, derandomized: the same cases on every run) from dtype x shape x view kind x storage
offset x conj/neg bit x subclass x marked or not, then packed and unpacked through the real ops, and a float subset
also through a real autograd graph against the same graph without offload. `corpus_regressions.json` holds every
case that ever failed; they run first, always.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hsoffload import OffloadScope  # noqa: E402
from support.subclasses import Wrapper  # noqa: E402

REGRESSIONS = Path(__file__).with_name("corpus_regressions.json")
DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
    "complex64": torch.complex64,
}
VIEWS = ("whole", "slice", "transpose", "step", "expand", "select", "narrow_offset")
BITS = ("none", "conj", "neg")
SUBCLASSES = ("plain", "wrapper", "parameter_like_leaf")


def build(case: dict[str, Any]) -> torch.Tensor:
    g = torch.Generator().manual_seed(case["seed"])
    dtype = DTYPES[case["dtype"]]
    shape = case["shape"]
    if dtype == torch.bool:
        base = torch.rand(shape, generator=g) > 0.5
    elif dtype.is_complex:
        base = torch.randn(shape, generator=g, dtype=dtype)
    else:
        base = (torch.randn(shape, generator=g) * 40).to(dtype)
    view = case["view"]
    if view == "slice" and shape[0] > 1:
        x = base[1:]
    elif view == "transpose" and len(shape) > 1:
        x = base.transpose(0, -1)
    elif view == "step":
        x = base[::2]
    elif view == "expand":
        x = base[:1].expand(3, *shape[1:])
    elif view == "select":
        x = base[-1]
    elif view == "narrow_offset":
        flat = base.reshape(-1)
        x = flat[case["offset"] % flat.numel():]
    else:
        x = base
    if case["bits"] == "conj" and x.is_complex():
        x = x.conj()
    elif case["bits"] == "neg" and x.is_complex():
        x = x.conj().imag  # imag of a conj view carries the neg bit
    if case["subclass"] == "wrapper":
        x = Wrapper(x)
    return x


def check_roundtrip(case: dict[str, Any]) -> str:
    """Packs and unpacks `case` through the ops; returns "offloaded" or "passthrough" (asserts the invariant)."""
    x = build(case)
    scope = OffloadScope(offload_cpu_tensors=True, min_offload_size=0)
    with scope:
        if case["marked"]:
            scope.mark(x)
        handle = torch.ops.hsoffload.offload_pack(x, scope.id)
    out = torch.ops.hsoffload.offload_unpack(handle)
    stats = scope.stats
    if stats.offloaded_tensors == 0:
        assert out is x, f"{case}: neither offloaded nor passed through untouched"
        if case["marked"] and case["subclass"] == "plain" and x.numel() > 0:
            pytest.fail(f"{case}: a marked plain tensor was not offloaded")
        return "passthrough"
    assert case["marked"], f"{case}: an unmarked tensor was offloaded"
    assert type(out) is type(x) and out.dtype == x.dtype and out.device == x.device, case
    assert out.shape == x.shape and out.stride() == x.stride(), case
    assert out.is_conj() == x.is_conj() and out.is_neg() == x.is_neg(), case
    assert torch.equal(out.resolve_conj().resolve_neg(), x.resolve_conj().resolve_neg()), case
    return "offloaded"


def check_autograd(case: dict[str, Any]) -> None:
    """A float case through a real graph: gradients with offload equal those without, bit for bit."""
    def run(offload: bool) -> torch.Tensor:
        x = build(case)
        leaf = x.detach().clone().requires_grad_()
        v = leaf * 1  # a non-leaf saved by the multiplications below
        if offload:
            with OffloadScope(offload_cpu_tensors=True, min_offload_size=0) as scope:
                scope.mark(v)
                (v * v * 0.5).sum().backward()
            assert scope.stats.offloaded_tensors == 1 and scope.stats.restored_tensors >= 1
        else:
            (v * v * 0.5).sum().backward()
        return leaf.grad

    assert torch.equal(run(False), run(True)), case


case_strategy = st.fixed_dictionaries({
    "seed": st.integers(0, 2**16),
    "dtype": st.sampled_from(sorted(DTYPES)),
    "shape": st.lists(st.integers(1, 6), min_size=1, max_size=3),
    "view": st.sampled_from(VIEWS),
    "offset": st.integers(0, 200),
    "bits": st.sampled_from(BITS),
    "subclass": st.sampled_from(SUBCLASSES[:2]),
    "marked": st.booleans(),
})

_counts = {"offloaded": 0, "passthrough": 0, "autograd": 0}


@settings(max_examples=500, derandomize=True, deadline=None, database=None)
@given(case_strategy)
def _corpus(case: dict[str, Any]) -> None:
    _counts[check_roundtrip(case)] += 1
    if case["dtype"] in ("float32", "float64") and case["subclass"] == "plain" and case["bits"] == "none":
        check_autograd(case)
        _counts["autograd"] += 1


def test_regressions_first() -> None:
    cases = json.loads(REGRESSIONS.read_text())
    assert cases, "the regression file lists every case that ever failed; it is never empty"
    for case in cases:
        check_roundtrip({k: v for k, v in case.items() if k != "why"})


def test_generated_corpus(capsys) -> None:
    _corpus()
    total = _counts["offloaded"] + _counts["passthrough"]
    with capsys.disabled():
        print(f"\ncorpus: {total} generated cases ({_counts['offloaded']} offloaded, {_counts['passthrough']} passed "
              f"through), {_counts['autograd']} also through autograd; {len(json.loads(REGRESSIONS.read_text()))} "
              "regression cases")
    assert total >= 500 and _counts["offloaded"] >= 50 and _counts["passthrough"] >= 50 and _counts["autograd"] >= 10
