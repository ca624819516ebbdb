"""Every shell block marked `<!-- runnable -->` in README.md, docs/*.md and the task pages (docs/tasks/*.md) runs
exactly as written; so does every Python block so marked, as a script of its own.

Each line of such a block runs with bash in the repository root, with the test interpreter's environment first on
PATH (`python`, `hsoffload`), and must exit 0. A block of one command followed by a plain ``` block (no language)
shows that command's output: it must print exactly that (trailing spaces aside), so printed plans cannot go stale
when the planner changes. Blocks without the marker (installs, multi-minute commands, `make test`
itself) are not run here; CI runs `make test` and `make demo` is the demo's own test. A marked Python block runs with
the test interpreter in the repository root and must exit 0 (a task page's example, on tiny models, on the CPU).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Every test here launches processes (tests/durations.json: the measured seconds).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
_MARKER = "<!-- runnable -->"
_BLOCK = re.compile(re.escape(_MARKER) + r"\s*\n```(?:bash|sh|shell)\n(.*?)```", re.S)
# A runnable block of one command, then its output in a plain block.
_SHOWN = re.compile(re.escape(_MARKER) + r"\s*\n```(?:bash|sh|shell)\n([^\n]*)\n```\s*\n```\n(.*?)```", re.S)
_PYTHON = re.compile(re.escape(_MARKER) + r"\s*\n```python\n(.*?)```", re.S)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "tasks").glob("*.md"))]


def _name(doc: Path) -> str:
    return str(doc.relative_to(ROOT / "docs")) if doc.parent != ROOT else doc.name


def _commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for block in _BLOCK.findall(doc.read_text()):
            for line in block.splitlines():
                line = line.split("  #")[0].strip()
                if line and not line.startswith("#"):
                    found.append((_name(doc), line))
    return found


COMMANDS = _commands()


def _shown_outputs() -> list[tuple[str, str, str]]:
    return [(_name(doc), command.strip(), shown) for doc in DOCS for command, shown in _SHOWN.findall(doc.read_text())]


SHOWN = _shown_outputs()


def _first_statement(block: str) -> str:
    lines = block.splitlines()
    return next((line for line in lines if line and not line.startswith(("#", "import", "from"))), lines[0])


# Each marked Python block: (doc, its first line that is not a comment or an import, the block).
PYTHON = [(_name(doc), _first_statement(block), block) for doc in DOCS for block in _PYTHON.findall(doc.read_text())]


def _run(command: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("HSOFFLOAD_LIBRARY", None)  # the command must find the library the documented way
    env.pop("PYTHONPATH", None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_docs_have_runnable_commands() -> None:
    assert COMMANDS, f"no {_MARKER} shell block found in README.md or docs/"


# A command whose output is shown runs once, in test_documented_output_is_what_the_command_prints (which checks its
# exit status too).
_SHOWN_COMMANDS = {(doc, command) for doc, command, _ in SHOWN}
RUN_ONLY = [(d, c) for d, c in COMMANDS if (d, c) not in _SHOWN_COMMANDS]


def test_every_documented_command_is_run() -> None:
    assert set(RUN_ONLY) | _SHOWN_COMMANDS == set(COMMANDS) and _SHOWN_COMMANDS <= set(COMMANDS)


@pytest.mark.parametrize("doc, command", RUN_ONLY, ids=[f"{d}:{c}" for d, c in RUN_ONLY])
def test_documented_command_runs_as_written(doc: str, command: str, tmp_path: Path) -> None:
    out = _run(command)
    assert out.returncode == 0, f"{doc}: `{command}` exited {out.returncode}:\n{(out.stdout + out.stderr)[-3000:]}"


def test_docs_show_outputs() -> None:
    assert any(command.startswith("hsoffload plan") for _, command, _ in SHOWN), "no shown plan output found"


@pytest.mark.parametrize("doc, command, shown", SHOWN, ids=[f"{d}:{c}" for d, c, _ in SHOWN])
def test_documented_output_is_what_the_command_prints(doc: str, command: str, shown: str) -> None:
    out = _run(command)
    assert out.returncode == 0, f"{doc}: `{command}` exited {out.returncode}:\n{(out.stdout + out.stderr)[-3000:]}"
    printed = [line.rstrip() for line in out.stdout.strip().splitlines()]
    assert printed == [line.rstrip() for line in shown.strip().splitlines()], (
        f"{doc}: the output shown for `{command}` is stale; it prints now:\n" + "\n".join(printed))


@pytest.mark.parametrize("doc, first, code", PYTHON, ids=[f"{d}:{f}" for d, f, _ in PYTHON])
def test_documented_python_runs_as_written(doc: str, first: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(code)
    out = _run(f"python {script}")
    assert out.returncode == 0, f"{doc}: the Python block starting `{first}` exited {out.returncode}:\n" + (
        out.stdout + out.stderr)[-3000:]
