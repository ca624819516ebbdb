#!/usr/bin/env bash
# The GPU check as the GPU machine runs it, in CI (make test-twin): scripts/gpu_check.sh with the network cut
# (a new network namespace: only a loopback device), with the given Python (the twin venv's), then every step
# of its summary must end ok: a FAILED, TIMED OUT or SKIPPED step, or a step that never ended, fails this script.
# Without CUDA the steps are the CPU fallbacks (GPU tests skipped with their reason, the CPU suite instead of the
# GPU suite); the build, the loading of the library, the demo and the bench all run for real.
# Usage: scripts/twin_gpu_check.sh PYTHON   (results in TWIN_OUT, default build/twin/gpu_check, emptied first)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:?usage: scripts/twin_gpu_check.sh PYTHON}
export OUT="${TWIN_OUT:-$PWD/build/twin/gpu_check}" # not $OUT: a caller's OUT is never emptied
rm -rf "$OUT" && mkdir -p "$OUT"

# No network, as on the GPU machine. unshare -n needs CAP_SYS_ADMIN (root in CI); without it, a user namespace.
netns=(unshare -n)
if ! unshare -n true 2>/dev/null; then
  netns=(unshare -r -n)
  unshare -r -n true 2>/dev/null || { echo "twin_gpu_check: cannot cut the network (unshare -n)" >&2; exit 1; }
fi
"${netns[@]}" env PYTHON="$PY" HSOFFLOAD_BUILD_DIR=build/twin/gpu bash -c '
  ip link set lo up 2>/dev/null || true   # localhost, as a real machine without network still has
  if "$PYTHON" -c "import socket; socket.create_connection((\"pypi.org\", 443), timeout=3)" 2>/dev/null; then
    echo "twin_gpu_check: the network is still reachable" >&2; exit 1
  fi
  exec bash scripts/gpu_check.sh' | tail -n 40

summary="$OUT/summary.txt"
# Step lines: "[gpu_check +Ns] NAME: start (limit Ns)" and "[gpu_check +Ns] NAME: ok (Ns)" / FAILED / TIMED OUT /
# SKIPPED.
started=$(grep -oE '^\[gpu_check \+[0-9]+s\] [a-z_]+: start ' "$summary" | awk '{print $3}' | tr -d : | sort)
ended_ok=$(grep -oE '^\[gpu_check \+[0-9]+s\] [a-z_]+: ok ' "$summary" | awk '{print $3}' | tr -d : | sort)
bad=$(grep -E '^\[gpu_check \+[0-9]+s\] [a-z_]+: (FAILED|TIMED OUT|SKIPPED)' "$summary" || true)
if [[ -n "$bad" || -z "$started" || "$started" != "$ended_ok" ]]; then
  echo "twin_gpu_check: not every step ended ok (started: $(echo $started); ok: $(echo $ended_ok))" >&2
  [[ -n "$bad" ]] && echo "$bad" >&2
  exit 1
fi
for step in build pytest_gpu pytest_faults sanitizer demo step_time policy_auto bench_cpu; do
  grep -qx "$step" <<<"$ended_ok" || { echo "twin_gpu_check: step $step did not run" >&2; exit 1; }
done
echo "twin_gpu_check: every step ok ($(echo $ended_ok)); $(grep -E '\] done in' "$summary" | sed 's/.*\] //')"
