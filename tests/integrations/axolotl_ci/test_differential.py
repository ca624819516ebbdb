"""Axolotl's own hidden-state offload module and hsoffload's drop-in, side by side on the same tiny models.

Wherever docs/axolotl.md claims a drop-in, the two must agree: counters (every field of Axolotl's stats), values and
gradients bit for bit, and the same answers to the same misuse. Where they differ on purpose, the test says so and
docs/axolotl.md lists it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from support import hf_tiny as H
import hsoffload
import hsoffload.axolotl as ours
from axolotl.monkeypatch import checkpoint_activation_offload as stock

MODULES = [pytest.param(stock, id="axolotl"), pytest.param(ours, id="hsoffload")]
FIELDS = [f.name for f in dataclasses.fields(stock.CheckpointActivationOffloadStats)]


class Layer(GradientCheckpointingLayer):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(hidden_states)) * hidden_states


def _layer(reentrant: bool) -> Layer:
    torch.manual_seed(0)
    layer = Layer()
    layer.gradient_checkpointing = True
    layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=reentrant)
    layer.train()
    return layer


def _stats(ctx: Any) -> dict[str, int]:
    return {name: getattr(ctx.stats, name) for name in FIELDS}


def _both(run: Callable[[Any], Any]) -> tuple[Any, Any]:
    """`run(module)` with Axolotl's module, then with ours, each in a clean state."""
    results = []
    for module in (stock, ours):
        hsoffload.unpatch()
        results.append(run(module))
    hsoffload.unpatch()
    return results[0], results[1]


def _same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b, (a, b)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("min_offload_size", [0, 1 << 20])
def test_layer_step_same_counters_and_gradients(reentrant: bool, min_offload_size: int) -> None:
    def run(module: Any) -> Any:
        layer = _layer(reentrant)
        x = torch.randn(4, 16, requires_grad=True)
        ctx = module.CheckpointHiddenStatesOffload(use_streams=False, min_offload_size=min_offload_size)
        with ctx:
            layer(x).sum().backward()
        return _stats(ctx), x.grad, [p.grad for p in layer.parameters()]

    _same(*_both(run))


def test_tiny_llama_steps_same_counters_and_gradients() -> None:
    data = H.batches(2)

    def run(module: Any) -> Any:
        model = H.tiny_model("llama")
        H.enable_checkpointing(model, reentrant=False)
        ctx = module.get_checkpoint_hidden_states_offloading_ctx_manager(use_streams=False, min_offload_size=0)
        out = []
        for batch in data:
            with ctx:
                loss = model(**batch).loss
                loss.backward()
            out.append((_stats(ctx), loss.detach()))
        return out, [p.grad for p in model.parameters()]

    _same(*_both(run))


def test_unmarked_saved_tensors_pass_through_alike() -> None:
    def run(module: Any) -> Any:
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 8)
        x = torch.randn(4, 8, requires_grad=True)
        ctx = module.CheckpointHiddenStatesOffload(use_streams=False, min_offload_size=0)
        with ctx:
            lin(x).square().sum().backward()
        return _stats(ctx), x.grad

    _same(*_both(run))


def test_stats_object_reset_assignment_and_nesting_alike() -> None:
    def run(module: Any) -> Any:
        layer = _layer(False)
        ctx = module.CheckpointHiddenStatesOffload(use_streams=False, min_offload_size=0)
        seen = []
        with ctx:
            layer(torch.randn(4, 16)).sum().backward()
            ctx.stats.marked_tensors += 5  # a caller's in-place change
            seen.append(_stats(ctx))
            ctx.stats = module.CheckpointActivationOffloadStats()
            layer(torch.randn(4, 16)).sum().backward()
            seen.append(_stats(ctx))
            with ctx:  # nested entry of the same instance: accepted, resets the stats
                seen.append(_stats(ctx))
                layer(torch.randn(4, 16)).sum().backward()
            layer(torch.randn(4, 16)).sum().backward()
            seen.append(_stats(ctx))
            ctx.reset()
            seen.append(_stats(ctx))
        return seen

    _same(*_both(run))


def test_manual_mark_of_a_tensor_saved_twice_counts_once_alike() -> None:
    def run(module: Any) -> Any:
        torch.manual_seed(0)
        x = torch.randn(4, 16, requires_grad=True)
        ctx = module.CheckpointHiddenStatesOffload(use_streams=False, min_offload_size=0)
        with ctx:
            h = x * 2
            ctx.mark(h)
            (h * h.sin()).sum().backward()
        return _stats(ctx)["marked_tensors"], x.grad

    _same(*_both(run))


def test_signature_and_defaults_alike() -> None:
    import inspect

    for name in ("CheckpointHiddenStatesOffload", "get_checkpoint_hidden_states_offloading_ctx_manager"):
        a = inspect.signature(getattr(stock, name))
        b = inspect.signature(getattr(ours, name))
        assert [(p.name, p.default) for p in a.parameters.values()] == [
            (p.name, p.default) for p in b.parameters.values()
        ], name
