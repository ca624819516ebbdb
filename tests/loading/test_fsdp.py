"""FSDP RAM-efficient loading (hsoffload.fsdp, op skip_init_non_rank0).

End to end: 2 CPU processes under torchrun with gloo (tests/support/fsdp_worker.py), with the installed
transformers and with 5.3.0 (the last release without upstream fix #44473, installed into
.deps/tf53 by tests/install_extra_transformers.sh). In process: the op's decision and checks,
the write-dropping mode, lazy placeholders, patch/unpatch exactness, and stock behaviour when
inactive.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from pathlib import Path

import pytest
import torch

import hsoffload  # noqa: F401  (loads the op library)
import hsoffload.fsdp as hf
from hsoffload.stats import InitSkipStats, from_engine, names
from support import launch

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "fsdp_worker.py"
TF53 = ROOT / ".deps" / "tf53"
TF518 = ROOT / ".deps" / "tf518"  # 5.4-5.22: flags non-rank-0 tensors itself (#44473) but still makes placeholders
TF457 = ROOT / ".deps" / "tf457"  # transformers 4.57.6 (the compatibility matrix's; no #44473 regression there)
R = torch.classes.hsoffload.InitSkipRecord


# --------------------------------------------------------------------------- fixtures


def _tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    LlamaForCausalLM(_tiny_config()).save_pretrained(path)
    return path


def _torchrun(out: Path, checkpoint: Path, pythonpath_first: Path | None = None, *extra: str,
              **env: str) -> subprocess.CompletedProcess:
    args = ["--model-dir", str(checkpoint), "--out-dir", str(out)]
    if env.get("HSOFFLOAD_TEST_FAIL_RANK"):
        args.append("--skip-stock")
    return launch.two_ranks(WORKER, [*args, *extra], timeout=240, deepspeed=False, pythonpath_first=pythonpath_first,
                            env=env)


@pytest.fixture(scope="module")
def installed_run(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Path:
    """One launch with the installed transformers for two tests: the loading (stock, then patched) and then 3 steps of
    FSDP2 training under hidden-state offload."""
    out = tmp_path_factory.mktemp("fsdp_installed")
    proc = _torchrun(out, checkpoint, None, "--train-steps", "3")
    assert proc.returncode == 0, launch.tail(proc)
    return out


def _versions() -> list:
    params = [pytest.param(None, id="installed")]
    reason = f"transformers 5.3.0 not installed in {TF53}; run tests/install_extra_transformers.sh"
    params.append(pytest.param(TF53, id="5.3.0", marks=pytest.mark.skipif(not (TF53 / "transformers").is_dir(), reason=reason)))
    reason = f"transformers 5.18.0 not installed in {TF518}; run tests/install_extra_transformers.sh"
    params.append(pytest.param(TF518, id="5.18.0", marks=pytest.mark.skipif(not (TF518 / "transformers").is_dir(), reason=reason)))
    reason = f"transformers 4.57.6 not installed in {TF457}; run tests/install_extra_transformers.sh"
    params.append(pytest.param(TF457, id="4.57", marks=pytest.mark.skipif(not (TF457 / "transformers").is_dir(), reason=reason)))
    return params


# --------------------------------------------------------------------------- end to end


def _assert_non_rank0_skipped_init(r1: dict, rep1: dict, major: int, tf_path: Path | None) -> None:
    """transformers 4.57-5.22 on a non-rank-0 process: hsoffload skips the init that the broadcast overwrites."""
    # Stock transformers writes into non-rank-0's parameters during init (so the count can fail) ...
    assert r1["stock"]["writes_on_flagged"] > 0
    # ... patched, non-rank-0 performs zero init writes into parameters / persistent buffers.
    assert r1["patched"]["writes_on_flagged"] == 0
    assert rep1["skipped"] is True
    assert rep1["flagged_tensors"] == 21  # 2 layers x 9 + embed + norm + lm_head
    if major >= 5:  # 5.x materialises non-rank-0 placeholders itself: made lazy; 4.57 keeps them as stock
        assert rep1["lazy_placeholders"] >= rep1["flagged_tensors"]
    if tf_path in (TF53, TF457):
        # 5.3 / 4.57: the top model's `_init_weights` is called and writes lm_head in place: dropped.
        assert rep1["dropped_writes"] >= 1
    # Non-rank-0 holds defined zeros (not uninitialized memory) until the broadcast (5.x; 4.57 keeps
    # non-rank-0 on its own, unchanged path).
    if major >= 5:
        assert r1["patched"]["param_all_zero"]


@pytest.mark.slow
@pytest.mark.parametrize("tf_path", _versions())
def test_two_ranks_skip_init_then_broadcast(tmp_path: Path, checkpoint: Path, tf_path: Path | None,
                                            request: pytest.FixtureRequest) -> None:
    if tf_path is None:
        out = request.getfixturevalue("installed_run")
    else:
        out = tmp_path
        proc = _torchrun(out, checkpoint, tf_path)
        assert proc.returncode == 0, launch.tail(proc)
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    major = int(r0["transformers"].split(".")[0])
    if tf_path == TF53:
        assert r0["transformers"] == "5.3.0" and r0["upstream_fix"] is False
    elif tf_path == TF518:
        assert r0["transformers"] == "5.18.0" and r0["upstream_fix"] is True
    elif tf_path == TF457:
        assert r0["transformers"].startswith("4.57") and r0["upstream_fix"] is False
    else:
        assert r0["upstream_fix"] is (tuple(int(x) for x in r0["transformers"].split(".")[:2]) >= (5, 4))

    rep1 = r1["patched"]["report"]
    if tuple(int(x) for x in r0["transformers"].split(".")[:2]) >= (5, 23):
        # 5.23 makes no placeholder for non-rank-0 weights and flags them itself: the skip steps aside, stock runs
        # (docs/benchmarks.md: stock non-rank-0 holds 0.8 % of the model's bytes during the load).
        assert rep1["skipped"] is False and "nothing left to skip" in rep1["reason"], rep1
        assert r1["patched"]["writes_on_flagged"] == r1["stock"]["writes_on_flagged"]
        assert not r1["stock"]["param_all_zero"]  # the checkpoint's own values (mmap-backed), not placeholders
    else:
        _assert_non_rank0_skipped_init(r1, rep1, major, tf_path)
    # Rank 0 is stock: it loads real weights (nonzero) and is not flagged.
    rep0 = r0["patched"]["report"]
    assert rep0["skipped"] is False and "rank 0" in rep0["reason"]
    assert r0["patched"]["writes_on_flagged"] == r0["stock"]["writes_on_flagged"]
    assert not r0["patched"]["param_all_zero"]

    # Non-persistent buffers correct on every rank; after the broadcast everything equals rank 0.
    assert r0["inv_freq_ok"] and r1["inv_freq_ok"]
    assert r0["digests"] == r1["digests"] and len(r0["digests"]) >= 22  # 21 tensors + rotary buffer(s)
    assert r0["loss"] == r1["loss"]
    assert r0["grad_finite"] and r1["grad_finite"]


@pytest.mark.slow
def test_fsdp2_two_ranks_train_with_offload_and_ram_efficient_loading(installed_run: Path) -> None:
    """Both features together, as Axolotl users run long context on several GPUs: RAM-efficient loading, FSDP2
    (`fully_shard`), non-reentrant checkpointing and hidden-state offload, 3 AdamW steps on 2 ranks (gloo)."""
    r0, r1 = (json.loads((installed_run / f"rank{r}.json").read_text())["train"] for r in (0, 1))
    assert r0["losses"] == r1["losses"]  # the same batch on both ranks, gradients averaged
    for r in (r0, r1):
        assert r["losses"] == r["fsdp_no_offload_losses"]  # offload only moves bytes: bitwise
        # A single process without FSDP: the same maths, reduced in another order.
        assert r["losses"] == pytest.approx(r["single_process_losses"], rel=1e-5, abs=1e-6)
        for s in r["stats"]:
            assert s["offloaded_tensors"] == r["layers"] and s["restored_tensors"] == r["layers"], s
            assert s["offloaded_bytes"] == r["layers"] * 2 * 16 * 64 * 4, s  # batch x seq x hidden x fp32
    # The loading report on rank 1 shows the skip, or (transformers >= 5.23, which does the job itself) why it stepped
    # aside; rank 0 never skips.
    tf = json.loads((installed_run / "rank1.json").read_text())["transformers"]
    if tuple(int(x) for x in tf.split(".")[:2]) >= (5, 23):
        assert r1["report"]["skipped"] is False and "nothing left to skip" in r1["report"]["reason"]
    else:
        assert r1["report"]["skipped"] is True
    assert r0["report"]["skipped"] is False


@pytest.mark.slow
def test_rank_failing_during_load_fails_all_ranks(tmp_path: Path, checkpoint: Path) -> None:
    t0 = time.monotonic()
    proc = _torchrun(tmp_path, checkpoint, None, HSOFFLOAD_TEST_FAIL_RANK="1")
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert elapsed < 120
    assert "injected failure on rank 1" in proc.stdout + proc.stderr
    assert not list(tmp_path.glob("rank*.json"))  # no rank got past the load


# --------------------------------------------------------------------------- the op


@pytest.mark.parametrize(
    "rank,local_rank,fsdp,ram,skip,reason",
    [
        (1, 1, True, True, True, "non-rank-0"),
        (0, 0, True, True, False, "global rank 0"),
        (0, -1, True, True, False, "global rank 0"),  # LOCAL_RANK unset: rank 0 still loads
        (0, 1, True, True, False, "global rank 0"),  # wrong LOCAL_RANK cannot make rank 0 skip
        (3, 0, True, True, False, "local rank 0"),  # node 1's local rank 0 loads, as transformers does
        (3, -1, True, True, True, "non-rank-0"),
        (1, 2, True, True, False, "inconsistent"),
        (1, 1, False, True, False, "FSDP is not enabled"),
        (1, 1, True, False, False, "FSDP_CPU_RAM_EFFICIENT_LOADING"),
        (-1, -1, False, False, False, "FSDP is not enabled"),
    ],
)
def test_decision(rank: int, local_rank: int, fsdp: bool, ram: bool, skip: bool, reason: str) -> None:
    p = torch.nn.Parameter(torch.randn(3))
    rec = R()
    out = torch.ops.hsoffload.skip_init_non_rank0([p, p.detach()[1:]], rank, local_rank, fsdp, ram, rec)
    assert out == [skip, skip]
    assert rec.skip() is skip and reason in rec.reason()
    assert rec.is_flagged(p) is skip


def test_op_checks_and_record() -> None:
    with pytest.raises(ValueError, match="rank must be >= 0"):
        torch.ops.hsoffload.skip_init_non_rank0([], -1, 1, True, True)
    with pytest.raises(ValueError, match="local_rank"):
        torch.ops.hsoffload.skip_init_non_rank0([], 1, -2, True, True)
    # Without a record the op only decides; storage-less tensors are never skipped.
    sparse = torch.zeros(2).to_sparse()
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    assert torch.ops.hsoffload.skip_init_non_rank0([torch.ones(2), sparse, nested], 1, 1, True, True) == [True, False, False]

    rec = R()
    a, b = torch.randn(4, 4), torch.randn(8)
    torch.ops.hsoffload.skip_init_non_rank0([a, b, a], 1, 1, True, True, rec)
    assert rec.stats() == {"flagged_tensors": 3, "flagged_storages": 2, "flagged_bytes": 96, "dropped_writes": 0,
                           "dropped_bytes": 0, "live_storages": 2}
    assert list(rec.stats()) == list(names(InitSkipStats))  # the engine's list, in order, is the Python record's
    assert rec.is_flagged(a.view(16)[3:]) and not rec.is_flagged(a.clone())
    del b  # a freed storage is no longer flagged (weak reference)
    assert from_engine(InitSkipStats, rec.stats()).live_storages == 1
    rec.clear()
    assert not rec.is_flagged(a) and set(rec.stats().values()) == {0}


def test_opcheck() -> None:
    torch.library.opcheck(torch.ops.hsoffload.skip_init_non_rank0.default, ([torch.randn(3)], 1, 1, True, True))


def test_lazy_zeros_cost_no_rss_until_written() -> None:
    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

    before = rss()
    z = R.lazy_zeros_like(torch.empty(64, 1024, 1024, device="meta"))  # 256 MiB fp32
    assert z.shape == (64, 1024, 1024) and z.dtype == torch.float32 and z.is_contiguous()
    assert not z.requires_grad and float(z[::7, ::31, ::17].abs().sum()) == 0.0
    assert rss() - before < 32 * 2**20
    z[0].fill_(1.0)  # writes commit only what they touch
    assert float(z[0].sum()) == 1024 * 1024 and rss() - before < 64 * 2**20
    with pytest.raises(ValueError, match="strided"):
        R.lazy_zeros_like(torch.zeros(2).to_sparse())


# --------------------------------------------------------------------------- the write-dropping mode


def test_drop_mode_drops_only_flagged_writes() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    buf = torch.zeros(3)  # stands for a non-persistent buffer: not flagged
    rec = R()
    torch.ops.hsoffload.skip_init_non_rank0([lin.weight, lin.bias], 1, 1, True, True, rec)
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    other = torch.zeros(4)
    with torch.no_grad(), hf.DropFlaggedWrites(rec):
        lin.weight.data.normal_()  # unguarded, through .data
        lin.weight[1].zero_()  # a view
        torch.nn.init.uniform_(lin.bias)  # torch's init
        lin.bias.copy_(torch.ones(4))
        torch.add(torch.ones(4), 1, out=lin.bias)  # out=
        torch._foreach_mul_([lin.bias, other], 0.0)  # mixed list: only `other` is written
        ret = lin.weight.data.fill_(3.0)
        buf.fill_(7.0)  # unflagged: written
        other.fill_(2.0)
    assert torch.equal(lin.weight, w0) and torch.equal(lin.bias, b0)
    assert torch.equal(buf, torch.full((3,), 7.0)) and torch.equal(other, torch.full((4,), 2.0))
    assert ret.data_ptr() == lin.weight.data_ptr()  # the in-place op still returns its input
    assert rec.stats()["dropped_writes"] == 7


# --------------------------------------------------------------------------- patch / unpatch


def test_patch_unpatch_exact_and_idempotent() -> None:
    from transformers import PreTrainedModel

    before = {n: PreTrainedModel.__dict__.get(n) for n in (hf._INIT_NAME, hf._MOVE_NAME)}
    assert not hf.is_patched()
    hf.patch()
    hf.patch()
    try:
        assert hf.is_patched()
        wrapped = PreTrainedModel.__dict__[hf._INIT_NAME]
        assert wrapped is not before[hf._INIT_NAME] and getattr(wrapped, "_hsoffload_patched", False)
        assert wrapped.__wrapped__ is before[hf._INIT_NAME]
    finally:
        hf.unpatch()
    assert not hf.is_patched()
    assert {n: PreTrainedModel.__dict__.get(n) for n in before} == before

    # Someone patches over ours: unpatch leaves their wrapper and turns ours into a pass-through.
    hf.patch()
    ours = PreTrainedModel.__dict__[hf._INIT_NAME]

    def theirs(self, *args, **kwargs):
        return ours(self, *args, **kwargs)

    PreTrainedModel._initialize_missing_keys = theirs
    try:
        hf.unpatch()
        assert PreTrainedModel.__dict__[hf._INIT_NAME] is theirs and not hf.is_patched()
        hf.patch()  # ours stays in their chain, active again
        assert PreTrainedModel.__dict__[hf._INIT_NAME] is theirs and hf.INITIALIZE_MISSING_KEYS.active
    finally:
        PreTrainedModel._initialize_missing_keys = ours
        hf.unpatch()
    assert {n: PreTrainedModel.__dict__.get(n) for n in before} == before
    assert hf.patch_initialize_missing_keys_for_fsdp is not None and hsoffload.patch_initialize_missing_keys_for_fsdp


def test_inactive_is_stock(checkpoint: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """No process group: identical to stock, bit for bit, including init of missing keys."""
    from transformers import LlamaForSequenceClassification

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "1")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")  # LOCAL_RANK alone must not switch it on

    def load() -> dict[str, torch.Tensor]:
        torch.manual_seed(7)
        m = LlamaForSequenceClassification.from_pretrained(checkpoint, num_labels=3)  # `score` is missing: init'd
        return {k: v.clone() for k, v in m.state_dict().items()}

    stock = load()
    hf.patch()
    try:
        with caplog.at_level(logging.INFO, logger="hsoffload"):
            patched = load()
    finally:
        hf.unpatch()
    assert stock.keys() == patched.keys()
    assert all(torch.equal(stock[k], patched[k]) for k in stock)
    rep = hf.last_report()
    assert rep is not None and not rep.skipped and "FSDP is not enabled" in rep.reason
    assert float(patched["score.weight"].abs().sum()) > 0
