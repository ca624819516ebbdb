"""Host budget and spill tier: packs over `max_host_bytes` go to anonymous files in `spill_dir` (or stay on the
device without one), come back bit for bit, and leave nothing behind (no files, no budget, no pool loans).

CPU copies are enabled (`offload_cpu_tensors=True`) so the bytes really travel host -> file -> host.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from support import hf_tiny as H
from support.waits import until
import hsoffload
from hsoffload import OffloadConfig, OffloadScope, mark_hidden_state as mark
from hsoffload._logging import forget_logged

CPU = {"offload_cpu_tensors": True, "min_offload_size": 0}
REENTRANT = [pytest.param(False, id="nonreentrant"), pytest.param(True, id="reentrant")]


@pytest.fixture(autouse=True)
def _budget_back_to_auto():
    yield
    gc.collect()
    hsoffload.set_host_budget("auto")


def _settled(scope: Optional[OffloadScope] = None) -> None:
    """Waits (10 s at most) until no host copy is held: a spill write that was running when its graph was freed holds
    its copy until it ends (docs/design.md, "Host budget and spill tier")."""
    gc.collect()
    until(lambda: not hsoffload.budget_stats().in_flight and not (scope is not None and scope.spill_stats()["files"]),
          lambda: (hsoffload.budget_stats(), scope and scope.spill_stats()), timeout=10)


def _nothing_left(scope: OffloadScope, spill_dir: Path) -> None:
    _settled(scope)
    assert scope.spill_stats()["files"] == 0
    assert hsoffload.budget_stats().in_flight == 0
    assert hsoffload.pool_stats().in_use_bytes == 0
    assert list(spill_dir.iterdir()) == []  # anonymous files: never a name on disk


@pytest.mark.parametrize("reentrant", REENTRANT)
def test_tiny_llama_with_a_quarter_budget_spills_and_is_bitwise(reentrant: bool, tmp_path: Path) -> None:
    layers = 4
    model = H.tiny_model("llama", layers=layers)
    H.enable_checkpointing(model, reentrant)
    reference = H.twin(model)
    data = H.batches(3)
    offloaded = layers * H.BATCH * H.SEQ * 32 * 4  # one float32 hidden state per layer
    budget = offloaded // 4
    kwargs = dict(CPU, max_host_bytes=budget, spill_dir=str(tmp_path), spill_prefetch_depth=2)
    # The directory's store lives while a scope that entered with it does: this one keeps it (and its I/O counters)
    # past the training steps' scopes, whenever the garbage collector takes those.
    keeper = OffloadScope(OffloadConfig(**kwargs))
    with keeper:
        pass
    ours = H.train_steps(model, data, offload=True, scope_kwargs=kwargs)
    H.assert_bitwise_equal(ours, H.train_steps(reference, data, offload=False))
    for s in ours[2]:
        assert s.offloaded_bytes == offloaded and s.restored_bytes == offloaded, s
        # A budget of one layer: every copy goes to host at copy speed, then to disk (the spill tier keeps room for the
        # next pack), none straight from the device, none left on it. The last may stay in host, within the budget,
        # if the write before it is still running when it is packed (a write in progress counts as room on its way).
        assert s.spilled_tensors in (layers - 1, layers), s
        assert s.spilled_bytes == s.spilled_tensors * (offloaded // layers), s
        assert s.spilled_from_device_tensors == 0 and s.kept_on_device_tensors == 0, s
        assert s.prefetch_hits >= layers - 2, s  # spilled tensors were read back ahead of their unpack
    assert hsoffload.budget_stats().peak <= budget
    io = keeper.spill_stats()  # the directory's store: what really went through files
    assert io["bytes_written"] > 0 and io["bytes_read"] > 0, io
    _nothing_left(keeper, tmp_path)


def test_over_budget_without_spill_dir_stays_on_device(caplog: pytest.LogCaptureFixture) -> None:
    forget_logged()
    model = H.tiny_model("llama")
    H.enable_checkpointing(model, False)
    reference = H.twin(model)
    data = H.batches(2)
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        ours = H.train_steps(model, data, offload=True, scope_kwargs=dict(CPU, max_host_bytes=0, spill_dir=None))
    H.assert_bitwise_equal(ours, H.train_steps(reference, data, offload=False))
    for s in ours[2]:
        assert s.kept_on_device_tensors == H.LAYERS and s.offloaded_tensors == 0, s
    warnings = [r for r in caplog.records if "stayed on the device" in r.getMessage()]
    assert len(warnings) == 1, "logged once per process"
    assert "max_host_bytes=0" in warnings[0].getMessage() and "spill_dir" in warnings[0].getMessage()


@pytest.mark.parametrize("wait_ms", [pytest.param(0, id="keep"), pytest.param(5, id="bounded-wait")])
def test_lagging_disk_keeps_tensors_on_device_and_says_so_once(wait_ms: int, caplog, monkeypatch, tmp_path) -> None:
    """Packs outrun a disk whose writes take 300 ms: with spill_wait_ms=0 a pack that finds no host room keeps its
    tensor on the device at once; with 5 ms it waits that long first. Counted, logged once with the knob, bitwise."""
    forget_logged()
    monkeypatch.setenv("HSOFFLOAD_TEST_SPILL_WRITE_DELAY_MS", "300")  # read by the new directory's store
    layers = 4
    model = H.tiny_model("llama", layers=layers)
    H.enable_checkpointing(model, False)
    reference = H.twin(model)
    data = H.batches(1)
    state = H.BATCH * H.SEQ * 32 * 4  # one float32 hidden state
    kwargs = dict(CPU, max_host_bytes=state, spill_dir=str(tmp_path), spill_wait_ms=wait_ms)
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        ours = H.train_steps(model, data, offload=True, scope_kwargs=kwargs)
    H.assert_bitwise_equal(ours, H.train_steps(reference, data, offload=False))
    s = ours[2][0]
    assert s.kept_on_device_tensors >= 1 and s.offloaded_tensors + s.kept_on_device_tensors == layers, s
    assert s.spilled_from_device_tensors == 0, s
    assert (s.pack_wait_ns > 0) == (wait_ms > 0) and s.wait_ns >= s.pack_wait_ns, s
    lines = [r.getMessage() for r in caplog.records if "stayed on the device" in r.getMessage()]
    assert len(lines) == 1 and f"spill_wait_ms={wait_ms}" in lines[0] and "outran the disk" in lines[0], lines
    _settled()


def test_an_unpack_waiting_for_a_slow_read_holds_no_lock(monkeypatch, tmp_path) -> None:
    """Every copy spilled (a budget smaller than any copy), reads lagging 200 ms. While backward's unpacks wait for
    their reads (queued with the next layers' reads before the wait), the scope stays usable from another thread:
    a stats() call (which takes the scope's mutex) never waits for the disk. Bitwise equal to no offload."""
    from support.device_model import LinearStack

    delay_ms = 200
    monkeypatch.setenv("HSOFFLOAD_TEST_SPILL_READ_DELAY_MS", str(delay_ms))  # read by the new directory's store
    torch.manual_seed(0)
    model = LinearStack(256, 4)
    x = torch.randn(256, 256, requires_grad=True)
    ref = torch.autograd.grad(model(x), [x, *model.parameters()])
    kwargs = dict(CPU, max_host_bytes=1024, spill_dir=str(tmp_path), spill_prefetch_depth=2)
    got: list = []
    slowest = 0.0
    with OffloadScope(**kwargs) as scope:
        loss = model(x)
        backward = threading.Thread(target=lambda: got.extend(torch.autograd.grad(loss, [x, *model.parameters()])))
        backward.start()
        while backward.is_alive():
            t0 = time.perf_counter()
            scope.stats  # noqa: B018  (takes the scope's mutex)
            slowest = max(slowest, time.perf_counter() - t0)
            time.sleep(0.002)
        backward.join()
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(ref, got))
    s = scope.stats
    assert s.spilled_from_device_tensors == 4 and s.restored_tensors == 4, s
    assert s.spill_read_wait_ns / 1e6 >= delay_ms, s  # the reads did lag
    assert slowest * 1000 < delay_ms / 2, slowest  # never behind a read
    _settled(scope)


def test_auto_budget_is_logged_once_with_its_figures(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    forget_logged()
    monkeypatch.delenv("HSOFFLOAD_MAX_HOST_BYTES", raising=False)
    hsoffload.set_host_budget(123)
    with OffloadScope(**CPU):  # max_host_bytes=None: the budget is left as it is
        pass
    assert hsoffload.budget_stats().limit == 123 and not hsoffload.budget_stats().is_auto
    with caplog.at_level(logging.INFO, logger="hsoffload"):
        for _ in range(2):
            with OffloadScope(max_host_bytes="auto", **CPU):
                pass
    b = hsoffload.budget_stats()
    assert b.is_auto and b.limit == int(b.mem_available * 0.8) // b.local_world_size
    lines = [r.getMessage() for r in caplog.records if "max_host_bytes=auto" in r.getMessage()]
    assert len(lines) == 1 and "MemAvailable" in lines[0] and "LOCAL_WORLD_SIZE" in lines[0]


def test_options_from_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HSOFFLOAD_MAX_HOST_BYTES", "2MiB")
    monkeypatch.setenv("HSOFFLOAD_SPILL_DIR", str(tmp_path))
    c = OffloadConfig()
    assert c.max_host_bytes == 2 << 20 and c.spill_dir == str(tmp_path)
    assert OffloadConfig(max_host_bytes="1.5 GB").max_host_bytes == 1_500_000_000
    with pytest.raises(ValueError, match="max_host_bytes"):
        OffloadConfig(max_host_bytes="lots")
    with pytest.raises(ValueError, match="max_host_bytes"):
        OffloadConfig(max_host_bytes=True)
    with pytest.raises(ValueError, match="spill_prefetch_depth"):
        OffloadConfig(spill_prefetch_depth=-1)


def _unwritable_dir(tmp_path: Path) -> str:
    if os.geteuid() == 0:
        return "/proc/self"  # root may write anywhere a mode allows; procfs refuses new files to everyone
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    return str(d)


def test_bad_spill_dir_fails_at_scope_entry_naming_the_path(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = {
        str(tmp_path / "missing"): "does not exist",
        str(a_file): "is not a directory",
        _unwritable_dir(tmp_path): "is not writable",
    }
    for path, what in cases.items():
        scope = OffloadScope(spill_dir=path, **CPU)
        with pytest.raises(ValueError, match=what) as info:
            with scope:
                pass
        assert f"'{path}'" in str(info.value)
        assert not scope.active


def _stack_step(layers: list[torch.nn.Linear], x: torch.Tensor) -> torch.Tensor:
    h = x
    for layer in layers:
        h = torch.tanh(layer(mark(h)))
    return h.square().sum()


def test_odd_sizes_retain_graph_and_double_backward(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(1001, requires_grad=True)  # 4004 bytes: not a multiple of 512
    w = torch.randn(1001, requires_grad=True)

    def f(scope_on: bool):
        if scope_on:
            with OffloadScope(max_host_bytes=0, spill_dir=str(tmp_path), **CPU) as scope:
                y = (mark(x[3:998] * 2) * w[3:998]).sin().sum()
                (gx,) = torch.autograd.grad(y, x, create_graph=True)  # double backward through spilled saves
                z = (gx * gx).sum()
                z.backward(retain_graph=True)
                z.backward()  # a second unpack of every spilled tensor
            return y, gx, w.grad.clone(), scope
        y = (x[3:998] * 2 * w[3:998]).sin().sum()
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
        z = (gx * gx).sum()
        z.backward(retain_graph=True)
        z.backward()
        return y, gx, w.grad.clone(), None

    y1, g1, wg1, scope = f(True)
    w.grad = None
    y0, g0, wg0, _ = f(False)
    assert torch.equal(y1, y0) and torch.equal(g1, g0) and torch.equal(wg1, wg0)
    s = scope.stats
    assert s.spilled_tensors >= 1 and s.restored_tensors >= 3 * s.spilled_tensors, s
    del y1, g1
    _nothing_left(scope, tmp_path)


def test_two_threads_share_one_budget(tmp_path: Path) -> None:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(4)]
    x = torch.randn(32, 64)  # 8 KiB per hidden state
    budget = 3 * 8192
    hsoffload.set_host_budget(budget)
    reference = _stack_step(layers, x)
    reference.backward()
    want = [p.grad.clone() for layer in layers for p in layer.parameters()]
    results: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            own = [torch.nn.Linear(64, 64) for _ in range(4)]
            for a, b in zip(own, layers):
                a.load_state_dict(b.state_dict())
            stats = []
            for _ in range(5):
                with OffloadScope(max_host_bytes=budget, spill_dir=str(tmp_path), **CPU) as scope:
                    _stack_step(own, x).backward()
                stats.append(scope.stats)
                got = [p.grad for layer in own for p in layer.parameters()]
                assert all(torch.equal(g, r) for g, r in zip(got, want))
                for layer in own:
                    layer.zero_grad(set_to_none=True)
            results[i] = stats
        except BaseException as e:  # noqa: BLE001  (reported by the main thread)
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert not isinstance(results[i], BaseException), results[i]
        assert all(s.offloaded_tensors == 4 for s in results[i])  # type: ignore[union-attr]
    _settled()
    b = hsoffload.budget_stats()
    assert b.peak <= budget and b.in_flight == 0
    assert sum(s.spilled_tensors for i in range(2) for s in results[i]) > 0  # type: ignore[union-attr]


# --- faults, in a child process: a tiny tmpfs (own mount namespace) for ENOSPC, and kill -9 ------------------------

_CHILD_ENOSPC = textwrap.dedent(
    """
    import gc, os, subprocess, sys, time, torch
    import hsoffload
    from hsoffload import OffloadScope, mark_hidden_state as mark
    d = sys.argv[1]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d], check=True)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(6)]
    x = torch.randn(64, 256)  # 64 KiB per hidden state, 6 of them: 384 KiB to spill
    def step():
        h = x
        for layer in layers:
            h = torch.tanh(layer(mark(h)))
        return h.square().sum()
    ref = step(); ref.backward()
    want = [p.grad.clone() for l in layers for p in l.parameters()]
    for l in layers: l.zero_grad(set_to_none=True)
    with open(os.path.join(d, "filler"), "wb") as f:  # leave about 128 KiB free
        f.write(b"x" * (1024 * 1024 - 128 * 1024))
    free_before = os.statvfs(d).f_bavail * os.statvfs(d).f_frsize
    budget = int(sys.argv[2])  # 0: every copy goes from device to disk; else host first, then disk
    kw = dict(offload_cpu_tensors=True, min_offload_size=0, max_host_bytes=budget, spill_dir=d)
    try:
        with OffloadScope(**kw) as scope:
            step().backward()
        raise SystemExit("no error although the disk was full")
    except RuntimeError as e:
        msg = str(e)
    assert "No space left on device" in msg and repr(d) in msg, msg
    assert "65536 bytes" in msg and "bytes are free there" in msg, msg
    assert budget == 0 or scope.stats.spill_write_errors >= 1, scope.stats
    gc.collect()
    deadline = time.monotonic() + 10  # a write still running when the graph went holds its copy until it ends
    while hsoffload.budget_stats().in_flight or scope.spill_stats()["files"]:
        assert time.monotonic() < deadline, (hsoffload.budget_stats(), scope.spill_stats())
        time.sleep(0.005)
    assert scope.spill_stats()["files"] == 0, scope.spill_stats()
    assert hsoffload.budget_stats().in_flight == 0
    assert hsoffload.pool_stats().in_use_bytes == 0
    assert os.statvfs(d).f_bavail * os.statvfs(d).f_frsize == free_before
    assert sorted(os.listdir(d)) == ["filler"]
    os.remove(os.path.join(d, "filler"))
    for l in layers: l.zero_grad(set_to_none=True)
    with OffloadScope(**kw) as scope:
        step().backward()
    assert scope.stats.spilled_tensors == 6 if budget == 0 else scope.stats.spilled_tensors >= 4, scope.stats
    assert scope.stats.spilled_from_device_tensors == (6 if budget == 0 else 0), scope.stats
    got = [p.grad for l in layers for p in l.parameters()]
    assert all(torch.equal(g, w) for g, w in zip(got, want)), "gradients differ after the failed step"
    print("ENOSPC-OK", msg)
    """
)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.slow
@pytest.mark.parametrize("budget", [pytest.param(0, id="from-device"), pytest.param(128 * 1024, id="from-host")])
def test_disk_full_mid_step_raises_then_releases_everything(tmp_path: Path, budget: int) -> None:
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "--user", "--map-root-user", "--mount", "true"],
                           capture_output=True) if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip("needs unshare(1) with user and mount namespaces, to mount a 1 MiB tmpfs")
    script = tmp_path / "child.py"
    script.write_text(_CHILD_ENOSPC)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run([unshare, "--user", "--map-root-user", "--mount", sys.executable, str(script), str(mnt),
                        str(budget)],
                       capture_output=True, text=True, timeout=300, env=_child_env())
    assert r.returncode == 0 and "ENOSPC-OK" in r.stdout, r.stdout + r.stderr


_CHILD_KILLED = textwrap.dedent(
    """
    import sys, time, torch
    import hsoffload
    from hsoffload import OffloadScope, mark_hidden_state as mark
    x = torch.randn(256, 256, requires_grad=True)
    with OffloadScope(offload_cpu_tensors=True, min_offload_size=0, max_host_bytes=0, spill_dir=sys.argv[1]) as s:
        ys = [(mark(x * i) * x).sum() for i in range(8)]  # 8 spilled tensors, kept by the live graphs
        while s.spill_stats()["bytes_written"] < 8 * 256 * 256 * 4:
            time.sleep(0.01)
        print("spilled", s.spill_stats()["files"], flush=True)
        time.sleep(600)
    """
)


@pytest.mark.slow
def test_kill_9_leaves_no_spill_files(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(_CHILD_KILLED)
    spill = tmp_path / "spill"
    spill.mkdir()
    child = subprocess.Popen([sys.executable, str(script), str(spill)], stdout=subprocess.PIPE, text=True,
                             env=_child_env())
    try:
        line = child.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("spilled 8"), line
        pid = child.pid
        assert len(os.listdir(f"/proc/{pid}/fd")) > 0
        # The files exist (open descriptors into spill_dir) but have no names.
        targets = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        assert sum(str(spill) in t for t in targets) == 8, targets
        assert list(spill.iterdir()) == []
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert list(spill.iterdir()) == []
