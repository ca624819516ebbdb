#!/usr/bin/env bash
# GPU check (`make gpu-check`): on a GPU machine with no network, build the op library with CMake,
# run the GPU tests, the demo and the GPU benchmark suite, and leave logs, JSON and plots in $OUT.
#
# Needs torch (2.11+, CUDA build), transformers, nvcc, cmake and ninja already installed; installs
# nothing and downloads nothing. The whole script, probes included, stays under GPU_CHECK_TOTAL_S
# (400 s): the clock starts before the first probe, every step runs under `timeout` with its kill
# grace inside the budget, the benchmark gets what is left (it starts a measurement only if its
# predicted duration ends before --time-limit, keeps the time of its trace inside that limit, and
# rewrites bench.json after every measurement, so even a kill leaves what was measured), and a
# failing step does not stop the later ones. Each step's figures go into summary.txt as soon as the
# step ends; the GPU tests append theirs as each is measured (HSOFFLOAD_GPU_FIGURES). Without CUDA it
# runs the same steps harmlessly (GPU tests skipped with their reason, the CPU suite in quick mode
# instead of the GPU suite), so it can be smoke-tested: `make test-twin` runs it offline in CI with
# the GPU machine's versions and requires every step to end ok.
#
# Output ($OUT, flat): summary.txt build.log pytest_gpu.log pytest_faults.log sanitizer.log [pytest_cp.log] demo.log demo.png step_time.log step_time.json policy_auto.log policy_auto.json bench.log bench.json
# bench.png trace.json trace.json.png (one profiled step: copies against compute per layer)
set -u
START=$(date +%s) # before any probe: the budget is the script's whole wall time
cd "$(dirname "$0")/.."

OUT="${OUT:-$PWD/out/gpu_check}"
mkdir -p "$OUT"
TOTAL_S="${GPU_CHECK_TOTAL_S:-400}" # hard budget for the whole script, probes included
KILL_GRACE_S=5                      # timeout's --kill-after: counted inside the budget
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

elapsed() { echo $(($(date +%s) - START)); }
say() { echo "[gpu_check +$(elapsed)s] $*" | tee -a "$SUMMARY"; }

# run_step NAME LIMIT_S LOG CMD...: run CMD under timeout (kill grace included in LIMIT_S and in what
# is left of the budget), log to LOG, record the outcome and the log's last lines.
run_step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((TOTAL_S - $(elapsed) - 3))
  if ((left < 20)); then
    say "$name: SKIPPED (out of time)"
    return 0
  fi
  ((limit > left)) && limit=$left
  say "$name: start (limit ${limit}s)"
  local t0=$(date +%s)
  timeout --kill-after="$KILL_GRACE_S" "$((limit - KILL_GRACE_S))" "$@" >"$log" 2>&1
  local rc=$?
  local dt=$(($(date +%s) - t0))
  case $rc in
    0) say "$name: ok (${dt}s)" ;;
    124 | 137) say "$name: TIMED OUT after ${dt}s (see $(basename "$log"))" ;;
    *) say "$name: FAILED rc=$rc (${dt}s; see $(basename "$log"))" ;;
  esac
  tail -n 5 "$log" | sed 's/^/    /' >>"$SUMMARY"
  return $rc
}

PY="${PYTHON:-$(command -v python3 || command -v python)}"
if [[ -z "${PYTHON:-}" ]] && ! timeout 30 "$PY" -c "import torch" >/dev/null 2>&1 && command -v python >/dev/null; then
  PY="$(command -v python)" # python3 without torch: try `python`
fi
BUILD_DIR="${HSOFFLOAD_BUILD_DIR:-build/gpu}" # under build/, which git ignores

say "python: $PY; out: $OUT; budget ${TOTAL_S}s"
# One probe: versions, and whether CUDA is usable.
probe=$(
  timeout 60 "$PY" - 2>&1 <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0))
try:
    import transformers
    print("transformers", transformers.__version__)
except ImportError as exc:
    print("transformers missing:", exc)
