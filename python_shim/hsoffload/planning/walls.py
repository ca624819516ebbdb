"""The kernels' walls: limits a run meets long before memory runs out, each with the tensor, the kernels and versions
it applies to, what happens past it, what to change, and the source that measured or fixed it.

A wall is a tensor's element count (or a length) a kernel indexes in 32 bits: past it the kernel faults ("does not
run") or, worse, returns plausible wrong values ("silently wrong"). The planner checks every wall that applies to a
setup (`met`), `--seq-len` past one is never "fits", and `--max-seq` stops below the first (`longest_below`).

Versions: a wall applies to every torch (or kernel library) release before `fixed_in`; None means no released fix
is known (2026-12). The installed torch's version is read from package metadata (no import), or given.
Stdlib only.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

from .model import ModelShape, Setup

INT32 = 1 << 31  # first element count past a signed 32-bit index
UINT32 = 1 << 32  # first element count past an unsigned 32-bit index

CRASH = "does not run"
SILENT = "silently wrong"


@dataclasses.dataclass(frozen=True)
class Wall:
    name: str
    kernel: str  # which kernel, in words
    tensor: str  # which tensor it indexes, in words
    limit: int  # the first element count (or length) that is past the wall
    elements: Callable[[ModelShape, Setup], int]  # that count at a setup
    applies: Callable[[Setup], bool]
    consequence: str  # CRASH or SILENT
    fix: str  # what to change, in words
    source: str
    package: str = "torch"  # the distribution whose release fixes it (torch, liger-kernel, flash-attn)
    fixed_in: Optional[str] = None  # that package's first release with the fix (None: none known)

    def lifted(self, torch_version: Optional[str]) -> bool:
        """The fix is in the release that runs: `torch_version` for torch's walls, the installed version for a
        kernel library's."""
        version = torch_version if self.package == "torch" else installed_version(self.package)
        return _at_least(version, self.fixed_in)

    def hit(self, shape: ModelShape, s: Setup, torch_version: Optional[str]) -> bool:
        if not self.applies(s) or self.lifted(torch_version):
            return False
        return self.elements(shape, s) >= self.limit


def _tokens_x_hidden(shape: ModelShape, s: Setup) -> int:
    """One rank's hidden states: micro-batch x tokens per rank x hidden (a Ulysses rank's q after the all-to-all has
    the same count: the whole sequence, 1/D of the heads)."""
    return s.tokens * shape.hidden


def _queries_x_keys(shape: ModelShape, s: Setup) -> int:
    """Queries x keys of one attention call: the whole sequence squared (Ulysses gathers it), a chunk under ring."""
    length = s.seq_len // s.sequence_parallel if s.sequence_parallel_kind == "ring" else s.seq_len
    return length * length


WALLS: tuple[Wall, ...] = (
    Wall(
        name="liger_rms_norm_int32",
        kernel="Liger's Triton RMSNorm (row index int32)",
        tensor="tokens x hidden per rank",
        limit=INT32, elements=_tokens_x_hidden, applies=lambda s: s.fused_kernels == "liger", consequence=CRASH,
        fix="more sequence parallelism (--sequence-parallel), or transformers' RMSNorm (no --fused-kernels liger)",
        source="Liger-Kernel #803 (open; fix #804 not merged): 'an illegal memory access' at [1, 500K+, 4096]; ALST "
               "(arXiv 2506.13996) trains 500,000 tokens on one H100 and fails at 555,000",
        package="liger-kernel",
    ),
    Wall(
        name="flash_attention_2_int32",
        kernel="FlashAttention-2 (tensor offsets int32)",
        tensor="q of one rank: tokens x heads x head_dim",
        limit=INT32, elements=lambda shape, s: s.tokens * shape.heads * shape.head_dim,
        applies=lambda s: s.attn == "flash", consequence=CRASH,
        fix="more sequence parallelism (--sequence-parallel), or FlashAttention-3 (attn_implementation "
            "'flash_attention_3': 64-bit offsets)",
        source="flash-attention #767 (open: 'FA2 will not be fixed, FA3 solves it'); Liger-Kernel #803 (FA2 fails "
               "with the same tensor)",
        package="flash-attn",
    ),
    Wall(
        name="sdpa_mem_efficient_masked_uint32",
        kernel="SDPA's memory-efficient kernel with an attn_mask (mask row offset uint32)",
        tensor="queries x keys of one attention call",
        limit=UINT32 + 1, elements=_queries_x_keys,
        applies=lambda s: s.attn == "sdpa" and s.attention_mask, consequence=SILENT,
        fix="no mask (padding-free batches: SDPA's causal path), or --attn flash",
        source="pytorch #162588 and #187227 (open): wrong attention, no error, past 65,536 tokens",
    ),
    Wall(
        name="arange_uint32",
        kernel="torch.arange on CUDA (block offset 32-bit)",
        tensor="position ids: tokens of the whole sequence",
        limit=UINT32 + 1, elements=lambda shape, s: s.micro_batch * s.seq_len, applies=lambda s: True,
        consequence=SILENT,
        fix="shorter sequences: position ids past 2^32 are written as 0",
        source="pytorch #197673 (open; fix #197713 not released): elements from 2^32 on are left 0, torch 2.11-2.14",
    ),
)


