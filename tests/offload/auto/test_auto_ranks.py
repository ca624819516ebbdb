"""Policy auto on 2 ranks (gloo, CPU, hsoffload's counting CPU allocator), under FSDP2 and DeepSpeed ZeRO-3: the
ranks train on batches of different lengths with different budgets, and make one decision, applied from the same
step; the training is bit for bit the same without hsoffload. A hang shows as this test's timeout (the workers'
collectives wait far longer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import launch

# Every test here launches processes (tests/durations.json: the measured seconds).
pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parents[2] / "support" / "auto_worker.py"
TIMEOUT_S = 240  # the workers' collective timeout is 1800 s


def _agreeing_ranks(worker: Path, args: list[str], timeout: float, deepspeed: bool = True) -> tuple[dict, dict, str]:
    """Launch 2 ranks of `worker` and check what every policy-auto 2-rank test needs: both ranks ended, trained bit
    for bit as without hsoffload, and ran the same choices with the same decisions at every step. Returns the two
    ranks' auto results and the launch's stderr."""
    proc = launch.two_ranks(worker, args, timeout=timeout, deepspeed=deepspeed)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    out = args[args.index("--out-dir") + 1]
    r0, r1 = (json.loads((Path(out) / f"rank{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):
        assert r["bitwise"], r["auto"]["losses"]
    a0, a1 = r0["auto"], r1["auto"]
    assert a0["runs"] == a1["runs"] and a0["decisions"] == a1["decisions"], (a0, a1)  # one decision, same step
    return a0, a1, proc.stderr



@pytest.mark.parametrize("wrap", ["fsdp2", "zero3"])
def test_two_ranks_agree_on_every_decision_and_train_bitwise(tmp_path: Path, wrap: str) -> None:
    if wrap == "zero3":
        pytest.importorskip("deepspeed")
    a0, _, stderr = _agreeing_ranks(WORKER, ["--wrap", wrap, "--out-dir", str(tmp_path)], TIMEOUT_S,
                                    deepspeed=wrap == "zero3")
    layers = len(a0["runs"][0])
    # Calibration (steps 0-1) offloads everything; rank 1's budget (under anything) binds rank 0 too (steps 2-3);
    # with both budgets generous, every layer keeps its input (sharded layers are never left uncheckpointed: their
    # probe would gather shards outside the step).
    assert a0["runs"][:4] == [["offload"] * layers] * 4, a0["runs"]
    assert a0["runs"][4:] == [["keep"] * layers] * 4, a0["runs"]  # the budget changed at step 4: decided there
    assert a0["decisions"][-1] >= 2
    assert "ranks agree on every decision" in stderr


def test_a_second_forward_on_two_ranks_is_decided_for_on_both(tmp_path: Path) -> None:
    """From step 5 on both ranks run two forwards before one backward: the step where it first happens runs the
    extra forward lean on each rank alone (no collective mid-step), the next micro-batch decides for two forwards on
    both, from the same step; no hang; bit for bit. Also prints the agreement's host wait per micro-batch (gloo)."""
    a0, _, _ = _agreeing_ranks(WORKER, ["--wrap", "fsdp2", "--out-dir", str(tmp_path), "--two-forwards-from", "5"],
                               TIMEOUT_S)
    assert a0["forwards"][:5] == [1] * 5 and a0["forwards"][5:] == [2] * 3, a0["forwards"]
    assert a0["decisions"][6] > a0["decisions"][5], a0["decisions"]  # decided again at the step after
    waits = sorted(a0["agree_ms"])
    print(f"agreement host wait per micro-batch (gloo, 2 ranks, CPU): median {waits[len(waits) // 2]:.3f} ms, "
          f"max {waits[-1]:.3f} ms over {len(waits)}")


@pytest.mark.parametrize("inject", ["forward", "backward"])
def test_a_layer_with_collectives_is_never_half_probed(tmp_path: Path, inject: str) -> None:
    """Layers whose forward issues all-to-alls (as sequence parallelism's), not sharded: rank 1's probe would run
    out of memory between two of them (in forward, or in backward). Policy auto watches each layer's forward at the
    first calibration step and probes no layer that issues collectives, on any rank: the injection never fires, no
    rank waits, one decision on both ranks, bit for bit. (Without the watch, rank 1 leaves the probe after an
    all-to-all and rank 0 waits in the next: this test's timeout.)"""
    worker = WORKER.parent / "auto_collectives_worker.py"
    a0, a1, stderr = _agreeing_ranks(worker, ["--inject", inject, "--out-dir", str(tmp_path)], 120, deepspeed=False)
    assert not a0["fired"] and not a1["fired"], "a probe ran a layer that issues collectives"
    assert a0["decisions"][-1] >= 1 and "none" not in a0["runs"][-1], a0["runs"]  # decided; never uncheckpointed
    assert "issues collectives in its forward" in stderr
