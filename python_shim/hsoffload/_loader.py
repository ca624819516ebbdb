"""Find and load the hsoffload op library once, with an actionable error on mismatch.

Imports torch only when called: `import hsoffload` (and the planner) must not pay for torch or need a built library.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger("hsoffload")

_LIB_NAME = "libhsoffload.so"
_PKG_DIR = Path(__file__).resolve().parent
_REPO_DIR = _PKG_DIR.parent.parent
REBUILD_COMMAND = (
    "pip install --no-build-isolation --force-reinstall --no-deps .  (in the hsoffload checkout, into the environment "
    "that runs torch), or: make build  (builds into build/<wheel tag>/ and installs into .venv)"
)

_loaded_path: Path | None = None


def _candidates() -> list[Path]:
    paths: list[Path] = []
    env = os.environ.get("HSOFFLOAD_LIBRARY")
    if env:
        paths.append(Path(env))
    paths.append(_PKG_DIR / _LIB_NAME)  # installed (pip install / make build)
    build = _REPO_DIR / "build"
    paths.append(build / _LIB_NAME)
    # A source checkout (PYTHONPATH=python_shim): where `make build` / pip put their build folder
    # (build/<wheel tag>/, see pyproject.toml), newest first; one built for another torch is skipped below.
    if build.is_dir():
        paths.extend(sorted(build.glob(f"*/{_LIB_NAME}"), key=lambda p: p.stat().st_mtime, reverse=True))
    return paths


def build_info(library: Path) -> dict | None:
    """The torch/CUDA versions the library at `library` was built against, if recorded."""
    for info in (library.parent / "_build_info.json", _PKG_DIR / "_build_info.json"):
        if info.is_file():
            try:
                return json.loads(info.read_text())
            except (OSError, ValueError):
                return None
    return None


def _describe(info: dict | None) -> str:
    if not info:
        return "an unknown torch (no _build_info.json beside the library)"
    return f"torch {info.get('torch')} (CUDA {info.get('cuda') or 'none'})"


def _running() -> str:
    import torch

    return f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})"


def _same_build(info: dict | None) -> bool:
    if not info:
        return True
    import torch

    built = str(info.get("torch", "")).split("+")[0]
    running = torch.__version__.split("+")[0]
    return built == running and (info.get("cuda") or None) == (torch.version.cuda or None)


def load_library() -> Path:
    """Load libhsoffload.so into this process (idempotent) and return its path.

    The offload and loading wings call it when first imported; call it yourself before `torch.jit.script` or
    `torch.jit.load` of code that calls `torch.ops.hsoffload.*` without using the Python API first."""
    global _loaded_path  # the process-wide fact "the library is loaded"; torch.ops has no unload
    if _loaded_path is not None:
        return _loaded_path
    candidates = _candidates()
    existing = [p for p in candidates if p.is_file()]
    if not existing:
        raise ImportError(
            "hsoffload: the op library libhsoffload.so was not found (looked in: "
            + ", ".join(str(p) for p in candidates)
            + f"). Running {_running()}. Build it with: {REBUILD_COMMAND}"
        )
    # An explicit HSOFFLOAD_LIBRARY or the installed library is taken as it is; build folders are searched for
    # one that matches the running torch.
    explicit = [p for p in existing if p == Path(os.environ.get("HSOFFLOAD_LIBRARY", "")) or p.parent == _PKG_DIR]
    library = explicit[0] if explicit else next((p for p in existing if _same_build(build_info(p))), existing[0])
    info = build_info(library)
    if not _same_build(info):
        raise ImportError(
            f"hsoffload: {library} was built for {_describe(info)}, running {_running()}. "
            f"Rebuild it against the running torch with: {REBUILD_COMMAND}"
        )
    import torch

    try:
        torch.ops.load_library(str(library))
    except OSError as exc:
        raise ImportError(
            f"hsoffload: loading {library} failed ({exc}). It was built for {_describe(info)}, running {_running()}. "
            f"Rebuild it with: {REBUILD_COMMAND}"
        ) from exc
    _loaded_path = library
    logger.debug("hsoffload: loaded %s (built for %s)", library, _describe(info))
    return library
