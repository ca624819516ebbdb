"""A calibration step's device peak by phase (`hsoffload.costs.Phases`), read from the allocator's counter."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Optional

import torch

from .device import DeviceMemory

logger = logging.getLogger("hsoffload")


class _PhaseMeter:
    """A calibration step's peak by phase (hsoffload.costs.Phases): the device's peak counter read and reset where
    a phase ends, and the bytes allocated where one starts: at each layer's forward call (the patch's
    `before_layer`, `after_layer`), from autograd hooks on the last layer's output (its backward starts: forward and
    the head are over) and on each layer's input (its backward is over); the first layer's is read without a reset
    (the step's own read, `_first_layer_backward_done`). Only in steps with one forward (`on` goes False at a
    second)."""

    def __init__(self, memory: "DeviceMemory", layers: int) -> None:
        self.memory = memory
        self.layers = layers
        self.on = True
        self.head: Optional[int] = None  # the last layer's forward's end to its backward's start
        self.forward: dict[int, int] = {}  # per layer: its forward's peak
        self.forward_start: dict[int, int] = {}
        self.backward: dict[int, int] = {}  # per layer: its recompute and backward's peak
        self.backward_start: dict[int, int] = {}
        self.other = 0  # peaks of what ran between the phases (the embedding), or in them unread (a probe)
        self.reserved: Optional[int] = None  # the largest reserved peak of the phases read
        self.shared = 0  # the first layer's call's other tensors (mask, position embeddings): Phases.shared

    def read(self, reset: bool = True) -> int:
        peak = int(self.memory.peak() or 0)
        reserved = self.memory.reserved_peak()
        if reserved is not None:
            self.reserved = max(self.reserved or 0, int(reserved))
        if reset:
            self.memory.reset_peak()
        return peak

    def layer_started(self, i: int) -> None:
        if not self.on:
            return
        if i > 0 and i - 1 in self.forward_start:
            self.forward[i - 1] = self.read()
        else:
            self.other = max(self.other, self.read())
        self.forward_start[i] = int(self.memory.allocated() or 0)

    def last_layer_ended(self) -> None:
        if self.on and self.layers - 1 in self.forward_start:
            self.forward[self.layers - 1] = self.read()

    def head_ended(self, grad: torch.Tensor) -> None:
        if self.on and self.head is None:
            self.head = self.read()
            self.backward_start[self.layers - 1] = int(self.memory.allocated() or 0)

    def backward_ended(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.on and self.head is not None and i not in self.backward:
                self.backward[i] = self.read(reset=i > 0)
                if i > 0:
                    self.backward_start[i - 1] = int(self.memory.allocated() or 0)
        return hook

    def complete(self) -> bool:
        n = self.layers
        return (self.on and self.head is not None and len(self.forward) == n and len(self.backward) == n
                and len(self.backward_start) == n)

    def largest(self) -> int:
        """The largest phase read (the step's peak, where its counter was reset at each phase)."""
        return max([self.head or 0, self.other, *self.forward.values(), *self.backward.values()])


def shared_bytes(x: torch.Tensor, args: tuple, kwargs: dict) -> int:
    """The bytes of a layer call's other tensors on `x`'s device (each storage once): the attention mask, the
    position embeddings, made once per forward and held by every checkpointed layer until its backward."""
    seen: dict[int, int] = {}
    for t in _tensors((args[1:] if args else (), kwargs)):
        if t is not x and t.device == x.device and t.layout == torch.strided and t.numel() > 0:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts (a layer call's arguments)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)

