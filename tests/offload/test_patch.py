"""The GradientCheckpointingLayer patch: idempotence, exact revert, chaining, and logged-once reports."""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Iterator

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from support import hf_tiny as H
import hsoffload
from hsoffload._logging import forget_logged
from hsoffload.targets import checkpointing_enable_name, enable_checkpointing

from hsoffload.offload import patch as hpatch  # noqa: E402  (the package attribute `patch` is the function)

SCOPE = {"offload_cpu_tensors": True, "min_offload_size": 0}


# transformers 4.57-5.22 define GradientCheckpointingLayer.__call__ (the checkpoint wraps Module.__call__); 5.23
# checkpoints a wrapped `forward` and leaves `__call__` to nn.Module: the class has none of its own, and hsoffload's
# patch installs one there (removed again by unpatch). The tests below run on both forms (the main venv has 5.23,
# the matrix's 4.57 child and the twin's 5.17 the other), comparing the class's own attribute, ABSENT included.
ABSENT = "no __call__ of its own"
FORWARD_FORM = "__init_subclass__" in GradientCheckpointingLayer.__dict__


def own_call() -> Any:
    return GradientCheckpointingLayer.__dict__.get("__call__", ABSENT)


def set_own_call(value: Any) -> None:
    """What a library that saved `own_call()` does to put it back."""
    if value is ABSENT:
        if "__call__" in GradientCheckpointingLayer.__dict__:
            del GradientCheckpointingLayer.__call__
    else:
        GradientCheckpointingLayer.__call__ = value


def test_this_transformers_has_the_layer_form_it_is_known_by() -> None:
    """The form is read from the class (hsoffload.targets), never from a version number: pin what each has."""
    import transformers
    from packaging.version import Version

    assert FORWARD_FORM == (Version(transformers.__version__).release >= (5, 23))
    assert (own_call() is ABSENT) == FORWARD_FORM
    assert hpatch.layer_checkpoints_in_forward() == FORWARD_FORM


@pytest.fixture(autouse=True)
def pristine() -> Iterator[Any]:
    """Each test starts unpatched with fresh log-once state, and leaves the class as it found it."""
    hsoffload.unpatch()
    original = own_call()
    assert not getattr(original, "_hsoffload_patched", False)
    forget_logged()
    yield original
    set_own_call(original)
    hpatch.LAYER_CALL.forget()


TinyLayer, tiny_layer = H.TinyLayer, H.tiny_layer


def run_layer(layer: torch.nn.Module, *, keyword: bool = False, requires_grad: bool = True) -> hsoffload.OffloadStats:
    # A non-leaf, like a real hidden state (the engine keeps marked leaves that require grad in place).
    x = torch.randn(4, 8, requires_grad=requires_grad) * 1.0
    with hsoffload.OffloadScope(**SCOPE) as scope:
        out = layer(hidden_states=x) if keyword else layer(x)
        out.sum().backward()
    return scope.stats


def foreign_patch(calls: list[str], tag: str) -> Any:
    """What Axolotl/DeepSpeed do: capture the current attribute and wrap it."""
    previous = GradientCheckpointingLayer.__call__

    def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls.append(tag)
        return previous(self, *args, **kwargs)

    GradientCheckpointingLayer.__call__ = __call__
    return __call__


def test_patch_is_idempotent(pristine: Any) -> None:
    hsoffload.patch()
    installed = own_call()
    hsoffload.patch()
    hsoffload.patch()
    assert own_call() is installed
    assert hsoffload.is_patched()
    assert run_layer(tiny_layer()).offloaded_tensors == 1  # marked once, not once per patch() call


def test_unpatch_restores_exactly(pristine: Any) -> None:
    hsoffload.patch()
    assert own_call() is not pristine
    assert hsoffload.unpatch() is True
    assert own_call() is pristine
    assert not hsoffload.is_patched()
    assert hsoffload.unpatch() is False  # nothing left to undo
    assert run_layer(tiny_layer()).marked_tensors == 0


def test_wrapper_keeps_identity_of_the_wrapped_call(pristine: Any) -> None:
    hsoffload.patch()
    installed = own_call()
    assert installed.__wrapped__ is (torch.nn.Module.__call__ if pristine is ABSENT else pristine)
    assert installed.__name__ == installed.__wrapped__.__name__  # "__call__"; nn.Module's is "_wrapped_call_impl"


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("keyword", [False, True])
def test_tiny_layer_marks_once(reentrant: bool, keyword: bool) -> None:
    hsoffload.patch()
    stats = run_layer(tiny_layer(reentrant), keyword=keyword)
    assert (stats.marked_tensors, stats.offloaded_tensors, stats.restored_tensors) == (1, 1, 1)


def test_cpu_tensor_is_skipped_without_offload_cpu_tensors() -> None:
    hsoffload.patch()
    x = torch.randn(4, 8, requires_grad=True) * 1.0
    with hsoffload.OffloadScope(min_offload_size=0) as scope:
        tiny_layer()(x).sum().backward()
    assert (scope.stats.marked_tensors, scope.stats.skipped_marked_tensors, scope.stats.offloaded_tensors) == (1, 1, 0)


def test_chains_through_a_patch_installed_before(pristine: Any) -> None:
    calls: list[str] = []
    foreign = foreign_patch(calls, "foreign")
    hsoffload.patch()
    assert own_call() is not foreign
    assert run_layer(tiny_layer()).offloaded_tensors == 1
    assert calls == ["foreign"]
    assert hsoffload.unpatch() is True
    assert own_call() is foreign  # theirs, exactly


