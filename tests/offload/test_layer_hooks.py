"""Module hooks that replace a decoder layer's input, on both forms of transformers' checkpointing layer.

transformers 4.57-5.22 checkpoint `Module.__call__` (the module's hooks run inside the checkpoint, which saves the
layer's input as it was called); 5.23 checkpoints the layer's wrapped `forward` (hooks outside: the checkpoint saves
what the hooks returned). Either way the tensor the checkpoint saves must be the marked one, or it silently stays on
the device. Bit-for-bit comparisons cannot see that (an unmarked input is kept, correctly), so every test here
counts the bytes each layer offloaded against the bytes of the tensor its checkpoint saves. The main venv runs the
5.23 form, the transformers matrix (4.57) and the twin (5.17) the other.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from support import hf_tiny as H
import hsoffload
from hsoffload.targets import layer_checkpoints_in_forward

FORWARD_FORM = layer_checkpoints_in_forward()
HIDDEN = 32  # hf_tiny's width
SCOPE = {"offload_cpu_tensors": True, "min_offload_size": 0}


def hidden_bytes(dtype: torch.dtype) -> int:
    return H.BATCH * H.SEQ * HIDDEN * dtype.itemsize


def checkpointed_model() -> torch.nn.Module:
    model = H.tiny_model("llama")
    H.enable_checkpointing(model, reentrant=False)
    return model


def layers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers)


def offload_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, hsoffload.OffloadScope]:
    hsoffload.patch()
    with hsoffload.offload_hidden_states(model, **SCOPE) as scope:
        loss = model(**batch).loss
        loss.backward()
    return loss.detach(), scope


def assert_each_layer_offloaded(scope: hsoffload.OffloadScope, nbytes: int) -> None:
    stats = scope.layer_stats
    assert len(stats) == H.LAYERS, stats
    for name, layer in stats.items():
        assert (layer.calls, layer.offloaded_tensors, layer.offloaded_bytes) == (1, 1, nbytes), (name, layer)


def copying_pre_hook(module: torch.nn.Module, args: tuple) -> tuple:
    """A pre-forward hook that hands the layer a new tensor (as a cast or a device move does)."""
    return (args[0] * 1.0,) + args[1:]


def test_a_pre_forward_hook_replacing_the_input_still_offloads_what_the_checkpoint_saves() -> None:
    model = checkpointed_model()
    stock = H.twin(model)
    for layer in layers_of(model) + layers_of(stock):
        layer.register_forward_pre_hook(copying_pre_hook)
    batch = H.batches(1)[0]
    loss, scope = offload_step(model, batch)
    assert_each_layer_offloaded(scope, hidden_bytes(torch.float32))
    stock_loss = stock(**batch).loss
    stock_loss.backward()
    assert torch.equal(loss, stock_loss.detach())
    for (name, p), q in zip(model.named_parameters(), stock.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_an_accelerate_hook_replacing_the_input_still_offloads_what_the_checkpoint_saves() -> None:
    from accelerate.hooks import ModelHook, add_hook_to_module

    class CopyInput(ModelHook):  # what AlignDevicesHook does when the input is on another device
        def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple:
            return (args[0] * 1.0,) + args[1:], kwargs

    model = checkpointed_model()
    for layer in layers_of(model):
        add_hook_to_module(layer, CopyInput())
    _, scope = offload_step(model, H.batches(1)[0])
    assert_each_layer_offloaded(scope, hidden_bytes(torch.float32))


def test_a_layer_subclass_wrapped_twice_is_marked_and_offloaded_once() -> None:
    """5.23 wraps every subclass's forward (a user's subclass, FSDP2's generated FSDP<Layer>); only the outermost
    wrapper checkpoints, so the layer's input is marked once."""
    model = checkpointed_model()
    base = type(layers_of(model)[0])

    class Twice(base):  # type: ignore[misc, valid-type]
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return super().forward(*args, **kwargs)

    for layer in layers_of(model):
        layer.__class__ = Twice
    _, scope = offload_step(model, H.batches(1)[0])
    assert_each_layer_offloaded(scope, hidden_bytes(torch.float32))
    assert scope.stats.marked_tensors == H.LAYERS


