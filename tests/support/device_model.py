"""Small models the engine tests share. `Block`: the residual MLP block of the device tests (the emulated device's
suite in tests/device/emu and the GPU tests run the same model, so a result on one device reads against the other).
`LinearStack`: checkpointed tanh(Linear) layers with marked inputs (the capture and reserve tests)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(dim, 2 * dim)
        self.fc2 = torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class LinearStack(torch.nn.Module):
    """`layers` checkpointed tanh(Linear(dim, dim)) layers, each input marked for offload; loss = mean square."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mark = torch.ops.hsoffload.mark_hidden_state
        h = x * 1
        for block in self.blocks:
            h = checkpoint(lambda t, b=block: torch.tanh(b(t)), mark(h), use_reentrant=False)
        return h.pow(2).mean()
