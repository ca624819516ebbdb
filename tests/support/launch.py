"""The environment a test gives the 2-rank `torchrun` launches of its workers (DeepSpeed, composition, ZeRO-3
loading): no rendezvous variables inherited from an outer launch, the package importable, and for DeepSpeed its CPU
accelerator with the JIT-built shared-memory op cached inside the environment (about 45 s to build on 2 cores, so it
lives as long as the environment CI keeps, unless $TORCH_EXTENSIONS_DIR says otherwise)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hsoffload

_RENDEZVOUS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_env(deepspeed: bool = True) -> dict[str, str]:
    env = dict(os.environ)
    for key in _RENDEZVOUS:
        env.pop(key, None)
    paths = [str(Path(hsoffload.__file__).resolve().parents[1])]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if deepspeed:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    return env
