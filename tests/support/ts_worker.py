"""TorchScript training under offload in a process that never imports the hsoffload package.

Usage: python tests/support/ts_worker.py LIBRARY offload|plain OUT.pt
Only `torch.ops.load_library`, the `torch.classes.hsoffload.OffloadScope` class and the raw ops are used, as a
TorchScript or C++ user would. A scripted and a traced model train 6 steps each with the default (profiling)
executor; OUT.pt gets their gradients and the tensors offloaded per step. The caller runs this twice, with and
without offload, each in a fresh process: the executor keeps its state per compiled function, shared by every
instance of a module class, so only two fresh processes start both runs at the same executor stage (the first call
is a profiling run that rounds differently from the optimised runs after it).
"""

from __future__ import annotations

import copy
import sys
import warnings

import torch

warnings.simplefilter("ignore")  # TorchScript is deprecated from torch 2.10
LIBRARY, MODE, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
torch.ops.load_library(LIBRARY)
assert "hsoffload" not in sys.modules

BLOCKS, STEPS = 3, 6


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.hsoffload.mark_hidden_state(x)
        return h + torch.tanh(self.lin(h)) * h


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(BLOCKS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        for block in self.blocks:
            h = block(h)
        return (h * h).mean()


def train(model: torch.nn.Module, offload: bool) -> tuple[list[torch.Tensor], list[int]]:
    grads: list[torch.Tensor] = []
    offloaded: list[int] = []
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        x = torch.randn(4, 16, generator=g, requires_grad=True)
        if offload:
            scope = torch.classes.hsoffload.OffloadScope(0, True, True, True, 1)
            sid = int(scope.id())
            scope.enter()
            try:
                with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: torch.ops.hsoffload.offload_pack(t, sid), torch.ops.hsoffload.offload_unpack
                ):
                    model(x).backward()
            finally:
                scope.exit()
            stats = scope.stats()
            offloaded.append(int(stats["offloaded_tensors"]))
            assert stats["restored_tensors"] >= stats["offloaded_tensors"] > 0, stats  # a record may serve several saves
        else:
            model(x).backward()
        grads.extend([x.grad.clone()] + [p.grad.clone() for p in model.parameters()])
    return grads, offloaded


torch.manual_seed(0)
eager = Model()
example = torch.randn(4, 16, requires_grad=True)
results = {"eager": train(copy.deepcopy(eager), offload=False)}
for kind, make in (("script", torch.jit.script), ("trace", lambda m: torch.jit.trace(m, example))):
    results[kind] = train(make(copy.deepcopy(eager)), offload=MODE == "offload")
torch.save(results, OUT)
