"""Policy auto's calibration by shape: what a batch's shape says about what its step holds, and the buckets a run's
batches are measured and decided in.

What a decoder layer holds is not a function of tokens alone. Eager attention, and SDPA's math path with a 4-D mask,
keep batch x heads x length^2 probabilities; flash kernels and SDPA without a mask are linear in the length. So two
batches of 1,024 tokens, 8 x 128 and 1 x 1,024, hold 8x apart in attention. A `Shape` is (batch, length, whether
attention is quadratic); a `Bucket` key rounds the length up to its bucket's top (2^(k/3): powers of two are tops, and
a bucket spans a factor 2^(1/3) = 1.26). Every batch runs with its bucket's decision, made from measurements scaled
*up* to the bucket's top (never down: bytes only grow with the shape), so a batch never runs a decision made for a
smaller shape. A batch of a bucket not yet measured is calibrated (every layer offloaded: the leanest choice) first.

Torch-free: the controller (hsoffload.offload.auto) hands in the numbers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Optional

BUCKET_STEPS = 3  # buckets per doubling of the length: tops at 2^(k/3)
# transformers' attention implementations whose memory is linear in the length without a mask (flash kernels, flex);
# every other implementation, and any layer given a 4-D mask, counts as quadratic.
LINEAR_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention", "kernels-community/", "flex_attention")
# SDPA without a mask is linear where torch has fused kernels for it (flash or memory-efficient on CUDA, flash on the
# CPU); on other devices it may take the math path, which holds the probabilities.
SDPA_FUSED_DEVICES = ("cuda", "cpu")


@dataclasses.dataclass(frozen=True, order=True)
class Shape:
    """A batch's shape as policy auto scales by: its sequences (batch), their length (tokens of one sequence as the
    layer sees it), and whether attention holds length^2 per sequence."""

    batch: int
    length: int
    quadratic: bool

    @property
    def tokens(self) -> int:
        return self.batch * self.length

    def covers(self, other: "Shape") -> bool:
        """Every byte `other` holds is at most what this shape holds: no larger in batch nor length, and quadratic
        where `other` is."""
        return (self.batch >= other.batch and self.length >= other.length
                and (self.quadratic or not other.quadratic))

    def factors(self, measured: "Shape") -> tuple[float, float]:
        """(activations, linear): how much more this shape holds than `measured`. Activations scale with the
        length squared where attention is quadratic (an upper bound for the parts that are linear), the linear
        factor is the tokens' ratio (a layer's input, times)."""
        linear = self.tokens / max(1, measured.tokens)
        if self.quadratic:
            return linear * self.length / max(1, measured.length), linear
        return linear, linear

    def key(self) -> str:
        return f"{self.batch}x{self.length}{'q' if self.quadratic else ''}"

    @classmethod
    def parse(cls, key: str) -> "Shape":
        batch, rest = key.split("x")
        quadratic = rest.endswith("q")
        return cls(int(batch), int(rest.rstrip("q")), quadratic)


def bucket_length(length: int) -> int:
    """The top of `length`'s bucket: the least top >= length, tops being ceil(2^(k/BUCKET_STEPS)) (exact at powers of
    two). A top is in its own bucket (bucket_length(top) == top)."""
    if length <= 1:
        return 1
    k = max(0, math.floor(BUCKET_STEPS * math.log2(length)) - 1)  # at or below the answer (float rounding)
    while True:
        q, r = divmod(k, BUCKET_STEPS)
        top = (1 << q) if r == 0 else math.ceil(2 ** (k / BUCKET_STEPS))
        if top >= length:
            return top
        k += 1


def bucket_of(shape: Shape) -> Shape:
    """The bucket `shape` runs in: its length rounded up to the bucket's top (batch and attention as they are)."""
    return Shape(shape.batch, bucket_length(shape.length), shape.quadratic)


def agreed_bucket(maxima: Iterable[float]) -> Shape:
    """The one bucket for every rank from the ranks' maxima of (batch, length top, quadratic)."""
    batch, length, quadratic = (int(v) for v in maxima)
    return Shape(batch, bucket_length(length), bool(quadratic))


def quadratic_attention(implementation: Optional[str], tensors: Iterable[Any], device_type: str = "cuda") -> bool:
    """Whether a layer's attention holds length^2 per sequence: a 4-D mask among its inputs (eager and SDPA
    materialise it and the probabilities), or an implementation not known to be linear on `device_type` (eager,
    SDPA where torch has no fused kernel, anything unknown)."""
    for t in tensors:
        if getattr(t, "dim", None) is not None and t.dim() == 4:
            return True
    impl = implementation or "eager"
    if impl == "sdpa":
        return device_type not in SDPA_FUSED_DEVICES
    return not any(impl == name or (name.endswith("/") and impl.startswith(name)) for name in LINEAR_ATTENTION)