print("HAS_CUDA", int(torch.cuda.is_available()))
print("GPU_COUNT", torch.cuda.device_count() if torch.cuda.is_available() else 0)
EOF
)
grep -v -e '^HAS_CUDA ' -e '^GPU_COUNT ' <<<"$probe" | tee -a "$SUMMARY"
HAS_CUDA=$(sed -n 's/^HAS_CUDA \([01]\)$/\1/p' <<<"$probe")
HAS_CUDA=${HAS_CUDA:-0}
GPU_COUNT=$(sed -n 's/^GPU_COUNT \([0-9]*\)$/\1/p' <<<"$probe")
GPU_COUNT=${GPU_COUNT:-0}
# cuBLAS is bit-reproducible run to run only with a fixed workspace configuration; the tests and the
# demo compare runs bit for bit (harmless elsewhere).
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"

# 1. Build (CMake directly: no pip, no network).
BUILD_JOBS="${BUILD_JOBS:-$(nproc)}"
GENERATOR=Ninja
command -v ninja >/dev/null || GENERATOR="Unix Makefiles"
# A build directory configured from another checkout path (a copied tree) cannot be reused.
if [[ -f "$BUILD_DIR/CMakeCache.txt" ]] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$PWD" "$BUILD_DIR/CMakeCache.txt"; then
  rm -rf "$BUILD_DIR"
fi
run_step build 240 "$OUT/build.log" bash -c \
  "cmake -S . -B '$BUILD_DIR' -G '$GENERATOR' -DHSOFFLOAD_PYTHON='$PY' && cmake --build '$BUILD_DIR' -j '$BUILD_JOBS'"
LIB="$PWD/$BUILD_DIR/libhsoffload.so"
if [[ ! -f "$LIB" ]]; then
  say "no $LIB: later steps will fail to load the library"
else
  say "built for: $(cat "$BUILD_DIR/_build_info.json" 2>/dev/null || echo 'no _build_info.json')"
fi
export HSOFFLOAD_LIBRARY="$LIB"
export PYTHONPATH="$PWD/python_shim${PYTHONPATH:+:$PYTHONPATH}"

# 2. GPU tests (all skipped with a reason on a machine without CUDA). Only tests/device/test_gpu.py holds
# GPU tests; naming it keeps an unrelated module's import error (a package this machine lacks)
# from stopping the collection. Each test appends its measured figures to the summary as it ends.
HSOFFLOAD_GPU_FIGURES="$SUMMARY" run_step pytest_gpu 150 "$OUT/pytest_gpu.log" \
  "$PY" -m pytest -m gpu tests/device/test_gpu.py -q -rfEs -p no:cacheprovider
rc=$?
((rc == 5)) && say "pytest_gpu: no GPU tests collected (rc 5)"
# Every failure and skip with its reason (the log's last lines, with the counts, are already there).
grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/pytest_gpu.log" | head -n 20 | grep -vxF -f <(tail -n 5 "$OUT/pytest_gpu.log") |
  sed 's/^/    /' >>"$SUMMARY"

# 2b. Faults only a GPU shows (a device-side assert, one in the loss before an unsynchronised backward, a device
# too small for prefetch, reduce-overhead compile,
# side-stream ownership), then the bitwise GPU tests again under the CUDA sanitizer (stream races it can see).
HSOFFLOAD_GPU_FIGURES="$SUMMARY" run_step pytest_faults 120 "$OUT/pytest_faults.log" \
  "$PY" -m pytest -m gpu tests/device/test_gpu_faults.py -q -rfEs -p no:cacheprovider
grep -E "^(FAILED|ERROR)" "$OUT/pytest_faults.log" | head -n 10 | sed 's/^/    /' >>"$SUMMARY"
TORCH_CUDA_SANITIZER=1 run_step sanitizer 60 "$OUT/sanitizer.log" \
  "$PY" -m pytest -m gpu tests/device/test_gpu.py -q -rfEs -p no:cacheprovider -k "bit_identical or race_amplification"
grep -E "^(FAILED|ERROR)|CSAN" "$OUT/sanitizer.log" | head -n 10 | sed 's/^/    /' >>"$SUMMARY"

