#!/usr/bin/env bash
# Everything in llmu that needs a GPU, in one run of under 8 minutes:
#   1. record the machine (nvidia-smi, Python, torch, Triton, which of llmu's dependencies exist);
#   2. make llmu importable without a network (pip install --no-deps --no-build-isolation -e .,
#      or PYTHONPATH when pip cannot);
#   3. the kernel tests on CUDA tensors (the same tests as on a laptop: on a GPU `llmu.runtime`
#      compiles the kernels instead of interpreting them) and any test marked `gpu`;
#   4. `llmu bench` on the GPU sizes, written to benchmarks/results/<gpu>-<date>.json.
# Each step has a hard timeout, clamped so the whole script ends within LLMU_GPU_TOTAL_S seconds.
# Logs go to benchmarks/logs/; when $OUT is set, the logs and the results file are copied there too.
#
# Usage:  bash benchmarks/gpu.sh            (from anywhere; it cds to the repository)
# Knobs:  PYTHON=python3  LLMU_GPU_TOTAL_S=470  LLMU_GPU_TESTS="tests/x.py ..."  LLMU_BENCH="name ..."
#         LLMU_GPU_ALLOW_CPU=1 rehearses the script on a machine without a GPU (CPU sizes).
#         .whl/ in the repository: wheels of missing packages, installed to /tmp/llmu-site first.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
TOTAL=${LLMU_GPU_TOTAL_S:-470}
LOGS=$REPO/benchmarks/logs
mkdir -p "$LOGS" "$REPO/benchmarks/results"
SUMMARY=$LOGS/summary.txt
: >"$SUMMARY"
export PYTHONUNBUFFERED=1
FAILED=0

# step NAME SECONDS LOGFILE CMD...: run CMD under a hard timeout (clamped to the time left), log
# its output, and note its status and duration in the summary.
step() {
  local name=$1 limit=$2 log=$3; shift 3
  local left=$((TOTAL - SECONDS - 5))
  if ((left < 10)); then
    echo "$name: not started, the ${TOTAL}s budget is used up" | tee -a "$SUMMARY"
    FAILED=1; return 1
  fi
  ((limit > left)) && limit=$left
  echo "== $name (at most ${limit}s)"
  local t0=$SECONDS rc
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  local msg="$name: exit $rc in $((SECONDS - t0))s"
  ((rc == 124 || rc == 137)) && msg="$msg (timed out after ${limit}s)"
  echo "$msg" | tee -a "$SUMMARY"
  return $rc
}

# 1. The machine.
ENV_LOG=$LOGS/env.txt
: >"$ENV_LOG"
step "nvidia-smi" 20 "$ENV_LOG" nvidia-smi
step "python environment" 60 "$ENV_LOG" "$PY" - <<'PYEOF'
import importlib.util, platform, sys
print("python", platform.python_version(), sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0))
import triton
print("triton", triton.__version__)
for name in ["numpy", "einops", "plotly", "ipywidgets", "nbgrader", "gguf", "tokenizers",
             "transformers", "accelerate", "safetensors", "pytest", "hypothesis", "xdist", "nbformat"]:
    print(f"  {name:14} {'present' if importlib.util.find_spec(name) else 'MISSING'}")
sys.exit(0 if torch.cuda.is_available() else 3)
PYEOF
ENV_RC=$?
SIZES=gpu
if ((ENV_RC == 3)); then
  if [[ "${LLMU_GPU_ALLOW_CPU:-0}" != 1 ]]; then
    echo "no CUDA device: this script is for a GPU machine (LLMU_GPU_ALLOW_CPU=1 rehearses it on a CPU)" \
      | tee -a "$SUMMARY"
    exit 3
  fi
  echo "no CUDA device: rehearsal on the CPU (CPU sizes, Triton interpreted)" | tee -a "$SUMMARY"
  SIZES=cpu
fi

