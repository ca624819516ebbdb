"""What the copy-at-save default costs under policy "all" (docs/design.md, "Copy sharing"), side by side in one run.

For every family of the test corpus (tests/support/hf_tiny.FAMILIES, 3 layers), one training step without
checkpointing under policy "all", offload on the CPU path (every save really copied), with the default
(`share_copies=False`: each saved tensor restores the bytes it had at its own save) and with the opt-in
`share_copies=True`; prints the copies and host bytes per step of each, their ratio, and checks that both give the
gradients of the step without offload, bit for bit.

    .venv/bin/python tests/bench/bench_copy_sharing.py [--seq 256] [--dtype float32] [--attn eager|sdpa]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hsoffload  # noqa: E402
from support import hf_tiny  # noqa: E402


def _step(family: str, seq: int, dtype: torch.dtype, attn: str, share: bool | None):
    model = hf_tiny.tiny_model(family).to(dtype)
    model.config._attn_implementation = attn
    ids = torch.randint(3, hf_tiny.VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    if share is None:
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad for p in model.parameters()], None
    with hsoffload.offload_hidden_states(model, policy="all", min_offload_size=0, offload_cpu_tensors=True,
                                         share_copies=share) as scope:
        model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad for p in model.parameters()], scope.stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attn", default="eager")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"policy all, no checkpointing, {args.dtype}, attention {args.attn}, {args.seq} tokens, 3 layers; "
          "per step: copies, host MiB")
    print(f"{'family':<9} {'default copies':>14} {'shared copies':>13} {'ratio':>6} {'default MiB':>11} "
          f"{'shared MiB':>10} {'ratio':>6}  bitwise")
    for family in hf_tiny.FAMILIES:
        ref, _ = _step(family, args.seq, dtype, args.attn, None)
        got_default, default = _step(family, args.seq, dtype, args.attn, False)
        got_shared, shared = _step(family, args.seq, dtype, args.attn, True)
        same = all(torch.equal(a, b) for a, b in zip(ref, got_default)) and all(
            torch.equal(a, b) for a, b in zip(ref, got_shared))
        mib = 1 << 20
        print(f"{family:<9} {default.offloaded_tensors:>14} {shared.offloaded_tensors:>13} "
              f"{default.offloaded_tensors / shared.offloaded_tensors:>6.2f} {default.offloaded_bytes / mib:>11.2f} "
              f"{shared.offloaded_bytes / mib:>10.2f} {default.offloaded_bytes / shared.offloaded_bytes:>6.2f}  "
              f"{'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
