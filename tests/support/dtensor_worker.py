"""One rank of the 2-process DTensor marking test (run under torchrun by tests/offload/test_dtensor.py).

Per rank, on a 2-rank gloo CPU mesh: a DTensor layer input (sharded or replicated, requiring grad) goes through a
non-reentrant checkpoint, as a tensor-parallel decoder layer's hidden states do. It is marked three ways -- the op
`torch.ops.hsoffload.mark_hidden_state`, the Python `hsoffload.mark_hidden_state`, `scope.mark` -- and each run is
compared bit for bit with the same step without offload. Writes rank<r>.json with the results and the counters.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint

import hsoffload

MARKERS = {
    "op": lambda scope, t: torch.ops.hsoffload.mark_hidden_state(t),
    "function": lambda scope, t: hsoffload.mark_hidden_state(t),
    "scope.mark": lambda scope, t: scope.mark(t),
}


def _step(mesh, placement, marker):  # noqa: ANN001, ANN202
    torch.manual_seed(0)
    x = distribute_tensor(torch.randn(8, 16), mesh, [placement]).requires_grad_()
    w = distribute_tensor(torch.randn(16, 16), mesh, [Replicate()]).requires_grad_()

    def layer(h):  # noqa: ANN001, ANN202
        return torch.tanh(h @ w) * h

    stats = None
    if marker is None:
        loss = checkpoint(layer, x * 1.5, use_reentrant=False).sum()
        loss.backward()
    else:
        scope = hsoffload.OffloadScope(offload_cpu_tensors=True, min_offload_size=0)
        with scope:
            h = MARKERS[marker](scope, x * 1.5)
            loss = checkpoint(layer, h, use_reentrant=False).sum()
            loss.backward()
        stats = scope.stats
    return [loss.full_tensor(), x.grad.full_tensor(), w.grad.full_tensor()], stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    faulthandler.enable()  # a native abort (as gloo's teardown once gave in CI) prints every thread's Python stack
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (2,))
        results = []
        for placement in (Shard(0), Shard(1), Replicate()):
            ref, _ = _step(mesh, placement, None)
            for marker in MARKERS:
                ours, stats = _step(mesh, placement, marker)
                results.append(
                    {
                        "placement": str(placement),
                        "marker": marker,
                        "bitwise": all(torch.equal(a, b) for a, b in zip(ours, ref)),
                        "offloaded_tensors": stats.offloaded_tensors,
                        "restored_tensors": stats.restored_tensors,
                        "skipped_marked_tensors": stats.skipped_marked_tensors,
                    }
                )
        out = Path(args.out_dir) / f"rank{dist.get_rank()}.json"
        out.write_text(json.dumps(results))
        dist.barrier()  # both ranks are done with every collective before either tears its gloo pairs down
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from worker_exit import leave  # a sibling module: torchrun puts this folder first on sys.path
    main()
    leave(0)  # no interpreter finalization (worker_exit.py)