def test_chains_under_a_patch_installed_after(pristine: Any, caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []
    hsoffload.patch()
    ours = own_call()
    foreign = foreign_patch(calls, "foreign")
    assert hsoffload.is_patched()
    assert run_layer(tiny_layer()).offloaded_tensors == 1
    assert calls == ["foreign"]

    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        assert hsoffload.unpatch() is False  # cannot take ours out of their chain ...
    assert "patched again after hsoffload" in caplog.text
    assert own_call() is foreign  # ... and never removes theirs
    assert not hsoffload.is_patched()
    assert run_layer(tiny_layer()).marked_tensors == 0  # ours is a pass-through now
    assert calls == ["foreign", "foreign"]

    hsoffload.patch()  # re-activates ours instead of stacking a second wrapper
    assert own_call() is foreign
    assert run_layer(tiny_layer()).offloaded_tensors == 1

    set_own_call(ours)  # the foreign library reverts itself
    assert hsoffload.unpatch() is True
    assert own_call() is pristine


def test_forgets_a_patch_someone_else_removed(pristine: Any) -> None:
    hsoffload.patch()
    set_own_call(pristine)  # e.g. a library restoring what it saw before us
    assert not hsoffload.is_patched()
    hsoffload.patch()
    assert own_call() is not pristine
    assert run_layer(tiny_layer()).offloaded_tensors == 1


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(1 for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage())


def test_logs_once_when_model_has_no_layer(caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        assert hsoffload.check_model(model) == 0
        assert hsoffload.check_model(model) == 0
    assert _warnings(caplog, "has no transformers GradientCheckpointingLayer") == 1


def test_logs_once_when_checkpointing_is_off(caplog: pytest.LogCaptureFixture) -> None:
    model = H.tiny_model("llama")
    batch = H.batches(1)[0]
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        assert hsoffload.check_model(model) == 0
        for _ in range(2):
            with hsoffload.offload_hidden_states(model, **SCOPE) as scope:
                model(**batch).loss.backward()
            assert scope.stats.marked_tensors == 0
    assert _warnings(caplog, "gradient checkpointing is off on every layer") == 1
    assert _warnings(caplog, "runs without gradient checkpointing") == 1


class BypassingLayer(TinyLayer):
    """Overrides __call__ without calling GradientCheckpointingLayer's: the patch never sees it."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return torch.nn.Module.__call__(self, *args, **kwargs)


class DelegatingLayer(TinyLayer):
    """Overrides __call__ but calls super().__call__: still offloaded."""

    def __call__(self, hidden_states: torch.Tensor, **kwargs: Any) -> Any:
        return super().__call__(hidden_states * 1.0, **kwargs)


def _subclass_layer(cls: type) -> TinyLayer:
    layer = cls()
    layer.gradient_checkpointing = True
    layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    return layer.train()


def test_subclass_overriding_call_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    hsoffload.patch()
    model = torch.nn.Sequential(_subclass_layer(BypassingLayer), _subclass_layer(DelegatingLayer))
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        assert hsoffload.check_model(model) == 0
        hsoffload.check_model(model)
    assert _warnings(caplog, "BypassingLayer, DelegatingLayer override __call__") == 1
    assert run_layer(model[0]).marked_tensors == 0
    assert run_layer(model[1]).offloaded_tensors == 1


def test_reentrant_without_grad_input_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    hsoffload.patch()
    layer = tiny_layer(reentrant=True)
    x = torch.randn(4, 8)  # no input requires grad: the reentrant checkpoint saves nothing
    with caplog.at_level(logging.WARNING, logger="hsoffload"), pytest.warns(UserWarning):
        for _ in range(2):
            with hsoffload.OffloadScope(**SCOPE) as scope:
                layer(x)
            assert scope.stats.marked_tensors == 0
    assert _warnings(caplog, "uses reentrant checkpointing but none of its tensor inputs requires grad") == 1


def test_transformers_offload_flag_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    model = H.tiny_model("llama")
    if "offload" not in inspect.signature(getattr(model, checkpointing_enable_name())).parameters:
        pytest.skip(f"this transformers has no {checkpointing_enable_name()}(offload=...)")
    enable_checkpointing(model, {"use_reentrant": False}, offload=True)
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        assert hsoffload.check_model(model) == 0
        assert hsoffload.check_model(model) == 0
    assert _warnings(caplog, "offload=True") == 1


def test_check_model_counts_checkpointed_layers() -> None:
    model = H.tiny_model("llama")
    H.enable_checkpointing(model, False)
    assert hsoffload.check_model(model) == H.LAYERS


def test_our_paths_call_no_deprecated_transformers_name() -> None:
    """transformers 5.23 renamed gradient checkpointing to activation checkpointing; the old names warn (FutureWarning,
    attributed to transformers' own module) until v6. hsoffload's paths call the installed version's current names."""
    import warnings

    import hsoffload.fsdp
    from hsoffload.targets import disable_checkpointing

    model = H.tiny_model("llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enable_checkpointing(model, {"use_reentrant": False})
        hsoffload.patch()
        hsoffload.fsdp.patch()
        with hsoffload.offload_hidden_states(model, **SCOPE) as scope:
            batch = H.batches(1)[0]
            model(**batch).loss.backward()
        assert hsoffload.check_model(model) == H.LAYERS
        hsoffload.fsdp.unpatch()
        disable_checkpointing(model)
    assert scope.stats.offloaded_tensors == H.LAYERS
    deprecations = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
                    if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not deprecations, deprecations
