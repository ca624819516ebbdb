"""One door to the engine: `hsoffload/engine.py` is the only module of the package that names the compiled extension
(`torch.ops.hsoffload`, `torch.classes`); every other module calls its typed wrappers. `_loader.py` loads the library
(`torch.ops.load_library`) and names no op."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "python_shim" / "hsoffload"

DOOR = "engine.py"
# Modules still allowed a handle, each with the reason; an entry that holds none any more (or is gone) must go.
ALLOWED: set[str] = set()


def _dotted(node: ast.AST, torch_names: set[str]) -> str:
    """`torch.ops.hsoffload.x` for an attribute chain rooted at a name bound to the torch module, else ""."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in torch_names:
        return ".".join(["torch", *reversed(parts)])
    return ""


def _torch_names(tree: ast.Module) -> set[str]:
    """The names a module binds to torch itself (`import torch`, `import torch as t`)."""
    names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname for a in node.names if a.name == "torch" and a.asname)
    return names


def _is_handle(dotted: str) -> bool:
    return dotted.startswith("torch.ops.hsoffload") or dotted.startswith("torch.classes")


def extension_references(source: str) -> list[str]:
    """Where `source` names the extension: `torch.ops.hsoffload...` / `torch.classes...` chains, `getattr(torch.ops,
    ...)` / `getattr(torch.classes, ...)`, and imports of `torch.ops.hsoffload` / `torch.classes`."""
    tree = ast.parse(source)
    torch_names = _torch_names(tree)
    found: list[str] = []
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # a chain is reported once, whole
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node, torch_names)
            if _is_handle(dotted) and id(node) not in inner:
                found.append(f"{node.lineno}: {dotted}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
            if _dotted(node.args[0], torch_names) in ("torch.ops", "torch.classes"):
                found.append(f"{node.lineno}: getattr({_dotted(node.args[0], torch_names)}, ...)")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            found += [f"{node.lineno}: import {n}" for n in names if _is_handle(n)]
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _is_handle(a.name)]
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def _modules() -> dict[str, list[str]]:
    return {p.relative_to(PKG).as_posix(): extension_references(p.read_text()) for p in sorted(PKG.rglob("*.py"))}


def test_no_module_outside_the_door_names_the_extension() -> None:
    held = {path: refs for path, refs in _modules().items() if refs and path != DOOR and path not in ALLOWED}
    assert not held, (
        "modules that name the compiled extension; call hsoffload.engine's wrappers instead (add one there if the "
        f"op has none): {held}"
    )


def test_the_door_is_where_the_extension_is_named() -> None:
    modules = _modules()
    assert modules[DOOR], "hsoffload/engine.py no longer names the extension: is it still the door?"
    stale = sorted(path for path in ALLOWED if not modules.get(path))
    assert not stale, f"ALLOWED names modules that hold no handle any more (or are gone): remove them: {stale}"


def test_the_check_sees_every_way_of_naming_the_extension() -> None:
    """The finder itself: each spelling is caught; the loader's `torch.ops.load_library` and aten ops are not."""
    caught = [
        "import torch\nx = torch.ops.hsoffload.offload_pack",
        "import torch\nx = torch.classes.hsoffload.OffloadScope()",
        "import torch as t\nt.ops.hsoffload.pool_stats()",
        "import torch\nops = getattr(torch.ops, 'hsoffload')",
        "from torch.ops import hsoffload",
        "import torch.classes",
    ]
    for source in caught:
        assert extension_references(source), source
    for source in ("import torch\ntorch.ops.load_library('x.so')", "import torch\nf = torch.ops.aten.mm.default",
                   "s = 'torch.ops.hsoffload.offload_pack'"):
        assert not extension_references(source), source
