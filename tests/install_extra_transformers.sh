#!/usr/bin/env bash
# Installs extra transformers versions for the compatibility matrix into .deps/<name>
# (used via PYTHONPATH by the tests that need them). Idempotent.
set -euo pipefail
PY=${1:-.venv/bin/python}
cd "$(dirname "$0")/.."
install_into() {  # dir, requirement...
  local dir=$1; shift
  if [ -f "$dir/.stamp" ]; then return 0; fi
  rm -rf "$dir"
  "$PY" -m pip install -q --no-deps --target "$dir" "$@"
  touch "$dir/.stamp"
}
if [ -f tests/extra_transformers.txt ]; then
  while read -r name reqs; do
    case "$name" in ''|'#'*) continue ;; esac
    # shellcheck disable=SC2086
    install_into ".deps/$name" $reqs
  done < tests/extra_transformers.txt
fi