def test_fsdp2_cast_forward_inputs_offloads_the_tensor_the_checkpoint_saves(one_rank_mesh: Any) -> None:
    """FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True) casts each layer's input to bf16 in its pre-forward hook
    (on FSDP2's generated subclass of the layer). 5.23 saves the bf16 cast, 4.57-5.22 the fp32 input."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def sharded() -> torch.nn.Module:
        model = checkpointed_model()
        # Each layer's output back in fp32, so that every layer (not only the first) is called with fp32 and casts it.
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32, cast_forward_inputs=True)
        for layer in layers_of(model):
            fully_shard(layer, mesh=one_rank_mesh, mp_policy=policy)
        fully_shard(model, mesh=one_rank_mesh)
        assert type(layers_of(model)[0]).__name__.startswith("FSDP")
        return model

    batch = H.batches(1)[0]
    try:  # stock first: with the hooks inside the checkpoint, torch 2.11's FSDP2 does not cast again in the recompute
        sharded()(**batch).loss.backward()
    except RuntimeError as e:
        if FORWARD_FORM or "to have the same dtype" not in str(e):
            raise
        pytest.skip(f"this torch/transformers fails without hsoffload too (stock FSDP2 mixed precision): {e}")
    _, scope = offload_step(sharded(), batch)
    assert_each_layer_offloaded(scope, hidden_bytes(torch.bfloat16 if FORWARD_FORM else torch.float32))


# --------------------------------------------------------------------------- the per-call swap of the checkpoint function


def run(layer: torch.nn.Module) -> hsoffload.OffloadStats:
    hsoffload.patch()
    x = torch.randn(4, 8, requires_grad=True) * 1.0
    with hsoffload.OffloadScope(**SCOPE) as scope:
        layer(x).sum().backward()
    return scope.stats


def test_the_layers_checkpoint_function_is_back_after_the_call_even_when_it_raises() -> None:
    layer = H.tiny_layer()
    before = dict(layer.__dict__)
    assert run(layer).offloaded_tensors == 1
    assert layer.__dict__ == before

    def failing(hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("inside the layer")

    layer.linear.forward = failing
    with pytest.raises(RuntimeError, match="inside the layer"), hsoffload.OffloadScope(**SCOPE):
        layer(torch.randn(4, 8, requires_grad=True) * 1.0)
    del layer.linear.forward
    assert layer._gradient_checkpointing_func is before["_gradient_checkpointing_func"]


def test_a_checkpoint_function_on_the_class_is_marked_and_left_on_the_class() -> None:
    class OnClass(H.TinyLayer):
        _gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)

    layer = H.tiny_layer(cls=OnClass)
    del layer._gradient_checkpointing_func  # the instance's: the class's remains
    assert run(layer).offloaded_tensors == 1
    assert "_gradient_checkpointing_func" not in layer.__dict__


def test_a_call_that_bypasses_the_checkpoint_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    """An instance `forward` (a wrapper calling the layer's unwrapped forward) skips 5.23's checkpoint, and so the mark;
    hsoffload says so. On 4.57-5.22 the checkpoint wraps __call__ and still runs."""
    from hsoffload._logging import forget_logged

    forget_logged()
    layer = H.tiny_layer()
    layer.forward = types.MethodType(inspect.unwrap(H.TinyLayer.forward), layer)
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        stats = run(layer)
    reported = "never reached its checkpoint function" in caplog.text
    assert (stats.offloaded_tensors, reported) == ((0, True) if FORWARD_FORM else (1, False))


def test_a_layer_compiled_with_module_compile_is_marked_on_entry() -> None:
    """`layer.compile()` traces the body of Module.__call__ (on 5.23 the checkpoint function too): the mark is applied
    on the layer's entry, where it is a real call, not a traced one."""
    model = checkpointed_model()
    for layer in layers_of(model):
        layer.compile(backend="aot_eager")
    _, scope = offload_step(model, H.batches(1)[0])
    assert scope.stats.offloaded_tensors == H.LAYERS
