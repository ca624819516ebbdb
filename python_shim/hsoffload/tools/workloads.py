"""Pieces shared by `hsoffload demo` and `hsoffload bench` (the demo imports this, never the bench package).

Model builders (Llama configs written out locally, never downloaded), one training step, the
saved-activation instrumentation used for the demo plot and the hook-time share, timing helpers,
and the CLI's output (progress bar, tables, JSON, environment description).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch

from ..planning.memory import ModelShape

logger = logging.getLogger("hsoffload")

# ---------------------------------------------------------------------------
# Models


def tiny_llama(layers: int = 4, max_positions: int = 4096) -> ModelShape:
    """A Llama small enough for CPU runs."""
    return ModelShape.llama(hidden=256, intermediate=688, heads=4, kv_heads=2, vocab=1024, layers=layers,
                            max_positions=max_positions)


def llama3_8b(layers: int, max_seq: int) -> ModelShape:
    """Meta-Llama-3-8B layer dimensions (from its published config), `layers` decoder layers."""
    return ModelShape.llama(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, layers=layers,
                            max_positions=max(8192, max_seq), rope_theta=500000.0)


def hidden_state_bytes(shape: ModelShape, batch: int, seq: int, dtype: torch.dtype) -> int:
    """Bytes of the decoder-layer inputs a checkpointed step keeps: layers x batch x seq x hidden."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return shape.layers * batch * seq * shape.hidden * itemsize


def llama_config(shape: ModelShape, attn_implementation: str = "sdpa") -> Any:
    from transformers import LlamaConfig

    fields = {k: v for k, v in shape.to_config().items() if k != "model_type"}
    return LlamaConfig(**fields, attn_implementation=attn_implementation, use_cache=False)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(
    shape: ModelShape,
    *,
    seed: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    causal_lm: bool = True,
    attn_implementation: Optional[str] = None,
) -> torch.nn.Module:
    """A randomly initialised Llama on `device`, identical for identical `seed`.

    `causal_lm=False` builds the head-less `LlamaModel`: the GPU suite uses it because at 128k
    tokens the LM head's fp32 logits (128k x 128256 x 4 bytes = 64 GiB) would dwarf what
    hidden-state offload is about.

    `attn_implementation` defaults to "sdpa" on CPU and "eager" on CUDA: the fused SDPA backward
    kernels on CUDA (flash, and memory-efficient for fp32) accumulate dQ with atomics, so two runs
    of the same model are not bit-identical there, and the demo compares runs bit for bit. The GPU
    suite asks for "sdpa" (memory linear in the sequence length); it compares no bits.
    """
    from transformers import LlamaForCausalLM, LlamaModel

    if attn_implementation is None:
        attn_implementation = "eager" if torch.device(device).type == "cuda" else "sdpa"
    torch.manual_seed(seed)
    cls = LlamaForCausalLM if causal_lm else LlamaModel
    with _default_dtype(dtype), torch.device(device):
        model = cls(llama_config(shape, attn_implementation))
    model.train()
    return model


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def make_batch(
    shape: ModelShape, batch: int, seq: int, *, seed: int, device: torch.device, labels: bool = True
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab, (batch, seq), generator=gen).to(device)
    out = {"input_ids": ids}
    if labels:
        out["labels"] = ids
    return out


