"""The third-party classes hsoffload patches, found lazily (importing hsoffload imports neither transformers nor
torch.distributed), and the facts about a decoder layer's checkpoint that the patch and the diagnostics both read.
No state."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch


def layer_class() -> type:
    """transformers' `GradientCheckpointingLayer` (the decoder layer base whose `__call__` is patched)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError as exc:  # transformers < 4.52
        raise ImportError(
            "hsoffload.patch: transformers.modeling_layers.GradientCheckpointingLayer not found; "
            "hidden-state offload needs transformers >= 4.57 (pip install 'transformers>=4.57')"
        ) from exc
    return GradientCheckpointingLayer


def checkpoint_wrapper_class() -> Optional[type]:
    """torch.distributed's `CheckpointWrapper` (FSDP activation checkpointing), or None without distributed."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # torch built without distributed
        return None
    return CheckpointWrapper


def pretrained_model_class() -> type:
    """transformers' `PreTrainedModel` (whose weight-init methods hsoffload.fsdp wraps)."""
    from transformers import PreTrainedModel

    return PreTrainedModel


@functools.lru_cache(maxsize=None)
def first_param_is_hidden_states(cls: type) -> bool:
    """Whether `cls.forward` takes `hidden_states` as its first argument (a keyword may be moved to the front)."""
    try:
        params = list(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) >= 2 and params[1] == "hidden_states"


# The attribute transformers keeps a decoder layer's checkpoint function in (a `functools.partial` of torch's).
LAYER_ATTR = "_gradient_checkpointing_func"

# How deep `unwrap_marking` and `checkpoint_function` look. hsoffload's patch never wraps one of its marking wrappers in
# another (it unwraps first) and `functools.partial` flattens nested partials, so real chains are 1-2 long; the bound
# only turns a cycle or a runaway chain into an error instead of an endless loop.
MAX_UNWRAP_DEPTH = 32


class MarkingWrapper:
    """The function hsoffload's patch puts in `layer._gradient_checkpointing_func` for one call (transformers >= 5.23):
    it marks the hidden_states the layer's checkpoint function receives, then calls `wrapped`, the function it replaced.

    Recognised by its exact type only (`type(f) is MarkingWrapper`), never by an attribute: a user's checkpoint function
    may be an object that answers every attribute (a `unittest.mock` object, a proxy), and walking such an object by
    "has an attribute" never ends (issue 52, item 6)."""

    __slots__ = ("wrapped", "_call")

    def __init__(self, wrapped: Any, call: Callable[..., Any]) -> None:
        self.wrapped = wrapped  # the checkpoint function this wrapper calls (never a MarkingWrapper: see patch.py)
        self._call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<hsoffload marking wrapper of {self.wrapped!r}>"


def unwrap_marking(func: Any) -> Any:
    """`func` without hsoffload's per-call marking wrappers (only `MarkingWrapper` objects are looked through; any other
    object, whatever attributes it answers, is returned as it is)."""
    for _ in range(MAX_UNWRAP_DEPTH):
        if type(func) is not MarkingWrapper:
            return func
        func = func.wrapped
    raise RuntimeError(
        f"hsoffload: more than {MAX_UNWRAP_DEPTH} marking wrappers nested in a layer's {LAYER_ATTR} (a cycle?); "
        "this is a bug in hsoffload, please report it with the model's code"
    )


def checkpoint_function(layer: torch.nn.Module) -> tuple[Any, dict[str, Any]]:
    """The callable behind `layer._gradient_checkpointing_func` and its bound keywords (through hsoffload's marking
    wrapper and `functools.partial` objects only, a bounded number of them)."""
    func = unwrap_marking(getattr(layer, LAYER_ATTR, None))
    keywords: dict[str, Any] = {}
    for _ in range(MAX_UNWRAP_DEPTH):
        if not isinstance(func, functools.partial):
            break
        keywords = {**func.keywords, **keywords}
        func = func.func
    return func, keywords


def uses_reentrant(layer: torch.nn.Module) -> bool:
    """Whether the layer is checkpointed by torch's reentrant checkpoint."""
    func, keywords = checkpoint_function(layer)
    if func is not torch.utils.checkpoint.checkpoint:
        return False
    return keywords.get("use_reentrant") in (True, None)  # torch's default is reentrant


def layer_checkpoints_in_forward() -> bool:
    """Whether transformers checkpoints a decoder layer inside its `forward` (>= 5.23: `__init_subclass__` wraps each
    subclass's `forward`, so module hooks run outside the checkpoint) rather than in `GradientCheckpointingLayer.__call__`
    (4.57-5.22: the checkpoint wraps `Module.__call__`, hooks included). Read from the class's own `__init_subclass__`,
    which hsoffload's `__call__` patch does not touch."""
    return "__init_subclass__" in layer_class().__dict__


def checkpointing_enable_name() -> str:
    """The method a user of the installed transformers calls to checkpoint a model: `activation_checkpointing_enable`
    (>= 5.23; the `gradient_*` names warn there and go in v6) or `gradient_checkpointing_enable` (also without
    transformers: the name is only quoted in messages then)."""
    try:
        if hasattr(pretrained_model_class(), "activation_checkpointing_enable"):
            return "activation_checkpointing_enable"
    except ImportError:
        pass
    return "gradient_checkpointing_enable"


def enable_checkpointing(model: torch.nn.Module, checkpoint_kwargs: Optional[dict[str, Any]] = None,
                         **kwargs: Any) -> None:
    """Checkpoint `model`'s layers through the installed transformers' own method, by its current name (no deprecation
    warning on 5.23, still works on 4.57). `checkpoint_kwargs` go to torch's checkpoint; `kwargs` (`offload=`,
    `every_n_layers=`) to transformers."""
    name = checkpointing_enable_name()
    keyword = "activation_checkpointing_kwargs" if name == "activation_checkpointing_enable" else (
        "gradient_checkpointing_kwargs")
    getattr(model, name)(**{keyword: checkpoint_kwargs}, **kwargs)


def disable_checkpointing(model: torch.nn.Module) -> None:
    """`enable_checkpointing`'s inverse, by the installed transformers' current name."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def current_training_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` for `transformers.TrainingArguments` with `gradient_checkpointing[_kwargs]` under the installed version's
    names (`activation_checkpointing[_kwargs]` from 5.23, where the old ones warn until v6)."""
    from transformers import TrainingArguments

    if "activation_checkpointing" not in getattr(TrainingArguments, "__dataclass_fields__", {}):
        return dict(kwargs)
    renamed = {"gradient_checkpointing": "activation_checkpointing",
               "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs"}
    both = [old for old, new in renamed.items() if old in kwargs and new in kwargs]
    if both:
        raise ValueError(f"current_training_args: {both} given under both names; pass the activation_* ones only")
    return {renamed.get(k, k): v for k, v in kwargs.items()}
