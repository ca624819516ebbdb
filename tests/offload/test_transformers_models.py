"""Hidden-state offload through the GradientCheckpointingLayer patch on tiny real transformers models.

Offload only moves bytes, so every comparison with the reference (same-seed twin, offload off) is
bit for bit. CPU copies are enabled (`offload_cpu_tensors=True, min_offload_size=0`) so the data
really goes through the host pool and back. Runs under every transformers version of the matrix
(see test_transformers_matrix.py).
"""

from __future__ import annotations

import gc

import pytest
import torch

import hsoffload
from support import hf_tiny as H

REENTRANT = [pytest.param(False, id="nonreentrant"), pytest.param(True, id="reentrant")]
HIDDEN_BYTES = H.BATCH * H.SEQ * 32 * 4  # one float32 hidden-state tensor


def _assert_one_offload_per_layer(stats: list[hsoffload.OffloadStats], layers: int) -> None:
    assert stats, "offload never ran"
    for i, s in enumerate(stats):
        assert s.marked_tensors == layers, f"forward {i}: {s}"
        assert s.offloaded_tensors == layers, f"forward {i}: {s}"
        assert s.restored_tensors == layers, f"forward {i}: {s}"
        assert s.skipped_marked_tensors == 0, f"forward {i}: {s}"
        assert s.offloaded_bytes == layers * HIDDEN_BYTES, f"forward {i}: {s}"
        assert s.restored_bytes == s.offloaded_bytes, f"forward {i}: {s}"


@pytest.mark.parametrize("reentrant", REENTRANT)
@pytest.mark.parametrize("family", list(H.FAMILIES))
def test_offload_is_bitwise_identical(family: str, reentrant: bool) -> None:
    model = H.tiny_model(family)
    H.enable_checkpointing(model, reentrant)
    reference = H.twin(model)
    data = H.batches(3)
    offloaded = H.train_steps(model, data, offload=True)
    plain = H.train_steps(reference, data, offload=False)
    H.assert_bitwise_equal(offloaded, plain)
    _assert_one_offload_per_layer(offloaded[2], H.decoder_layers(model))
    for a, b in zip(model.parameters(), reference.parameters()):  # the optimizer steps agreed too
        assert torch.equal(a, b)