def step_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward; the LM loss for a causal LM, else the mean square of the last hidden state."""
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None:
        loss = out.last_hidden_state.float().square().mean()
    return loss


def train_step(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    ctx: ContextManager[Any],
    *,
    on_forward_done: Optional[Callable[[], None]] = None,
) -> torch.Tensor:
    """One forward + backward inside `ctx`; returns the detached loss. Grads accumulate in `.grad`."""
    with ctx:
        loss = step_loss(model, batch)
        if on_forward_done is not None:
            on_forward_done()
        loss.backward()
    return loss.detach()


# ---------------------------------------------------------------------------
# Instrumentation


def _parameter_storages(model: Optional[torch.nn.Module]) -> set[int]:
    if model is None:
        return set()
    return {p.untyped_storage().data_ptr() for p in model.parameters()} | {
        b.untyped_storage().data_ptr() for b in model.buffers()
    }


class _Held:
    """What the instrumenting pack hook returns: the inner hook's handle plus bookkeeping. Its
    destruction (when autograd frees the saved variable) is the moment the bytes stop being held."""

    __slots__ = ("inner", "key", "host_bytes", "owner", "__weakref__")

    def __init__(self, inner: Any, key: Optional[int], host_bytes: int, owner: "SavedBytesTimeline") -> None:
        self.inner = inner
        self.key = key
        self.host_bytes = host_bytes
        self.owner = owner

    def __del__(self) -> None:
        self.owner._release(self)


@dataclasses.dataclass
class TimelineEvent:
    t_ms: float
    device_bytes: int  # saved-activation bytes the saved-tensor handles keep on the device
    host_bytes: int  # bytes the offload engine copied to host for handles still alive
    kind: str  # "pack", "unpack" or "free"


class SavedBytesTimeline(torch.autograd.graph.saved_tensors_hooks):
    """Measures saved-activation bytes resident on the device over a step.

    It is entered *inside* an (optional) inner hook context such as an `OffloadScope` and calls that
    context's pack/unpack hooks itself, so the inner hooks still do their work. For every saved tensor
    it asks: does the handle keep the device tensor alive? With an `OffloadScope` as inner, a tensor
    counts as offloaded when the scope's `marked_tensors` counter moved and `skipped_marked_tensors`
    did not; otherwise the tensor's storage is counted (once per storage, parameters and buffers
    excluded) until autograd frees the saved variable. This measures what the saved-tensor handles
    hold, not the transient device copies a restore makes during the layer's recompute.

    `hook_ns` sums the time spent inside the inner hooks (for the hook-time share).
    """

    def __init__(
        self,
        inner: Optional[torch.autograd.graph.saved_tensors_hooks] = None,
        *,
        scope: Any = None,
        model: Optional[torch.nn.Module] = None,
        record: bool = True,
    ) -> None:
        self._inner_pack = inner.pack_hook if inner is not None else None
        self._inner_unpack = inner.unpack_hook if inner is not None else None
        self._scope = scope
        self._exclude = _parameter_storages(model)
        self._resident: dict[int, list[int]] = {}  # storage data_ptr -> [refs, nbytes]
        self._record = record
        self.device_bytes = 0
        self.host_bytes = 0
        self.peak_device_bytes = 0
        self.peak_host_bytes = 0
        self.hook_ns = 0
        self.hook_calls = 0
        self.events: list[TimelineEvent] = []
        self.forward_end_event: Optional[int] = None
        self._t0 = time.perf_counter_ns()
        super().__init__(self._pack, self._unpack)

    def restart_clock(self) -> None:
        self._t0 = time.perf_counter_ns()

    def forward_done(self) -> None:
        """Call between forward and backward: remembers where the backward starts in `events`."""
        self.forward_end_event = len(self.events)

    def _event(self, kind: str) -> None:
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        if self._record:
            t_ms = (time.perf_counter_ns() - self._t0) / 1e6
            self.events.append(TimelineEvent(t_ms, self.device_bytes, self.host_bytes, kind))

    def _pack(self, x: torch.Tensor) -> _Held:
        before = self._scope.stats if self._scope is not None else None
        t = time.perf_counter_ns()
        inner = self._inner_pack(x) if self._inner_pack is not None else x
        self.hook_ns += time.perf_counter_ns() - t
        self.hook_calls += 1
        offloaded_bytes = 0
        if before is not None:
            after = self._scope.stats
            moved = after.marked_tensors > before.marked_tensors
            skipped = after.skipped_marked_tensors > before.skipped_marked_tensors
            if moved and not skipped:
                offloaded_bytes = after.offloaded_bytes - before.offloaded_bytes  # 0 when deduplicated
                held = _Held(inner, None, offloaded_bytes, self)
                self.host_bytes += offloaded_bytes
                self._event("pack")
                return held
        key: Optional[int] = None
        if x.device.type != "meta" and x.numel() > 0:
            storage = x.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._exclude:
                key = ptr
                entry = self._resident.get(ptr)
                if entry is None:
                    self._resident[ptr] = [1, storage.nbytes()]
                    self.device_bytes += storage.nbytes()
                else:
                    entry[0] += 1
        held = _Held(inner, key, 0, self)
        self._event("pack")
        return held

    def _unpack(self, held: _Held) -> torch.Tensor:
        t = time.perf_counter_ns()
        out = self._inner_unpack(held.inner) if self._inner_unpack is not None else held.inner
        self.hook_ns += time.perf_counter_ns() - t
        self.hook_calls += 1
        self._event("unpack")
        return out

    def _release(self, held: _Held) -> None:
        if held.key is not None:
            entry = self._resident.get(held.key)
            if entry is not None:
                entry[0] -= 1
                if entry[0] == 0:
                    del self._resident[held.key]
                    self.device_bytes -= entry[1]
        self.host_bytes -= held.host_bytes
        self._event("free")


@contextlib.contextmanager
def nested(*contexts: ContextManager[Any]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


# ---------------------------------------------------------------------------
# Timing


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Progress:
    """tqdm on stderr when available and wanted, else silent."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is an optional (bench) dependency
                logger.info("hsoffload: install tqdm for a progress bar")
            else:
                self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)

    def update(self, label: str = "") -> None:
        if self._bar is not None:
            if label:
                self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)

    def note(self, label: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(label)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ---------------------------------------------------------------------------
# Output


def fmt_bytes(n: Optional[float]) -> str:
    if n is None or n != n:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_float(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != x:
            return "-"
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:.0f}"
    return str(x)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(h.ljust(w) for h, w in zip(cells[0], widths)))
    lines.append("  ".join("-" * w for w in widths))
    for r in cells[1:]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    return "\n".join(lines)


def _mem_total_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def environment() -> dict[str, Any]:
    """Machine and versions, recorded with every result."""
    import hsoffload

    env: dict[str, Any] = {
        "hsoffload": hsoffload.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "mem_total_bytes": _mem_total_bytes(),
    }
    for name in ("transformers", "trl", "accelerate", "axolotl", "deepspeed"):
        try:
            module = __import__(name)
            env[name] = getattr(module, "__version__", "?")
        except Exception:  # not installed or broken: just not recorded
            env[name] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_mem_bytes"] = props.total_memory
    return env


def write_json(path: str, payload: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
        f.write("\n")


def pyplot(who: str) -> Any:
    """matplotlib.pyplot on the headless Agg backend, or None (logged) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.getLogger("hsoffload").warning(
            "hsoffload %s: matplotlib is not installed; no plot written (pip install matplotlib)", who
        )
        return None
    return plt
