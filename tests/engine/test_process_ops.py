"""The process-wide ops (`torch.ops.hsoffload.pool_limit`, `set_pool_limit`, ...: docs/ops.md, "Process-wide ops")
from TorchScript and from Python, against the deprecated statics of the OffloadScope class they replace."""

from __future__ import annotations

import warnings
from typing import Iterator

import pytest
import torch

from hsoffload import engine

_LIMIT = 3 << 20  # a pool bound no other setting of the suite uses


@pytest.fixture
def pool_limit_restored() -> Iterator[None]:
    yield
    engine.set_pool_limit(-1)  # the default: the pool's bound follows the host budget


def _script(fn):  # noqa: ANN001, ANN202
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript is deprecated from torch 2.10
        return torch.jit.script(fn)


def _limits_both_ways(limit: int) -> tuple[int, int]:
    torch.ops.hsoffload.set_pool_limit(limit)
    return torch.ops.hsoffload.pool_limit(), torch.classes.hsoffload.OffloadScope.pool_limit()


def _set_by_static(limit: int) -> int:
    torch.classes.hsoffload.OffloadScope.set_pool_limit(limit)
    return torch.ops.hsoffload.pool_limit()


def _set_only(x: torch.Tensor, limit: int) -> torch.Tensor:
    torch.ops.hsoffload.set_pool_limit(limit)  # no result: only its effect on the process keeps it
    return x + 1


def test_torchscript_reaches_a_process_wide_function_both_ways(pool_limit_restored: None) -> None:
    both = _script(_limits_both_ways)
    assert both(_LIMIT) == (_LIMIT, _LIMIT)
    assert engine.pool_limit() == _LIMIT
    by_static = _script(_set_by_static)
    assert by_static(_LIMIT + 4096) == _LIMIT + 4096
    assert both(_LIMIT) == (_LIMIT, _LIMIT)


def test_a_setter_survives_torchscript_dead_code_elimination(pool_limit_restored: None) -> None:
    """The op's result is unused; TorchScript's profiling executor optimises from the second call on, so each call
    sets another bound and the bound is read after each."""
    fn = _script(_set_only)
    for i in range(4):
        engine.set_pool_limit(-1)
        fn(torch.zeros(2), _LIMIT + i * 4096)
        assert engine.pool_limit() == _LIMIT + i * 4096, f"call {i}: set_pool_limit was dropped"


def test_the_deprecated_statics_answer_as_the_ops() -> None:
    static = torch.classes.hsoffload.OffloadScope
    for name in ("pool_limit", "pool_stats", "local_size", "engine_detects_capture"):
        assert getattr(torch.ops.hsoffload, name)() == getattr(static, name)(), name


def test_lazy_zeros_like_as_an_op_and_as_the_deprecated_static() -> None:
    like = torch.empty(3, 5, dtype=torch.bfloat16, device="meta")
    for out in (engine.lazy_zeros_like(like), torch.classes.hsoffload.InitSkipRecord.lazy_zeros_like(like)):
        assert out.device.type == "cpu" and out.shape == like.shape and out.dtype == like.dtype
        assert out.is_contiguous() and not out.any()
    a, b = engine.lazy_zeros_like(like), engine.lazy_zeros_like(like)
    assert a.data_ptr() != b.data_ptr()
