"""`hsoffload plan` is arithmetic on a config.json: it runs in a Python with neither torch nor transformers nor a
built op library, and `import hsoffload` loads neither torch nor the library until a feature needs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "python_shim"


def _bare_python(where: Path) -> Path:
    """A venv with nothing installed (not even pip) from the interpreter the suite runs on: no torch, no
    transformers, no hsoffload but the source tree on PYTHONPATH."""
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(where)
    return where / "bin" / "python"


def test_plan_runs_without_torch_transformers_or_the_library(tmp_path: Path) -> None:
    python = _bare_python(tmp_path / "bare")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HSOFFLOAD_"))}
    env.update(PYTHONPATH=str(SHIM), HSOFFLOAD_LIBRARY=str(tmp_path / "no-such-libhsoffload.so"))
    probe = subprocess.run([str(python), "-c", "import torch"], capture_output=True, text=True, env=env)
    assert probe.returncode != 0, "the bare venv sees torch: the test would prove nothing"
    config = ROOT / "configs" / "llama-8b-shape.json"
    start = time.perf_counter()
    run = subprocess.run(
        [str(python), "-X", "importtime", "-m", "hsoffload", "plan", str(config), "--seq-len", "65536",
         "--device-gib", "80", "--host-ram-gib", "512", "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    seconds = time.perf_counter() - start
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["verdict"] and result["input"]["seq_len"] == 65536
    imported = {line.split("|")[-1].strip().split(".")[0] for line in run.stderr.splitlines() if "|" in line}
    assert not imported & {"torch", "transformers", "numpy"}, sorted(imported & {"torch", "transformers", "numpy"})
    print(f"hsoffload plan without torch: {seconds:.2f} s")  # docs/benchmarks.md records it; no timed assertion


def test_import_hsoffload_loads_neither_torch_nor_the_library() -> None:
    code = (
        "import sys, hsoffload\n"
        "assert 'torch' not in sys.modules, 'import hsoffload imported torch'\n"
        "import hsoffload.plan, hsoffload.planning.memory\n"
        "assert 'torch' not in sys.modules, 'the planning wing imported torch'\n"
        "assert hsoffload._loader._loaded_path is None\n"
        "hsoffload.OffloadConfig  # an offload feature: the library is loaded now\n"
        "assert hsoffload._loader._loaded_path is not None\n"
        "import torch\n"
        "assert hasattr(torch.ops.hsoffload, 'mark_hidden_state')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_public_names_and_aliases_resolve() -> None:
    """Every public name resolves; the alias modules are the very modules of the wings."""
    code = (
        "import hsoffload, importlib\n"
        "for name in hsoffload.__all__: getattr(hsoffload, name)\n"
        "import hsoffload.fsdp, hsoffload.zero3_loading, hsoffload.axolotl, hsoffload.axolotl_plugin, hsoffload.plan\n"
        "assert hsoffload.fsdp is importlib.import_module('hsoffload.loading.fsdp')\n"
        "assert hsoffload.zero3_loading is importlib.import_module('hsoffload.loading.zero3')\n"
        "assert hsoffload.plan is importlib.import_module('hsoffload.planning.plan')\n"
        "assert hsoffload.axolotl is importlib.import_module('hsoffload.integrations.axolotl')\n"
        "assert hsoffload.axolotl_plugin is importlib.import_module('hsoffload.integrations.axolotl_plugin')\n"
        "assert callable(hsoffload.patch) and callable(hsoffload.plan.plan)\n"
        "from hsoffload.axolotl_plugin import HsOffloadPlugin\n"
        "from hsoffload import OffloadScope, OffloadConfig, mark_hidden_state, patch_initialize_missing_keys_for_fsdp\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