class KeywordCaller(torch.nn.Module):
    """Calls the wrapped decoder layer with `hidden_states=` as a keyword, as some models do."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        return self.layer(*args, hidden_states=hidden_states, **kwargs)


def _strip_wrapper(result: H.StepResult) -> H.StepResult:
    losses, grads, stats = result
    return losses, [{k.replace(".layer.", "."): v for k, v in g.items()} for g in grads], stats


@pytest.mark.parametrize("reentrant", REENTRANT)
def test_keyword_hidden_states_is_offloaded(reentrant: bool) -> None:
    model = H.tiny_model("llama")
    H.enable_checkpointing(model, reentrant)
    positional = H.twin(model)
    model.model.layers = torch.nn.ModuleList(KeywordCaller(layer) for layer in model.model.layers)
    keyword_plain = H.twin(model)
    data = H.batches(3)

    offloaded = H.train_steps(model, data, offload=True)
    _assert_one_offload_per_layer(offloaded[2], H.LAYERS)
    # The patch passes hidden_states on positionally: the same computation as a positional call.
    H.assert_bitwise_equal(_strip_wrapper(offloaded), H.train_steps(positional, data, offload=False))
    stock = _strip_wrapper(H.train_steps(keyword_plain, data, offload=False))
    if reentrant:
        # Stock transformers loses the layers' gradients here (reentrant checkpoint with no tensor
        # input); with a scope active the patch's positional call fixes that.
        assert len(stock[1][0]) < len(offloaded[1][0])
    else:
        H.assert_bitwise_equal(_strip_wrapper(offloaded), stock)


def _lora_model(family: str, reentrant: bool) -> torch.nn.Module:
    peft = pytest.importorskip("peft")
    base = H.tiny_model(family)
    H.enable_checkpointing(base, reentrant)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    model.enable_input_require_grads()  # frozen embeddings: reentrant checkpoints need a grad-requiring input
    model.train()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b), "LoRA B must be non-zero so wrong wiring shows"
    return model


@pytest.mark.parametrize("reentrant", REENTRANT)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_peft_lora(family: str, reentrant: bool) -> None:
    model = _lora_model(family, reentrant)
    reference = H.twin(model)
    data = H.batches(3)
    offloaded = H.train_steps(model, data, offload=True)
    H.assert_bitwise_equal(offloaded, H.train_steps(reference, data, offload=False))
    for s in offloaded[2]:
        assert s.marked_tensors == H.LAYERS, s
        assert s.offloaded_tensors == H.LAYERS and s.skipped_marked_tensors == 0, s
        assert s.restored_tensors == s.offloaded_tensors, s
    trained = set(offloaded[1][0])
    assert trained and all("lora_" in n for n in trained)
    assert sum("lora_A" in n for n in trained) == 2 * H.LAYERS


def test_peft_lora_first_layer_is_offloaded() -> None:
    model = _lora_model("llama", reentrant=False)
    _, _, stats = H.train_steps(model, H.batches(1), offload=True, steps=1)
    _assert_one_offload_per_layer(stats, H.LAYERS)


@pytest.mark.parametrize("reentrant", REENTRANT)
def test_gradient_accumulation_4(reentrant: bool) -> None:
    model = H.tiny_model("llama")
    H.enable_checkpointing(model, reentrant)
    reference = H.twin(model)
    data = H.batches(8)
    offloaded = H.train_steps(model, data, offload=True, accumulation=4)
    H.assert_bitwise_equal(offloaded, H.train_steps(reference, data, offload=False, accumulation=4))
    assert len(offloaded[2]) == 3 * 4
    _assert_one_offload_per_layer(offloaded[2], H.LAYERS)


@pytest.mark.parametrize("reentrant", REENTRANT)
def test_never_unpacked_branch_does_not_leak(reentrant: bool) -> None:
    """A second forward whose graph never runs backward: its host copies go with its graph."""
    model = H.tiny_model("llama")
    H.enable_checkpointing(model, reentrant)
    data = H.batches(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    in_use, held = [], []
    for _ in range(5):
        with hsoffload.offload_hidden_states(model, offload_cpu_tensors=True, min_offload_size=0) as scope:
            loss = model(**data[0]).loss
            side = model(**data[1]).loss  # never backpropagated
            loss.backward()
        assert scope.stats.offloaded_tensors == 2 * H.LAYERS
        assert scope.stats.restored_tensors == H.LAYERS
        assert scope.tracked_state() > 0  # the side graph still holds its host copies
        del side
        gc.collect()
        assert scope.tracked_state() == 0
        opt.step()
        opt.zero_grad(set_to_none=True)
        pool = hsoffload.pool_stats()
        in_use.append(pool.in_use_bytes)
        held.append(pool.held_bytes)
    assert in_use == [0] * 5, in_use
    assert len(set(held[1:])) == 1, f"host pool grows across steps: {held}"


def test_no_scope_no_marks_and_eval_untouched() -> None:
    """Outside a scope, in eval mode or under no_grad the patched layer behaves exactly as stock."""
    hsoffload.patch()
    model = H.tiny_model("llama")
    H.enable_checkpointing(model, False)
    batch = H.batches(1)[0]
    before = hsoffload.cumulative_stats()
    model(**batch).loss.backward()
    with hsoffload.offload_hidden_states(model, offload_cpu_tensors=True, min_offload_size=0) as scope:
        with torch.no_grad():
            model(**batch)
        model.eval()
        model(**batch).loss.backward()
    model.train()
    assert scope.stats.marked_tensors == 0
    assert hsoffload.cumulative_stats().marked_tensors == before.marked_tensors


@pytest.mark.parametrize("impl", ["no_reentrant", "reentrant"])
def test_fsdp_checkpoint_wrapper_layers_are_offloaded(impl: str, caplog: pytest.LogCaptureFixture) -> None:
    """FSDP-style activation checkpointing (torch's CheckpointWrapper around each decoder layer) checkpoints
    from outside the layer's __call__; its inputs are still marked and offloaded, with no false warning."""
    import functools
    import logging

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from transformers.modeling_layers import GradientCheckpointingLayer

    checkpoint_impl = CheckpointImpl.NO_REENTRANT if impl == "no_reentrant" else CheckpointImpl.REENTRANT

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=checkpoint_impl),
            check_fn=lambda m: isinstance(m, GradientCheckpointingLayer),
        )
        return model

    model = H.tiny_model("llama")
    model.enable_input_require_grads()  # reentrant checkpoints save inputs only when one requires grad
    reference = wrap(H.twin(model))
    model = wrap(model)
    data = H.batches(3)

    def forward(m: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return m(**batch, use_cache=False).loss  # the wrapper, unlike transformers, does not turn the cache off

    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        offloaded = H.train_steps(model, data, offload=True, forward=forward)
    H.assert_bitwise_equal(H.train_steps(reference, data, offload=False, forward=forward), offloaded)
    for s in offloaded[2]:
        assert s.offloaded_tensors == H.LAYERS and s.restored_tensors == H.LAYERS, s
    assert not [r for r in caplog.records if "gradient checkpointing" in r.getMessage()]
