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
    # Importing a submodule runs its package's __init__ first; the root package's is the public facade (it resolves
    # its names lazily), so edges into it are not dependencies of a module.
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


def _layout_map() -> tuple[str, str]:
    """docs/design.md's layout map: (the engine and ops part, the package part)."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    engine, package = block.split("\npython_shim/hsoffload/", 1)
    return engine, package.split("\ntests/", 1)[0]  # tests/ is described by folder


def _package_map_paths(package: str) -> set[str]:
    """The module paths (inside python_shim/hsoffload/) the package part of the map names: an indented entry line's
    names, completed by the folder entries above it (`offload/` then `  scope.py` is offload/scope.py)."""
    import re

    named: set[str] = set()
    folders: dict[int, str] = {}
    for line in package.splitlines()[1:]:
        entry = re.match(r"^( +)(\S.*?)(?: {2,}.*)?$", line)
        if not entry or len(entry.group(1)) > 12:  # a description's continuation line
            continue
        depth = len(entry.group(1)) // 2
        prefix = "".join(folders[d] for d in sorted(folders) if d < depth)
        if entry.group(2).endswith("/") and "," not in entry.group(2):
            folders = {d: f for d, f in folders.items() if d < depth}
            folders[depth] = entry.group(2)
            continue
        folders = {d: f for d, f in folders.items() if d < depth}
        named.update(prefix + name for name in re.findall(r"[\w/]+\.py\b", entry.group(2)))
    return named


def test_the_layout_map_names_every_engine_file_and_package_module() -> None:
    """docs/design.md's map cannot drift: every header, op file and package module (by its path in the package) is
    named in it, and every file it names exists."""
    import re

    engine, package = _layout_map()
    files = {p.name for p in (ROOT / "csrc" / "include" / "hsoffload").glob("*.h")}
    files.update(p.name for p in (ROOT / "ops").iterdir() if p.suffix in (".h", ".cpp"))
    named = set(re.findall(r"(?<![/\w])\w+\.(?:h|cpp)\b", engine))
    assert not sorted(files - named), f"not in docs/design.md's layout map: {sorted(files - named)}"
    assert not sorted(named - files), f"docs/design.md's layout map names what is gone: {sorted(named - files)}"
    modules = {p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")}
    named = _package_map_paths(package)
    assert not sorted(modules - named), f"package modules not in docs/design.md's layout map: {sorted(modules - named)}"
    assert not sorted(named - modules), f"docs/design.md's layout map names modules that are gone: {sorted(named - modules)}"


# The wings of the package and what each may import (besides the root's shared modules): no wing imports one beside
# it or above it. The root's shared modules import no wing; the root's public aliases and __init__ are the front door.
WINGS: dict[str, set[str]] = {
    "offload": set(),
    "loading": set(),
    "planning": set(),
    "integrations": {"offload", "loading"},
    "tools": {"offload", "loading", "planning", "integrations"},
}
FRONT_DOOR = {"hsoffload", "hsoffload.__main__", "hsoffload.fsdp", "hsoffload.zero3_loading", "hsoffload.plan",
              "hsoffload.axolotl", "hsoffload.axolotl_plugin"}


def _wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in WINGS) else ""


def test_no_wing_imports_a_wing_beside_or_above_it() -> None:
    paths = {_module_name(p): p for p in PKG.rglob("*.py")}
    assert set(WINGS) <= {_wing(m) for m in paths}, "a wing of WINGS is not a folder of the package"
    wrong = []
    for name, path in sorted(paths.items()):
        if name in FRONT_DOOR:
            continue
        allowed = WINGS.get(_wing(name), set()) | {_wing(name)}
        for dep in sorted(_imports(path, set(paths))):
            if _wing(dep) and _wing(dep) not in allowed:
                wrong.append(f"{name} -> {dep}")
    assert not wrong, f"imports against the wings' order (tests/tools/test_layout.py, WINGS): {wrong}"


def test_the_planning_wing_needs_neither_torch_nor_transformers_at_import() -> None:
    """Top-level imports of the planning wing (and what it imports of the package) are stdlib only."""
    offenders = []
    for path in (PKG / "planning").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("torch", "transformers")]
    assert not offenders, offenders
