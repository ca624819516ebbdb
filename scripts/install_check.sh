#!/usr/bin/env bash
# The documented install paths, run exactly as written, each in an environment that has only torch (the project's
# pin): README's `<!-- install -->` block (pip install --no-build-isolation), docs/axolotl.md's (a wheel for
# installing next to Axolotl), and a plain `pip install .`, which must fail with one line naming the fix.
# Usage: scripts/install_check.sh [PYTHON]     (make test-install; CI)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${1:-python3}
WORK=$ROOT/build/install-check

block() {  # the shell lines of the `<!-- install -->` block in $1
  "$PYTHON" - "$1" <<'PYEOF'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r"<!-- install -->\s*\n```(?:sh|bash)\n(.*?)```", text, re.S)
if not m:
    sys.exit(f"no <!-- install --> block in {sys.argv[1]}")
for line in m.group(1).splitlines():
    line = line.split("  #")[0].strip()
    if line and not line.startswith("#"):
        print(line)
PYEOF
}

fresh_env() {  # a venv with only torch from requirements/torch.txt
  rm -rf "$WORK/$1" && "$PYTHON" -m venv "$WORK/$1"
  "$WORK/$1/bin/python" -m pip install -q -r requirements/torch.txt
}

imports_installed() {  # hsoffload imports from site-packages (not the checkout) and loads its library
  (cd "$WORK" && "$WORK/$1/bin/python" -c "import hsoffload, sys; p = hsoffload.load_library(); \
assert 'site-packages' in str(p), p; print('imported', hsoffload.__file__, 'library', p)")
}

run_block() {  # env, doc: run the doc's install block with that env's python first on PATH
  echo "== $2 (in $1)"
  while IFS= read -r line; do
    echo "+ $line"
    PATH="$WORK/$1/bin:$PATH" bash -c "$line"
  done < <(block "$2")
}

mkdir -p "$WORK"
fresh_env readme
run_block readme README.md
imports_installed readme

echo "== plain pip install . (build isolation on) must fail and name the fix"
if PATH="$WORK/readme/bin:$PATH" python -m pip install --force-reinstall --no-deps . > "$WORK/isolated.log" 2>&1; then
  echo "install_check: a plain pip install . succeeded; update README (it says it fails)" >&2
  exit 1
fi
tr -s ' \n' ' ' < "$WORK/isolated.log" | grep -q "pip install --no-build-isolation" || {
  tail -20 "$WORK/isolated.log" >&2
  echo "install_check: a plain pip install . failed without naming --no-build-isolation" >&2
  exit 1
}
grep "no-build-isolation" "$WORK/isolated.log" | head -1

fresh_env wheel
rm -f dist/hsoffload-*.whl
run_block wheel docs/axolotl.md
imports_installed wheel
echo "install check passed: README install, plain pip install . refused with the fix, wheel for Axolotl"