# 2c. Context parallelism with FSDP2 (accelerate cp_size, torch's ring attention) needs 2 GPUs: only on such a machine.
if ((GPU_COUNT >= 2)); then
  run_step pytest_cp 120 "$OUT/pytest_cp.log" \
    "$PY" -m pytest -m gpu tests/integrations/test_composition.py -k context_parallel -q -rfEs -p no:cacheprovider
  grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/pytest_cp.log" | head -n 5 | sed 's/^/    /' >>"$SUMMARY"
else
  say "pytest_cp: not run ($GPU_COUNT CUDA device(s); the context-parallel test needs 2)"
fi

# 3. Demo (small; on the GPU when there is one).
run_step demo 90 "$OUT/demo.log" "$PY" -m hsoffload demo --plot "$OUT/demo.png"
grep -E "bit-identical|peak|freed|offloaded" "$OUT/demo.log" | head -n 12 | sed 's/^/    /' >>"$SUMMARY"

# 3b. The step-time model against measured steps (issue 38): hidden-state offload at layer widths from copies hidden
# to copies near compute, real copies and kernels; predicted vs measured per point (without CUDA: says so, exits 0).
run_step step_time 75 "$OUT/step_time.log" "$PY" -m hsoffload.tools.bench.step_time --json "$OUT/step_time.json"
grep -E "pred/meas|^intermediate|worst|MISS|no CUDA" "$OUT/step_time.log" | head -n 8 | sed 's/^/    /' >>"$SUMMARY"

# 3c. policy auto against every fixed configuration at 4 budgets, side by side on the GPU's own link (issue 39; the
# emulated device's regimes are tests/bench/bench_auto_emu.py): auto's peak under each budget, its step against the
# fastest fixed configuration that fits, paired round by round.
run_step policy_auto 80 "$OUT/policy_auto.log" "$PY" -m hsoffload.tools.bench.policy_auto --time-limit 50 \
  --json "$OUT/policy_auto.json"
grep -E "MiB|MISS|no CUDA" "$OUT/policy_auto.log" | head -n 8 | sed 's/^/    /' >>"$SUMMARY"

# 4. Benchmarks: the GPU suite with what is left of the budget, or the CPU suite without CUDA.
if [[ "$HAS_CUDA" == 1 ]]; then
  left=$((TOTAL_S - $(elapsed) - 5))
  # The suite starts a measurement only if its predicted end is before --time-limit (a generous
  # prediction: quadratic in the length) and keeps 45 s of it for the trace; the rest covers
  # misprediction, the report, the plots and the kill grace.
  tl=$((left - 40))
  if ((tl < 90)); then
    say "bench_gpu: SKIPPED (only ${left}s left)"
  else
    run_step bench_gpu "$left" "$OUT/bench.log" "$PY" -m hsoffload bench --suite gpu --no-progress \
      --layers "${BENCH_LAYERS:-4}" --seqs "${BENCH_SEQS:-8k,32k,128k}" --steps "${BENCH_STEPS:-3}" \
      --warmup 1 --budget-gib "${BENCH_BUDGET_GIB:-40}" --time-limit "$tl" \
      --json "$OUT/bench.json" --plot "$OUT/bench.png" --trace "$OUT/trace.json"
  fi
else
  say "no CUDA device: skipping the GPU suite; running the CPU suite (quick) instead"
  run_step bench_cpu 120 "$OUT/bench.log" "$PY" -m hsoffload bench --suite cpu --quick --no-progress \
    --json "$OUT/bench.json" --plot "$OUT/bench.png"
fi
if [[ -f "$OUT/bench.log" ]]; then
  echo "  bench report:" >>"$SUMMARY"
  grep -vE "^\s*$" "$OUT/bench.log" | tail -n 60 | sed 's/^/    /' >>"$SUMMARY"
fi

say "done in $(elapsed)s; files in $OUT:"
ls -1 "$OUT" | sed 's/^/    /' | tee -a "$SUMMARY"
echo
echo "==== summary ===="
cat "$SUMMARY"
exit 0
