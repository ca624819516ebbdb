"""The one launcher of the suite's 2-rank runs (FSDP, DTensor, DeepSpeed, composition, ZeRO-3 loading): `torchrun
--standalone --nproc-per-node 2 WORKER ...`, as users launch, with no rendezvous variables inherited from an outer
launch and the package importable as this process imports it.

For DeepSpeed its CPU accelerator, with the JIT-built shared-memory op cached per Python and torch release in the
user's cache (about 45 s to build on 2 cores: a fresh clone, a fresh venv and CI on the same machine reuse it;
$TORCH_EXTENSIONS_DIR overrides). torch rebuilds a cached op whose sources changed; the release in the path keeps an op
from linking another torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import hsoffload

_RENDEZVOUS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def extensions_cache() -> Path:
    """Where DeepSpeed's JIT-built ops are kept: ~/.cache/hsoffload/torch_extensions/<python>-<torch> ($XDG_CACHE_HOME
    honoured)."""
    import torch

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    return base / "hsoffload" / "torch_extensions" / tag


def _launch_env(deepspeed: bool = True, pythonpath_first: Optional[Path] = None) -> dict[str, str]:
    """This process's environment for a launch: `pythonpath_first` (another transformers, say) ahead of the package."""
    env = dict(os.environ)
    for key in _RENDEZVOUS:
        env.pop(key, None)
    env.pop("PYTEST_XDIST_WORKER", None)
    paths = [str(Path(hsoffload.__file__).resolve().parents[1])]
    if pythonpath_first is not None:
        paths.insert(0, str(pythonpath_first))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if deepspeed:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_cache()))
    return env


def two_ranks(worker: Path, args: Sequence[str], *, timeout: float, deepspeed: bool = True,
              pythonpath_first: Optional[Path] = None, env: Optional[dict[str, str]] = None
              ) -> subprocess.CompletedProcess[str]:
    """Run `worker` on 2 ranks under torchrun and wait (output captured). `env` adds variables to the launch's."""
    full_env = _launch_env(deepspeed, pythonpath_first)
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker),
           *args]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)


def tail(proc: subprocess.CompletedProcess[str]) -> str:
    """What a failed launch printed last: the end of its stdout, then of its stderr."""
    return proc.stdout[-4000:] + proc.stderr[-8000:]