@dataclasses.dataclass(frozen=True)
class WallHit:
    """A wall a setup meets: its name, what happens, the first length past it, and what to change."""

    name: str
    consequence: str
    kernel: str
    tensor: str
    limit: int
    elements: int
    first_seq_len: int  # the shortest sequence (micro-batch and parallelism as given) past the wall
    fix: str
    source: str

    def sentence(self) -> str:
        return (f"{self.tensor} passes {_power(self.limit)} elements at {self.first_seq_len:,} tokens in "
                f"{self.kernel}: {self.consequence}; {self.fix}")


def _power(n: int) -> str:
    for name, value in (("2^31", INT32), ("2^32", UINT32)):
        if n in (value, value + 1):
            return name
    return f"{n:,}"


def _first_seq_len(wall: Wall, shape: ModelShape, s: Setup) -> int:
    """The shortest sequence length past `wall` (a multiple of the parallel degree): counts grow with the length."""
    step = s.sequence_parallel

    def past(k: int) -> bool:
        return wall.elements(shape, dataclasses.replace(s, seq_len=k * step)) >= wall.limit

    lo, hi = 0, 1
    while not past(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if past(mid) else (mid, hi)
    return hi * step


def _hit(w: Wall, shape: ModelShape, s: Setup, first: Optional[int] = None) -> WallHit:
    """`w` as `s` meets it: its elements at `s` and the shortest sequence past it (`first`, when the caller has it)."""
    return WallHit(name=w.name, consequence=w.consequence, kernel=w.kernel, tensor=w.tensor, limit=w.limit,
                   elements=w.elements(shape, s), first_seq_len=first or _first_seq_len(w, shape, s), fix=w.fix,
                   source=w.source)


def met(shape: ModelShape, s: Setup, torch_version: Optional[str]) -> list[WallHit]:
    """Every wall `s` meets, the silently wrong ones first."""
    hits = [_hit(w, shape, s) for w in WALLS if w.hit(shape, s, torch_version)]
    return sorted(hits, key=lambda h: h.consequence != SILENT)


def first_below(shape: ModelShape, s: Setup, torch_version: Optional[str]) -> Optional[WallHit]:
    """The wall that `s`'s kind of run meets first as its sequence grows (None: no wall applies), as met there."""
    candidates = [w for w in WALLS if w.applies(s) and not w.lifted(torch_version)]
    firsts = [(_first_seq_len(w, shape, s), w) for w in candidates]
    if not firsts:
        return None
    first, wall = min(firsts, key=lambda f: f[0])
    return _hit(wall, shape, dataclasses.replace(s, seq_len=first), first)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def _at_least(version: Optional[str], fixed_in: Optional[str]) -> bool:
    return version is not None and fixed_in is not None and _version(version) >= _version(fixed_in)


def installed_version(package: str) -> Optional[str]:
    """An installed distribution's version from package metadata (no import), None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def installed_torch_version() -> Optional[str]:
    return installed_version("torch")
