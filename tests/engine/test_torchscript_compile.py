"""The ops from TorchScript and torch.compile: marking survives DCE, gradients match, opcheck passes."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest
import torch

import hsoffload


class MarkOnly(torch.nn.Module):
    """Calls mark_hidden_state for its side effect only (result unused)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        torch.ops.hsoffload.mark_hidden_state(h)
        return (self.lin(h).tanh() * h).sum()


class MarkAndUse(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.hsoffload.mark_hidden_state(x * 2)
        return (self.lin(h).tanh() * h).sum()


def _script(module: torch.nn.Module) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript is deprecated from torch 2.10
        return torch.jit.script(module)


def _grads(module: torch.nn.Module, fn, x: torch.Tensor, scope_kwargs: dict | None):
    module.zero_grad()
    x = x.detach().requires_grad_(True)
    if scope_kwargs is None:
        loss = fn(x)
        loss.backward()
        stats = None
    else:
        with hsoffload.OffloadScope(**scope_kwargs) as scope:
            loss = fn(x)
            loss.backward()
        stats = scope.stats
    return loss.detach(), [x.grad] + [p.grad.clone() for p in module.parameters()], stats


@pytest.mark.parametrize("cls", [MarkOnly, MarkAndUse])
def test_torchscript_mark_survives_dce_and_offloads(cls, cpu_scope_kwargs):
    torch.manual_seed(0)
    module = cls()
    scripted = _script(module)
    assert "hsoffload::mark_hidden_state" in str(scripted.graph)
    x = torch.randn(4, 16)
    ref_loss, ref_grads, _ = _grads(module, module, x, None)
    loss, grads, stats = _grads(module, scripted, x, cpu_scope_kwargs)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    # h is saved by mul and by the Linear's backward: one mark, one host copy per saving node (each save restores the
    # bytes it had at its own save), one restore per save.
    assert stats.marked_tensors == 1 and stats.offloaded_tensors == 2
    assert stats.restored_tensors >= stats.marked_tensors


def test_torchscript_dce_keeps_mark_after_optimisation():
    scripted = _script(MarkOnly())
    graph = scripted.graph.copy()
    torch._C._jit_pass_dce(graph)
    assert "hsoffload::mark_hidden_state" in str(graph)


def test_load_library_alone_registers_all_ops():
    """A process that never imports the Python package gets every op from torch.ops.load_library."""
    code = (
        "import torch, sys; torch.ops.load_library(sys.argv[1]); "
        "names = ['mark_hidden_state', 'offload_pack', 'offload_unpack', 'skip_init_non_rank0']; "
        "assert all(hasattr(torch.ops.hsoffload, n) for n in names); "
        "x = torch.randn(3); s = torch.classes.hsoffload.OffloadScope(0, True, False, True, 1); s.enter(); "
        "torch.ops.hsoffload.mark_hidden_state(x); h = torch.ops.hsoffload.offload_pack(x, s.id()); "
        "assert torch.equal(torch.ops.hsoffload.offload_unpack(h), x); s.exit(); "
        "assert s.stats()['offloaded_tensors'] == 1, s.stats(); "
        "print('ok')"
    )
    lib = str(hsoffload.load_library())
    out = subprocess.run([sys.executable, "-c", code, lib], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_compile_same_gradients_and_mark_traces_as_identity(cpu_scope_kwargs):
    torch.manual_seed(0)
    module = MarkAndUse()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 16)
    ref_loss, ref_grads, _ = _grads(module, module, x, None)
    loss, grads, stats = _grads(module, compiled, x, cpu_scope_kwargs)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    # Inside a compiled region the mark is traced away: nothing is marked, everything passes through.
    assert stats.marked_tensors == 0 and stats.saved_tensors_seen > 0


def test_compile_logs_once_that_offload_was_ineffective(cpu_scope_kwargs, caplog, monkeypatch):
    import threading

    from hsoffload.offload import scope as scope_mod

    monkeypatch.setattr(scope_mod, "_warned_unmarked", threading.Event())  # a fresh "log once" flag
    compiled = torch.compile(MarkAndUse(), backend="aot_eager")
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        with hsoffload.OffloadScope(**cpu_scope_kwargs):
            compiled(torch.randn(4, 16, requires_grad=True)).backward()
        with hsoffload.OffloadScope(**cpu_scope_kwargs):
            compiled(torch.randn(4, 16, requires_grad=True)).backward()
    messages = [r.getMessage() for r in caplog.records if "none was marked" in r.getMessage()]
    assert len(messages) == 1, messages


def test_opcheck_mark_hidden_state():
    from torch.library import opcheck

    for x in (torch.randn(3, 4), torch.randn(3, 4, requires_grad=True), torch.randn(4, 6)[:, 1:]):
        opcheck(torch.ops.hsoffload.mark_hidden_state.default, (x,))


@pytest.mark.slow
def test_torchscript_models_offload_on_every_step_without_the_python_package(tmp_path) -> None:
    """Scripted and traced models under the raw ops: 6 steps, default executor, every step offloads one tensor per
    block, gradients bit-identical to the same model without offload (each run in a fresh process)."""
    worker = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "support" / "ts_worker.py")
    library = str(hsoffload.load_library())
    runs = {}
    for mode in ("offload", "plain"):
        out = tmp_path / f"{mode}.pt"
        done = subprocess.run([sys.executable, worker, library, mode, str(out)], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        runs[mode] = torch.load(out)
    for kind in ("script", "trace"):
        grads, offloaded = runs["offload"][kind]
        reference, _ = runs["plain"][kind]
        # One copy per block and saving node (each save restores its own bytes): a traced graph replays the eager ops,
        # whose two nodes save each block's input; the profiling executor's first run does too, its optimised
        # differentiable graph from the second step on saves it once.
        expected = [6] * 6 if kind == "trace" else [6] + [3] * 5
        assert offloaded == expected, f"{kind}: tensors offloaded per step {offloaded}"
        assert len(grads) == len(reference)
        for i, (a, b) in enumerate(zip(grads, reference)):
            assert torch.equal(a, b), f"{kind}: gradient {i} (step {i // 7}) differs from the run without offload"
    # Traced graphs replay eager ops: also bit-identical to the eager model.
    assert all(torch.equal(a, b) for a, b in zip(runs["offload"]["trace"][0], runs["plain"]["eager"][0]))


_TS_MODEL = '''
import torch


class Marked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.hsoffload.mark_hidden_state(x * 2)
        return (self.lin(h).tanh() * h).sum()
'''

_TS_SAVE = '''
import sys, warnings
import torch, hsoffload
hsoffload.load_library()  # the documented call: `import hsoffload` alone loads no library
from ts_model import Marked
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.jit.script(Marked()).save(sys.argv[1])
'''

_TS_LOAD = '''
import sys
import torch, hsoffload
if sys.argv[2] == "load_library":
    hsoffload.load_library()
module = torch.jit.load(sys.argv[1])
x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
def grads(scope):
    module.zero_grad()
    xr = x.clone().requires_grad_(True)
    with torch.jit.optimized_execution(False):  # the same graph every run (no profiling-executor re-optimisation)
        if scope is None:
            module(xr).backward()
        else:
            with scope:
                module(xr).backward()
    return [xr.grad] + [p.grad.clone() for p in module.parameters()]
ref = grads(None)
scope = hsoffload.OffloadScope(offload_cpu_tensors=True, min_offload_size=0)
got = grads(scope)
assert all(torch.equal(a, b) for a, b in zip(ref, got)), "gradients differ"
print("marked", scope.stats.marked_tensors, "offloaded", scope.stats.offloaded_tensors)
'''


@pytest.mark.slow  # fresh processes (tests/durations.json)
def test_scripted_graph_saves_and_loads_in_fresh_processes_after_load_library(tmp_path) -> None:
    """docs/usage.md, TorchScript: `hsoffload.load_library()` before `torch.jit.script` and before `torch.jit.load`.
    A graph scripted in one fresh process loads in another and offloads with the same gradients; without the call,
    `import hsoffload` alone registers no op, and loading fails naming the op (never a silent graph without marks)."""
    (tmp_path / "ts_model.py").write_text(_TS_MODEL)
    (tmp_path / "save.py").write_text(_TS_SAVE)
    (tmp_path / "load.py").write_text(_TS_LOAD)
    saved = tmp_path / "marked.pt"
    env = {**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:" + __import__("os").environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, str(tmp_path / "save.py"), str(saved)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    run = subprocess.run([sys.executable, str(tmp_path / "load.py"), str(saved), "load_library"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "marked 1 offloaded 2" in run.stdout
    run = subprocess.run([sys.executable, str(tmp_path / "load.py"), str(saved), "import_only"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode != 0 and "hsoffload::mark_hidden_state" in run.stderr, run.stderr[-2000:]
