"""Balanced routing for transformers' expert loop under FakeTensorMode.

The loop (`experts_implementation="eager"`, and transformers 4.x's MoE blocks) asks the routing two data-dependent
questions: which experts were hit (`nonzero` on the per-expert token counts, then a Python loop over the answer) and
which tokens each expert takes (`torch.where` on that expert's slice of the one-hot mask). Fake tensors carry no
values, so neither can be answered and the model cannot run under FakeTensorMode. This mode answers both as a
balanced router would: every expert is hit, each takes tokens x experts_per_token / experts of the routed tokens.

The memory the loop keeps for backward is the same for any routing (its total is the routed tokens), what one
expert's compute has in flight is larger the more tokens that expert takes: a balanced router is the expected case,
a collapsed one (every token on one expert) is not modelled.

The experts-hit answer is a real int64 tensor (`arange(experts)`, marked `_routing_index`); the loop's indexing of it
(iteration, `[0]`, `==`, `int()`) runs on real tensors while everything else stays fake. Use inside FakeTensorMode:

    with FakeTensorMode(), BalancedRouting(config.num_experts):
        model(input_ids=ids, labels=ids).loss.backward()
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class BalancedRouting(TorchDispatchMode):
    """Answers the expert loop's `nonzero` calls for `experts` routed experts (see the module's docstring).
    `token_lists` counts the per-expert token lists it made (one per expert per forward, recompute included).

    Only masks derived from a top-k's indices (the router's choice, made into the loop's one-hot expert mask and
    then permuted, summed, compared and indexed: every op output with such an input is tagged `_routing_mask`) are
    answered; any other `nonzero` goes on to FakeTensorMode, which refuses it as data-dependent, so nothing else is
    silently given a routing answer."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.experts = experts
        self.token_lists = 0
        with unset_fake_temporarily():
            self.hit = torch.arange(experts).unsqueeze(1)
        self.hit._routing_index = True  # type: ignore[attr-defined]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if (tensors and any(getattr(t, "_routing_index", False) for t in tensors)
                and not any(isinstance(t, FakeTensor) for t in tensors)):
            with unset_fake_temporarily():  # the experts-hit list and what is indexed out of it: real values
                out = func(*args, **kwargs)
            _tag(out, "_routing_index")
            return out
        from_mask = any(getattr(t, "_routing_mask", False) for t in tensors)
        if func is torch.ops.aten.nonzero.default and from_mask:
            mask = args[0]
            # which experts were hit: per-expert counts, with transformers 5's extra slot for dropped tokens or not
            if mask.dim() == 1 and mask.shape[0] in (self.experts, self.experts + 1):
                return self.hit
            if mask.dim() == 2:  # one expert's (experts_per_token, tokens) slice of the one-hot mask
                slots, tokens = mask.shape
                self.token_lists += 1
                return torch.empty((slots * tokens // self.experts, 2), dtype=torch.long)
            raise AssertionError(f"BalancedRouting: a nonzero of the routing mask it does not know, on shape "
                                 f"{tuple(mask.shape)}")
        out = func(*args, **kwargs)
        if from_mask:
            _tag(out, "_routing_mask")
        elif func is torch.ops.aten.topk.default:  # the router's choice: its indices become the one-hot mask
            _tag(out[1], "_routing_mask")
        return out


def _tag(out: Any, name: str) -> None:
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor):
            setattr(t, name, True)
