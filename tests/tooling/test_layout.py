"""The house rules of the layout: every module of the package and every engine file states its job in its first
lines, and the package has no import cycle (lazy imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "python_shim" / "hsoffload"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Package modules `path` imports anywhere in its body (relative or absolute)."""
    name = _module_name(path)
    base = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                target = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "hsoffload":
                target = node.module
            else:
                continue
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                found.add(candidate if candidate in modules else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "hsoffload")
    # Importing a submodule runs its package's __init__ first; the root package's is the public facade that
    # imports everything, so edges into it are not dependencies of a module.
    return {m for m in found if m in modules and m != name and m != "hsoffload"}


def test_every_module_states_its_job() -> None:
    missing = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py") if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"modules without a docstring saying what they are for: {missing}"


def test_every_engine_file_states_its_job() -> None:
    files = [p for d in ("csrc", "ops") for p in (ROOT / d).rglob("*") if p.suffix in (".h", ".cpp")]
    assert files
    missing = [str(p.relative_to(ROOT)) for p in files if not p.read_text().lstrip().startswith("//")]
    assert not missing, f"engine files that do not open with a comment on their job: {missing}"


def test_no_import_cycle_in_the_package() -> None:
    paths = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {name: _imports(path, set(paths)) for name, path in paths.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, f"import cycles: {cycles}"


def _layout_map() -> str:
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    return block.split("\ntests/", 1)[0]  # the engine, the ops and the package (tests/ is described by folder)


def test_the_layout_map_names_every_engine_file_and_package_module() -> None:
    """docs/design.md's map cannot drift: every header, op file and top-level package module is named in it, and every
    file name it gives exists."""
    import re

    layout = _layout_map()
    files = {p.name: p for p in (ROOT / "csrc" / "include" / "hsoffload").glob("*.h")}
    files.update({p.name: p for p in (ROOT / "ops").iterdir() if p.suffix in (".h", ".cpp")})
    files.update({p.name: p for p in PKG.glob("*.py")})
    named = set(re.findall(r"(?<![/\w])\w+\.(?:py|h|cpp)\b", layout))  # a path (tests/...) is not a name here
    assert not sorted(set(files) - named), f"not in docs/design.md's layout map: {sorted(set(files) - named)}"
    assert not sorted(named - set(files)), f"docs/design.md's layout map names what is gone: {sorted(named - set(files))}"
