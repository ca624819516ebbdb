#!/usr/bin/env bash
# Compiles the op library and the emulated test device (tests/device/emu) against the
# headers and libraries of other torch releases (CPU or CUDA wheels; no CUDA
# toolkit needed), without installing them.
# Usage: scripts/compile_check.sh [PYTHON] [TORCH_VERSION...]   (default: 2.12.0, the one release no CI leg builds)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
shift || true
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(2.12.0)
CACHE=${HSOFFLOAD_WHEEL_CACHE:-build/wheels}
mkdir -p "$CACHE"
for v in "${VERSIONS[@]}"; do
  root="build/torch-$v"
  if [ ! -f "$root/torch/version.py" ]; then
    wheel=$(ls "$CACHE"/torch-"$v"-*.whl 2>/dev/null | head -n1 || true)
    if [ -z "$wheel" ]; then
      "$PY" -m pip download -q --no-deps -d "$CACHE" "torch==$v"
      wheel=$(ls "$CACHE"/torch-"$v"-*.whl | head -n1)
    fi
    rm -rf "$root" && mkdir -p "$root"
    "$PY" - "$wheel" "$root" <<'PYEOF'
import sys, zipfile
wheel, root = sys.argv[1], sys.argv[2]
keep = ("torch/include/", "torch/lib/libc10.so", "torch/lib/libtorch.so", "torch/lib/libtorch_cpu.so", "torch/version.py")
with zipfile.ZipFile(wheel) as z:
    z.extractall(root, [n for n in z.namelist() if n.startswith(keep)])
PYEOF
  fi
  echo "== compiling against torch $v"
  cmake -S . -B "build/compile-$v" -G Ninja -DHSOFFLOAD_TORCH_ROOT="$PWD/$root/torch" -DHSOFFLOAD_PYTHON=/bin/false \
    -DHSOFFLOAD_BUILD_EMU=ON >/dev/null
  cmake --build "build/compile-$v"
  cat "build/compile-$v/_build_info.json"
done
echo "compile check passed: ${VERSIONS[*]}"