# 2. llmu, installed without a network. Build isolation would fetch setuptools, so it is off.
INSTALL_LOG=$LOGS/install.log
: >"$INSTALL_LOG"
if compgen -G ".whl/*.whl" >/dev/null; then
  step "carried wheels" 60 "$INSTALL_LOG" "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --upgrade --target /tmp/llmu-site .whl/*.whl && export PYTHONPATH=/tmp/llmu-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! step "pip install -e ." 90 "$INSTALL_LOG" "$PY" -m pip install --no-deps --no-build-isolation \
     --no-index -e .; then
  echo "pip install failed: using PYTHONPATH=$REPO" | tee -a "$SUMMARY"
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}  # harmless after an install, needed without one
step "import llmu" 60 "$INSTALL_LOG" "$PY" -c \
  "import llmu, llmu.bench; from llmu.runtime import environment; print(environment())" || FAILED=1

# 3. Tests on the GPU: the files that exercise Triton kernels (on CUDA tensors: see
#    benchmarks/llmu_gpu_pytest.py), then any test marked gpu.
TEST_LOG=$LOGS/gpu-tests.log
: >"$TEST_LOG"
if [[ -n "${LLMU_GPU_TESTS:-}" ]]; then
  read -r -a TEST_FILES <<<"$LLMU_GPU_TESTS"
else
  # Test files that mention kernels, less the notebook tests and the benchmark machinery's own.
  mapfile -t TEST_FILES < <(grep -rliE 'kernel' tests --include='test_*.py' \
    | grep -vE '^tests/(course|bench)/' | sort)
fi
if ((${#TEST_FILES[@]})); then
  printf 'kernel test files:\n' >>"$TEST_LOG"; printf '  %s\n' "${TEST_FILES[@]}" >>"$TEST_LOG"
  # -p llmu_gpu_pytest (benchmarks/llmu_gpu_pytest.py): tensors made without a device go to CUDA.
  PYTHONPATH=$REPO/benchmarks:$PYTHONPATH step "kernel tests on CUDA" 170 "$TEST_LOG" "$PY" -m pytest -q \
    -p no:cacheprovider -p llmu_gpu_pytest --maxfail=25 -m "not slow and not notebooks" \
    --junitxml="$LOGS/gpu-tests.xml" "${TEST_FILES[@]}" || FAILED=1
else
  echo "kernel tests: no test files found" | tee -a "$SUMMARY"
fi
if grep -rqE 'mark\.gpu\b' tests --include='*.py'; then
  step "tests marked gpu" 60 "$TEST_LOG" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests
  rc=$?; ((rc != 0 && rc != 5)) && FAILED=1  # 5: nothing was marked after all
fi

# 4. Benchmarks on the GPU sizes. --budget stops starting new sizes in time for the results to be
#    written before the hard timeout (which would also save what was measured, marked partial).
GPU_SLUG=$("$PY" -c "import re, torch; n = torch.cuda.get_device_name(0).lower() if torch.cuda.is_available() \
else 'cpu'; n = re.sub(r'\b(nvidia|tesla)\b', '', n); print(re.sub(r'[^a-z0-9]+', '-', n).strip('-') or 'gpu')")
RESULTS_DIR=benchmarks/results
[[ $SIZES == cpu ]] && RESULTS_DIR=benchmarks/logs  # a rehearsal is not a recorded GPU result
RESULT=$RESULTS_DIR/${GPU_SLUG}-$(date -u +%Y-%m-%d).json
[[ -e "$RESULT" ]] && RESULT=$RESULTS_DIR/${GPU_SLUG}-$(date -u +%Y-%m-%d-%H%M).json
BENCH_LOG=$LOGS/bench.log
: >"$BENCH_LOG"
LEFT=$((TOTAL - SECONDS - 20))
BUDGET=$((LEFT > 80 ? LEFT - 60 : 20))
# shellcheck disable=SC2086  # LLMU_BENCH is a list of names
step "llmu bench" "$LEFT" "$BENCH_LOG" "$PY" -m llmu.bench ${LLMU_BENCH:-} --sizes "$SIZES" \
  --budget "$BUDGET" --out "$RESULT" || FAILED=1

echo "== done in ${SECONDS}s; results: $RESULT" | tee -a "$SUMMARY"
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  for f in "$SUMMARY" "$ENV_LOG" "$INSTALL_LOG" "$TEST_LOG" "$LOGS/gpu-tests.xml" "$BENCH_LOG" "$RESULT"; do
    [[ -f "$f" ]] && cp "$f" "$OUT/"
  done
fi
cat "$SUMMARY"
exit $FAILED
