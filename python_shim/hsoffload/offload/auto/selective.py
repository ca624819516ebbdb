"""The `sac` choice: a layer's projections (the linear layers' matmuls) offloaded by selective activation
checkpointing, the rest recomputed; and the probe's record of a layer's projections."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from ...targets import LAYER_ATTR, unwrap_marking

logger = logging.getLogger("hsoffload")


# The `sac` choice: a layer's projections (the linear layers' matmuls) offloaded by SAC, the rest recomputed. Absent
# (None) on torch releases without CheckpointPolicy.MUST_CPU_OFFLOAD: then the choice is never offered.
_CPU_OFFLOAD = getattr(CheckpointPolicy, "MUST_CPU_OFFLOAD", None)
PROJECTIONS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})


def _projections_to_host(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The `sac` choice's selective-checkpoint policy: the projections' outputs to the host, the rest recomputed."""
    return _CPU_OFFLOAD if op in PROJECTIONS else CheckpointPolicy.PREFER_RECOMPUTE


# The context_fn a `sac` layer's checkpoint is called with (one object: the controller recognises its own).
SAC_CONTEXT = functools.partial(create_selective_checkpoint_contexts, _projections_to_host)


def _selective_ready(layer: torch.nn.Module) -> Optional[functools.partial]:
    """The layer's checkpoint function if the `sac` choice can give it a selective context: torch's non-reentrant
    checkpoint as transformers binds it, without a context_fn of the user's (whose SAC would be replaced)."""
    func = unwrap_marking(getattr(layer, LAYER_ATTR, None))
    if _CPU_OFFLOAD is None or not isinstance(func, functools.partial):
        return None
    kw = func.keywords
    if kw.get("use_reentrant") is not False or kw.get("context_fn") not in (None, SAC_CONTEXT):
        return None
    return func


def _is_selective(func: Any) -> bool:
    """Whether a layer's checkpoint function is the one the `sac` choice installed (wrapped by the patch or not)."""
    func = unwrap_marking(func)
    return isinstance(func, functools.partial) and func.keywords.get("context_fn") is SAC_CONTEXT


class _Projections(TorchDispatchMode):
    """The projections of one forward, in order: each output's bytes and time (synchronized around each: a probe's
    forward, once per kind of layer); `read` how many came before the last saved tensor (set by the probe's pack
    hook), the ones a recompute reaches."""

    def __init__(self, synchronize: Callable[[], None]) -> None:
        super().__init__()
        self.synchronize = synchronize
        self.made: list[tuple[int, float]] = []
        self.read = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func not in PROJECTIONS:
            return func(*args, **(kwargs or {}))
        self.synchronize()
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.synchronize()
        self.made.append((out.numel() * out.element_size(), time.perf_counter() - t0))
        return out

    def saved(self) -> None:
        self.read = len(self.made)

    def measured(self) -> tuple[int, float]:
        """The bytes of every projection's output (all are copied in a sac layer's first step, and in every step on
        torch releases that ask the policy again in the recompute, 2.11: counted whole, for the host, the window and
        the copies) and the time of those a recompute reads (what it skips)."""
        return sum(b for b, _ in self.made), sum(t for _, t in self.made[:self.read])
