"""ZeRO-3 RAM-efficient loading (hsoffload.zero3_loading, op skip_init_zero3; issue 28 item 5).

End to end: 2 CPU ranks under torchrun (`DS_ACCELERATOR=cpu`, gloo), tests/support/zero3_loading_worker.py loads a
Llama (about 14 MB) under ZeRO-3 four times in one launch: `from_config` (zero.Init + transformers' gathered
`initialize_weights_zero3`) and `from_pretrained` (zero.Init + `_load_state_dict_into_zero3_model` of a sharded
safetensors checkpoint), each with the patch and stock. Asserted: every full parameter and buffer, and a forward loss,
equal bit for bit between patched and stock on both ranks; on rank 1 no byte arrives through a full-size broadcast or
all-gather (stock: at least twice the model's bytes, counted independently around torch.distributed) and the patch
received exactly its partition of every parameter, twice per load, and read every checkpoint entry as meta (shape
and dtype only); rank 0 received nothing, read everything and sent every parameter.
Rank 1's peak RSS is reported, not asserted (one load per process is what measures it: docs/usage.md's command).
Every patched load runs with `patch(verify=True)`: each partition's checksum is compared with rank 0's slice of the
values it scattered (counted: twice per parameter and load, on both ranks).

Failing together (issue 33 item 3), in the same launch after those loads: a checkpoint whose MLP shapes do not fit
the model's config, and a failure on rank 0 only (its node-local copy of the checkpoint has a truncated shard) make
both ranks raise within seconds, with rank 0's message (stock: rank 0 raises, rank 1 waits in its next collective
until the gloo timeout); `ignore_mismatched_sizes=True` loads the same mismatched checkpoint on both ranks; a byte
flipped in rank 1's received partition (the module's test hook) makes both ranks raise naming that parameter.
Issue 52 (1), in the same launch: rank 1's scratch buffers under a capacity cap (every allocation fails from the first
refused one on), in zero.Init or in the gathered init's exit; rank 0's own-slice allocation refused; rank 1's copy of
the checkpoint without its shard index or its config (it fails before its model exists): each ends on both ranks with
the same error within seconds (the worker's collectives time out after 120 s, its failure_wait_s is 15 s).

In process: the op's decision table, its argument checks and opcheck.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import hsoffload  # noqa: F401  (the op library: torch.classes.hsoffload below)
from support import launch

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "zero3_loading_worker.py"
PLAN = ("from_config:patched,from_config:stock,from_pretrained:patched,from_pretrained:stock,"
        "mismatch:patched,rank0_read_error:patched,mismatch_ignored:patched,rank0_init_error:patched,"
        "verify_detects:patched,receiver_capped_init:patched,receiver_capped_gathered:patched,"
        "rank0_own_slice_fails:patched,rank1_missing_index:patched,rank1_missing_config:patched")
COLLECTIVE_TIMEOUT_S = 120  # the worker's init_distributed timeout: where a rank left waiting would give up


def _deepspeed_missing() -> str:
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed in this environment (`make install` pins it: requirements/deepspeed.txt)"
    return ""


needs_deepspeed = pytest.mark.skipif(bool(_deepspeed_missing()), reason=_deepspeed_missing() or "deepspeed present")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[tuple[str, bool], dict[str, Any]]]:
    out = tmp_path_factory.mktemp("zero3_loading")
    t0 = time.perf_counter()
    proc = launch.two_ranks(WORKER, ["--out-dir", str(out), "--plan", PLAN, "--warmup", "--verify"], timeout=300)
    results: dict[int, dict[tuple[str, bool], dict[str, Any]]] = {}
    for rank in (0, 1):
        path = out / f"rank{rank}.json"
        assert path.exists(), launch.tail(proc)
        loads = json.loads(path.read_text())
        for r in loads:
            assert "error" not in r, f"rank {rank} {r['kind']} patched={r['patched']} raised:\n{r['error']}"
        results[rank] = {(r["kind"], r["patched"]): r for r in loads}
    assert proc.returncode == 0, launch.tail(proc)
    print(f"\nzero3 loading launch: {time.perf_counter() - t0:.1f} s")
    return results


FAIL_WITHIN_S = 20.0  # a failed load ends on every rank in about a second; a rank left waiting takes the timeout


KINDS = ("from_config", "from_pretrained")


def _transformers() -> tuple[int, ...]:
    import transformers

    return tuple(int(x) for x in transformers.__version__.split(".")[:2])


def gathers(kind: str) -> int:
    """How often transformers gathers each parameter while building or loading: 5.23's `initialize_weights_zero3`
    gathers a module's parameters with the module and again with its parent (whose `_init_weights` may touch its direct
    children's), so every parameter twice in `from_config`; loading gathers each once."""
    return 2 if kind == "from_config" and _transformers() >= (5, 23) else 1


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("kind", KINDS)
def test_parameters_and_loss_equal_stock(runs: dict[int, Any], kind: str) -> None:
    for rank in (0, 1):
        patched, stock = runs[rank][(kind, True)], runs[rank][(kind, False)]
        assert patched["digest"] == stock["digest"], f"rank {rank}: full parameters/buffers differ from stock"
        assert patched["loss"] == stock["loss"]  # bit for bit (floats from the same bytes compare equal)
    assert runs[0][(kind, True)]["digest"] == runs[1][(kind, True)]["digest"]


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("kind", KINDS)
def test_rank1_receives_only_its_partition(runs: dict[int, Any], kind: str) -> None:
    patched, stock = runs[1][(kind, True)], runs[1][(kind, False)]
    n, model, part = patched["params"], patched["model_bytes"], patched["partition_bytes"]
    # Stock writes full-size buffers on rank 1: zero.Init's broadcast, then the gathered init or load (all-gather in,
    # broadcast out); the independent counter sees at least twice the model.
    assert stock["full_collective_bytes"] >= 2 * model
    assert patched["full_collective_bytes"] == 0
    s = patched["stats"]
    g = gathers(kind)
    assert s["stock_params"] == 0
    assert s["scattered_params"] == n and s["gathered_params"] == g * n  # zero.Init, then the gathered init / load
    assert s["received_params"] == (1 + g) * n
    assert s["received_bytes"] <= (1 + g) * part  # only its slices (without the last partition's padding)
    # Full-size bytes it wrote nowhere: zero.Init's full copy less its slice, and each whole gathered copy.
    assert s["skipped_full_bytes"] == (1 + g) * model - s["received_bytes"] // (1 + g)
    if kind == "from_pretrained":
        # It read the checkpoint's names, shapes and dtypes only (no persistent buffers): through the patch's meta
        # read, or (transformers >= 5.23, which does it itself and broadcasts the buffers) transformers' own, counted.
        assert s["meta_read_tensors"] == n and s["meta_read_bytes"] == model and s["real_read_tensors"] == 0
    else:
        assert s["meta_read_tensors"] == 0
    print(f"\nrank 1 {kind}: peak RSS above its level before the call {patched['peak_rss_delta_mib']:.1f} MiB patched "
          f"(first load of the process), partition {part / 2**20:.1f} MiB, model {model / 2**20:.1f} MiB; "
          f"CPU in initialize_weights_zero3 {patched['init_cpu_s']:.3f} s patched, {stock['init_cpu_s']:.3f} s stock")


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("kind", KINDS)
def test_rank0_is_the_source(runs: dict[int, Any], kind: str) -> None:
    s = runs[0][(kind, True)]["stats"]
    n = runs[0][(kind, True)]["params"]
    assert s["received_params"] == 0 and s["skipped_full_bytes"] == 0 and s["meta_read_tensors"] == 0
    assert s["scattered_params"] == n and s["gathered_params"] == gathers(kind) * n


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("kind", KINDS)
def test_verify_compared_every_partition(runs: dict[int, Any], kind: str) -> None:
    for rank in (0, 1):
        r = runs[rank][(kind, True)]
        s, n = r["stats"], r["params"]
        assert s["verified_params"] == (1 + gathers(kind)) * n  # zero.Init's scatter, then the gathered init / load's
        assert s["status_checks"] > 0
        assert s["checked_tensors"] == (n if kind == "from_pretrained" else 0)


