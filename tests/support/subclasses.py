"""Tensor subclasses for tests: shared by the tensor-kind and corpus suites."""

from __future__ import annotations

import torch
from torch.utils import _pytree


class Wrapper(torch.Tensor):
    """A minimal __torch_dispatch__ wrapper subclass (DTensor-like): its storage is not where its data is."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, Wrapper) else t  # noqa: E731
        out = func(*_pytree.tree_map(unwrap, args), **_pytree.tree_map(unwrap, kwargs or {}))
        return _pytree.tree_map(lambda t: Wrapper(t) if isinstance(t, torch.Tensor) else t, out)
