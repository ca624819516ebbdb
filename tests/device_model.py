"""The residual MLP block the device tests share: the emulated device's suite (tests/emu) and the GPU tests
(test_gpu.py, test_gpu_engine.py) run the same model, so a result on one device reads against the other."""

from __future__ import annotations

import torch


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(dim, 2 * dim)
        self.fc2 = torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))