def _failed(runs: dict[int, Any], kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    r0, r1 = runs[0][(kind, True)], runs[1][(kind, True)]
    for r in (r0, r1):
        assert r["raised"] is not None, f"rank {r['rank']} loaded the {kind} case without an error"
        assert r["seconds"] < FAIL_WITHIN_S, (kind, r["rank"], r["seconds"])  # not a collective's timeout
    print(f"\n{kind}: rank 0 raised after {r0['seconds']:.2f} s, rank 1 after {r1['seconds']:.2f} s "
          f"(collective timeout {COLLECTIVE_TIMEOUT_S} s)")
    return r0["raised"], r1["raised"]


@pytest.mark.slow
@needs_deepspeed
def test_mismatched_checkpoint_raises_the_same_error_on_every_rank(runs: dict[int, Any]) -> None:
    e0, e1 = _failed(runs, "mismatch")
    assert e0 == e1  # each rank found it itself, from the names, shapes and dtypes it holds
    assert e0["type"] == "ValueError"
    m = e0["message"]
    assert "size mismatch for model.layers.0.mlp.gate_proj.weight" in m
    assert "(768, 256)" in m and "(384, 256)" in m  # checkpoint and model (ds_shape) shapes
    assert "12 of" in m and "ignore_mismatched_sizes=True" in m and "config it was saved with" in m


@pytest.mark.slow
@needs_deepspeed
def test_a_failure_on_rank0_only_raises_on_every_rank(runs: dict[int, Any]) -> None:
    e0, e1 = _failed(runs, "rank0_read_error")
    assert e0["type"] == "SafetensorError" and "incomplete metadata" in e0["message"]  # rank 0's own read
    assert e1["type"] == "Zero3LoadError"
    assert "rank 0 failed while reading" in e1["message"]
    assert f"{e0['type']}: {e0['message']}" in e1["message"]  # one message: rank 0's, quoted


@pytest.mark.slow
@needs_deepspeed
def test_a_failure_inside_rank0s_gathered_init_raises_on_every_rank_with_verify_on(runs: dict[int, Any]) -> None:
    """Rank 0's init fails inside the gathered initialize_weights_zero3 while verify=True: every rank still runs
    every scatter and the verification's gather (no rank left in a collective), then raises rank 0's error."""
    e0, e1 = _failed(runs, "rank0_init_error")
    assert e0["type"] == "RuntimeError" and "rank 0's _init_weights failed" in e0["message"]
    assert e1["type"] == "Zero3LoadError" and e0["message"] in e1["message"] and "rank 0 failed" in e1["message"]


@pytest.mark.slow
@needs_deepspeed
def test_ignore_mismatched_sizes_initialises_them_on_every_rank(runs: dict[int, Any]) -> None:
    r0, r1 = runs[0][("mismatch_ignored", True)], runs[1][("mismatch_ignored", True)]
    assert r0["raised"] is None and r1["raised"] is None, (r0["raised"], r1["raised"])
    assert r0["digest"] == r1["digest"] and r0["loss"] == r1["loss"] and r0["loss"] == r0["loss"]  # not NaN
    assert r1["stats"]["checked_tensors"] == r1["params"]
    assert r1["stats"]["received_params"] == r1["params"] + r1["params"] - 12  # zero.Init + the 27 it loaded


@pytest.mark.slow
@needs_deepspeed
def test_verify_names_the_corrupted_partition_on_every_rank(runs: dict[int, Any]) -> None:
    e0, e1 = _failed(runs, "verify_detects")
    assert e0["type"] == "RuntimeError" and e1["type"] == "Zero3LoadError"
    assert "model.layers.1.self_attn.q_proj.weight" in e0["message"] and "group rank 1" in e0["message"]
    assert e0["message"] in e1["message"] and "rank 0 failed" in e1["message"]


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("kind", ["receiver_capped_init", "receiver_capped_gathered"])
def test_a_failure_of_every_allocation_on_a_receiver_raises_the_same_error_on_every_rank(
        runs: dict[int, Any], kind: str) -> None:
    """Issue 52 (1): rank 1's scratch buffers (padded last partitions) hit a capacity cap and every later allocation
    fails too, in zero.Init's scatters (after 46 that fit) or in the gathered init's exit: every rank raises rank 1's
    error within seconds, none is left in a scatter."""
    e0, e1 = _failed(runs, kind)
    assert e1["type"] == "RuntimeError" and "capacity of" in e1["message"]
    assert e0["type"] == "Zero3LoadError" and "rank 1 failed" in e0["message"] and e1["message"] in e0["message"]
    cap = runs[1][(kind, True)]["cap"]
    assert cap["failed_at"] == cap["calls"] >= 1  # it failed at its first refused allocation and raised there
    if kind == "receiver_capped_init":
        assert cap["failed_at"] > 1 and "zero.Init's scatter" in e0["message"]  # some fit first: not the first call
    else:
        assert "inside GatheredParameters" in e0["message"]


@pytest.mark.slow
@needs_deepspeed
def test_a_failure_of_rank0s_own_slice_allocation_raises_the_same_error_on_every_rank(runs: dict[int, Any]) -> None:
    e0, e1 = _failed(runs, "rank0_own_slice_fails")
    assert e0["type"] == "RuntimeError" and "capacity of 0 bytes" in e0["message"]
    assert runs[0][("rank0_own_slice_fails", True)]["cap"]["failed_at"] == 1  # its first: an own slice (see worker)
    assert e1["type"] == "Zero3LoadError" and "rank 0 failed" in e1["message"] and e0["message"] in e1["message"]


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("kind,error,where", [("rank1_missing_index", "OSError", "LlamaForCausalLM.from_pretrained"),
                                              ("rank1_missing_config", "ValueError", "AutoConfig.from_pretrained")])
def test_a_failure_before_the_model_exists_ends_on_every_rank_within_the_bound(
        runs: dict[int, Any], kind: str, error: str, where: str) -> None:
    """Rank 1's copy of the checkpoint lacks a file (its shard index: it fails resolving the shards; its config: it
    fails in AutoConfig), before its model exists, while rank 0 builds its own: both raise rank 1's error, well
    within the worker's failure_wait_s (15 s) and far below the collectives' timeout (120 s)."""
    e0, e1 = _failed(runs, kind)
    assert e1["type"] == error
    assert e0["type"] == "Zero3LoadError" and e1["message"] in e0["message"]
    assert f"rank 1 failed while building the model ({where}" in e0["message"]


def test_checkpoint_check_names_a_dtype_that_a_cast_would_change() -> None:
    """In process, without ranks: the check every rank runs before loading (a plain module's own shapes)."""
    from hsoffload.zero3_loading import _check_checkpoint

    model = torch.nn.Linear(4, 3)
    state, _, mismatched = _check_checkpoint(model, {"weight": torch.zeros(3, 4, dtype=torch.bfloat16)}, None)
    assert mismatched == [] and "weight" in state  # float to float: transformers casts, as it always did
    with pytest.raises(ValueError, match=r"dtype mismatch for weight: the checkpoint holds torch.int8 \(3, 4\)"):
        _check_checkpoint(model, {"weight": torch.zeros(3, 4, dtype=torch.int8)}, None)
    with pytest.raises(ValueError, match=r"size mismatch for bias: .*\(5,\).*\(3,\).*ignore_mismatched_sizes"):
        _check_checkpoint(model, {"bias": torch.zeros(5)}, None)


def test_checksum_sees_moved_bytes() -> None:
    from hsoffload.zero3_loading import _checksum

    x = torch.arange(10, dtype=torch.float32)
    assert torch.equal(_checksum(x), _checksum(x.clone()))
    assert not torch.equal(_checksum(x), _checksum(x.flip(0)))  # same bytes, other places
    nan = torch.tensor([float("nan"), 1.0])
    assert torch.equal(_checksum(nan), _checksum(nan.clone()))


@needs_deepspeed
def test_patch_rejects_a_verify_that_is_not_a_bool() -> None:
    import hsoffload.zero3_loading as z3

    with pytest.raises(TypeError, match="verify must be True or False, got 'yes'"):
        z3.patch(verify="yes")  # type: ignore[arg-type]
    assert not z3.is_patched()


# --------------------------------------------------------------------------- the op


@pytest.mark.parametrize(
    "group_rank,zero3,skip,reason",
    [
        (1, True, True, "ZeRO-3 rank other than"),
        (3, True, True, "ZeRO-3 rank other than"),
        (0, True, False, "rank 0"),
        (1, False, False, "ZeRO-3 is not active"),
        (-1, False, False, "ZeRO-3 is not active"),
    ],
)
def test_decision(group_rank: int, zero3: bool, skip: bool, reason: str) -> None:
    p = torch.nn.Parameter(torch.randn(3))
    rec = torch.classes.hsoffload.InitSkipRecord()
    assert torch.ops.hsoffload.skip_init_zero3([p, p.detach()[1:]], group_rank, zero3, rec) == [skip, skip]
    assert rec.skip() is skip and reason in rec.reason()
    assert rec.is_flagged(p) is skip
    assert rec.stats()["flagged_bytes"] == (12 if skip else 0)


def test_op_checks() -> None:
    with pytest.raises(ValueError, match="group_rank must be >= 0"):
        torch.ops.hsoffload.skip_init_zero3([], -1, True)
    with pytest.raises(ValueError, match="group_rank must be the rank"):
        torch.ops.hsoffload.skip_init_zero3([], -2, False)
    sparse = torch.zeros(2).to_sparse()
    assert torch.ops.hsoffload.skip_init_zero3([torch.ones(2), sparse], 1, True) == [True, False]


def test_opcheck() -> None:
    torch.library.opcheck(torch.ops.hsoffload.skip_init_zero3.default, ([torch.randn(3)], 1, True))


@needs_deepspeed
def test_patch_is_exact_and_gathered_parameters_stay_deepspeeds_outside_loading(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import deepspeed.runtime.zero as dz
    import transformers.integrations.deepspeed as hd
    import transformers.modeling_utils as mu
    from deepspeed.runtime.zero.partition_parameters import Init
    from transformers import AutoConfig

    import hsoffload.zero3_loading as z3

    def current() -> tuple[Any, ...]:
        return (Init.__dict__["_zero_init_param"], dz.GatheredParameters, hd.initialize_weights_zero3,
                hd._load_state_dict_into_zero3_model, mu._load_state_dict_into_zero3_model, mu.load_state_dict,
                mu.PreTrainedModel.__dict__["_load_pretrained_model"], mu.PreTrainedModel.__dict__["from_pretrained"],
                mu.PreTrainedModel.__dict__["_from_config"], AutoConfig.__dict__["from_pretrained"])

    before = current()
    z3.patch()
    z3.patch()  # idempotent
    try:
        assert z3.is_patched() and dz.GatheredParameters is z3.RootGatheredParameters
        # Outside transformers' two loading functions every rank may read gathered values: DeepSpeed's own class.
        gathered = dz.GatheredParameters([torch.nn.Parameter(torch.ones(2))], modifier_rank=0)
        assert type(gathered) is before[1]
    finally:
        assert z3.unpatch()
    assert all(a is b for a, b in zip(before, current()))
    assert not z3.is_patched()
