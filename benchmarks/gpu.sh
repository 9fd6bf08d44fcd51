#!/usr/bin/env bash
# Everything in llmu that needs a GPU, in one run of under 8 minutes:
#   1. record the machine (nvidia-smi, Python, torch, Triton, which of llmu's dependencies exist);
#   2. make llmu importable without a network (pip install --no-deps --no-build-isolation -e .,
#      or PYTHONPATH when pip cannot);
#   3. the kernel tests, pytest -m "(kernels and not slow) or gpu", on the GPU (llmu.runtime compiles
#      the kernels there; the tests make their tensors on the kernel device), in two time slices:
#      first what only a GPU can check (fp16/bf16, compiled-only tests), then the rest;
#   4. `llmu bench --strict` on the GPU sizes, written to <RESULTS_DIR>/<gpu>-<date>.json, where
#      RESULTS_DIR is llmu.bench.results.RESULTS_DIR (llmu/data/gpu_results/, package data).
# Each step runs under a hard timeout within the total; the tests stop in time to leave the
# benchmarks LLMU_GPU_BENCH_S seconds. The summary lists every step with its exit status and
# time, then one line per failure: a failed test, a time slice that ran out, a bench module that
# did not import, a benchmark row that failed or was never measured. Any failure: exit status 1.
#
# Usage:  bash benchmarks/gpu.sh            (from anywhere; it cds to the repository)
# Knobs:  PYTHON=python3                 the interpreter
#         LLMU_GPU_TOTAL_S=470           the whole run, in seconds
#         LLMU_GPU_BENCH_S=200           kept for the benchmarks: the tests stop before
#         LLMU_GPU_FIRST_S=100           at most, for the first test slice (fp16/bf16, compiled-only)
#         LLMU_GPU_REST_S=N              at most, for the second test slice (default: until the reserve)
#         LLMU_GPU_WORKERS=N             pytest-xdist workers (default half the cores, at most 8; 1: serial)
#         LLMU_GPU_TESTS="tests/x.py ..."  test paths instead of the test modules that mention the
#                                        markers (the marker filter still applies)
#         LLMU_BENCH="name ..."          benchmark entries instead of all of them
#         LLMU_GPU_LOGS=DIR              logs and summary (default benchmarks/logs/, not committed)
#         LLMU_GPU_RESULTS_DIR=DIR       where the results file goes (default: RESULTS_DIR above)
#         LLMU_GPU_INSTALL=0             no pip install: llmu is imported from the checkout (PYTHONPATH)
#         LLMU_GPU_ALLOW_CPU=1           rehearse on a machine without a GPU (CPU sizes, Triton
#                                        interpreted; the results file stays in the logs folder)
#         .whl/ in the repository: wheels of missing packages, installed to /tmp/llmu-site first.
#         OUT=DIR: the logs and the results file are copied there too.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
TOTAL=${LLMU_GPU_TOTAL_S:-470}
BENCH_S=${LLMU_GPU_BENCH_S:-200}
FIRST_S=${LLMU_GPU_FIRST_S:-100}
LOGS=${LLMU_GPU_LOGS:-$REPO/benchmarks/logs}
mkdir -p "$LOGS"
SUMMARY=$LOGS/summary.txt
FAILURES=$LOGS/failures.txt
rm -f "$LOGS"/gpu-tests-*.log "$LOGS"/gpu-tests-*.xml "$LOGS"/report-errors.log "$LOGS"/where.txt
: >"$SUMMARY"
: >"$FAILURES"
export PYTHONUNBUFFERED=1
RESERVE=0     # seconds that step() leaves free for the steps after it
STARTED=0     # whether the last step() started its command
LIMIT=0       # the time limit the last step() ran under

note() { echo "$*" | tee -a "$SUMMARY"; }
fail() { echo "$*" >>"$FAILURES"; }
# report ARGS...: benchmarks/gpu_report.py (counts into the summary, failures into failures.txt).
report() {
  local rc
  "$PY" "$REPO/benchmarks/gpu_report.py" "$@" 2>>"$LOGS/report-errors.log" | tee -a "$SUMMARY"
  rc=${PIPESTATUS[0]}
  ((rc == 0)) || fail "gpu_report.py $1 crashed (exit $rc; see report-errors.log)"
}

# step NAME SECONDS LOGFILE CMD...: run CMD under a hard timeout (clamped to the time left, less
# RESERVE), log its output, and note its exit status and duration in the summary. STEP_SIGNAL
# (default TERM) is what the timeout sends first; KILL follows 15 s later.
step() {
  local name=$1 limit=$2 log=$3; shift 3
  local left=$((TOTAL - SECONDS - RESERVE - 5))
  STARTED=0
  if ((left < 10)); then
    note "$name: not started, no time left in the ${TOTAL}s budget"
    fail "$name: not started, no time left in the ${TOTAL}s budget"
    return 1
  fi
  ((limit > left)) && limit=$left
  STARTED=1 LIMIT=$limit
  echo "== $name (at most ${limit}s)"
  local t0=$SECONDS rc
  timeout -s "${STEP_SIGNAL:-TERM}" -k 15 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  local msg="$name: exit $rc in $((SECONDS - t0))s"
  ((rc == 124 || rc == 137)) && msg="$msg (timed out after ${limit}s)"
  note "$msg"
  return $rc
}

# 1. The machine.
ENV_LOG=$LOGS/env.txt
: >"$ENV_LOG"
step "nvidia-smi" 20 "$ENV_LOG" nvidia-smi
step "python environment" 60 "$ENV_LOG" "$PY" - <<'PYEOF'
import importlib.util, os, platform, sys
print("python", platform.python_version(), sys.executable, "cores", os.cpu_count())
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
    note "no CUDA device: this script is for a GPU machine (LLMU_GPU_ALLOW_CPU=1 rehearses it on a CPU)"
    exit 3
  fi
  note "no CUDA device: rehearsal on the CPU (CPU sizes, Triton interpreted)"
  SIZES=cpu
elif ((ENV_RC != 0)); then
  fail "python environment: exit $ENV_RC (see env.txt)"
fi

# 2. llmu, installed without a network. Build isolation would fetch setuptools, so it is off.
INSTALL_LOG=$LOGS/install.log
: >"$INSTALL_LOG"
if compgen -G ".whl/*.whl" >/dev/null; then
  step "carried wheels" 60 "$INSTALL_LOG" "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --upgrade --target /tmp/llmu-site .whl/*.whl && export PYTHONPATH=/tmp/llmu-site${PYTHONPATH:+:$PYTHONPATH}
fi
if [[ "${LLMU_GPU_INSTALL:-1}" == 0 ]]; then
  note "pip install skipped (LLMU_GPU_INSTALL=0): using PYTHONPATH=$REPO"
elif ! step "pip install -e ." 90 "$INSTALL_LOG" "$PY" -m pip install --no-deps --no-build-isolation \
     --no-index -e .; then
  note "pip install failed: using PYTHONPATH=$REPO"
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}  # harmless after an install, needed without one
# Importing llmu also names the GPU for the results file and says where recorded results go.
WHERE=$LOGS/where.txt
step "import llmu" 60 "$INSTALL_LOG" env WHERE="$WHERE" "$PY" -c "
import os, re, llmu, llmu.bench, torch
from llmu.bench.results import RESULTS_DIR
from llmu.runtime import environment
print(environment())
n = torch.cuda.get_device_name(0).lower() if torch.cuda.is_available() else 'cpu'
n = re.sub(r'[^a-z0-9]+', '-', re.sub(r'\b(nvidia|tesla)\b', '', n)).strip('-') or 'gpu'
open(os.environ['WHERE'], 'w').write(f'{n}\n{RESULTS_DIR}\n')" || fail "import llmu: failed (see install.log)"

# 3. The kernel tests, in two slices with a time limit each; both stop LLMU_GPU_BENCH_S before the
#    end. The first takes the tests whose names say fp16/bf16, half or low precision, "when
#    compiled" or "on GPU": in Triton's CPU interpreter those are skipped or approximate, so only
#    this run checks them. (Test ids show dtype parameters as dtype0, dtype1, so -k matches names;
#    -k also matches folder names, so the words are specific.)
MARKS="(kernels and not slow) or gpu"
FIRST_K="float16 or bfloat16 or fp16 or bf16 or half_precision or low_precision or when_compiled or on_gpu"
if [[ -n "${LLMU_GPU_TESTS:-}" ]]; then
  read -r -a TEST_PATHS <<<"$LLMU_GPU_TESTS"
else
  # Only the modules that mention the markers are collected: importing the others (the notebook
  # tests, say) could fail on an image without Jupyter, and costs every worker time.
  mapfile -t TEST_PATHS < <(grep -rlE --include='test_*.py' '\bmark\.(kernels|gpu)\b' tests | sort)
  if ((${#TEST_PATHS[@]} == 0)); then
    note "no test module mentions the kernels or gpu marker: collecting all of tests/"
    TEST_PATHS=(tests)
  fi
fi
NPROC=$(nproc 2>/dev/null || echo 2)
WORKERS=${LLMU_GPU_WORKERS:-$((NPROC / 2 > 8 ? 8 : NPROC / 2))}
XDIST=()
if ((WORKERS > 1)); then
  if "$PY" -c "import xdist" 2>/dev/null; then
    XDIST=(-n "$WORKERS")
  else
    note "pytest-xdist is not installed: the tests run in one process"
  fi
fi

# test_slice NAME SECONDS KEYWORDS FILE: pytest -v over the kernel tests matching -k KEYWORDS, logged
# to FILE.log (and FILE.xml); gpu_report.py puts the counts in the summary and writes one line per
# failure to failures.txt. SIGINT at the time limit makes pytest print what it has. Returns pytest's
# exit status (5: no test selected).
test_slice() {
  local name=$1 limit=$2 keywords=$3 log=$LOGS/$4.log rc
  : >"$log"
  STEP_SIGNAL=INT step "$name" "$limit" "$log" "$PY" -m pytest -v -p no:cacheprovider "${XDIST[@]}" \
    -c "$REPO/pyproject.toml" --rootdir "$REPO" -m "$MARKS" -k "$keywords" \
    --junitxml="$LOGS/$4.xml" "${TEST_PATHS[@]}"
  rc=$?
  ((STARTED)) || return 1
  report tests "$name" "$log" "$rc" "$LIMIT" "$FAILURES"
  return $rc
}
printf 'test paths: %s\nmarkers: %s\nfirst slice: -k "%s"\nworkers: %s\n' "${TEST_PATHS[*]}" \
  "$MARKS" "$FIRST_K" "${XDIST[*]:-none}" >>"$LOGS/env.txt"
RESERVE=$BENCH_S
test_slice "kernel tests 1/2: fp16/bf16, compiled-only" "$FIRST_S" "$FIRST_K" gpu-tests-1
RC1=$?
test_slice "kernel tests 2/2: the rest" "${LLMU_GPU_REST_S:-$TOTAL}" "not ($FIRST_K)" gpu-tests-2
RC2=$?
if ((RC1 == 5 && RC2 == 5)); then
  fail "kernel tests: no test selected by -m \"$MARKS\" in ${#TEST_PATHS[@]} test path(s) (is the kernels marker on the kernel test modules?)"
fi
RESERVE=0

# 4. Benchmarks on the GPU sizes. --budget stops starting new sizes in time for the results to be
#    written before the hard timeout (which would also save what was measured, marked partial).
#    --strict: a bench module that did not import, a failed row, or a size the budget left
#    unmeasured fails the step; gpu_report.py names each in the summary.
mapfile -t NAMES < <(cat "$WHERE" 2>/dev/null)  # the GPU's short name, llmu.bench.results.RESULTS_DIR
GPU_SLUG=${NAMES[0]:-gpu}
RESULTS_DIR=${LLMU_GPU_RESULTS_DIR:-${NAMES[1]:-$REPO/llmu/data/gpu_results}}
[[ $SIZES == cpu && -z "${LLMU_GPU_RESULTS_DIR:-}" ]] && RESULTS_DIR=$LOGS  # a rehearsal records nothing
mkdir -p "$RESULTS_DIR"
RESULT=$RESULTS_DIR/${GPU_SLUG}-$(date -u +%Y-%m-%d).json
[[ -e "$RESULT" ]] && RESULT=$RESULTS_DIR/${GPU_SLUG}-$(date -u +%Y-%m-%d-%H%M).json
BENCH_LOG=$LOGS/bench.log
: >"$BENCH_LOG"
LEFT=$((TOTAL - SECONDS - 20))
BUDGET=$((LEFT > 80 ? LEFT - 60 : LEFT / 2))
# shellcheck disable=SC2086  # LLMU_BENCH is a list of names
step "llmu bench" "$LEFT" "$BENCH_LOG" "$PY" -m llmu.bench ${LLMU_BENCH:-} --sizes "$SIZES" \
  --budget "$BUDGET" --strict --out "$RESULT"
RC=$?
# shellcheck disable=SC2086
((STARTED)) && report bench "$RESULT" "$RC" "$FAILURES" ${LLMU_BENCH:-}
[[ -f "$RESULT" ]] || RESULT="(none written)"

# The verdict: every failure, one line each.
note "== done in ${SECONDS}s; results: $RESULT"
NFAIL=$(grep -c . "$FAILURES")
if ((NFAIL)); then
  note "FAILED: $NFAIL problem(s):"
  sed 's/^/  /' "$FAILURES" | tee -a "$SUMMARY"
else
  note "OK: every step passed"
fi
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  for f in "$SUMMARY" "$FAILURES" "$ENV_LOG" "$INSTALL_LOG" "$LOGS"/gpu-tests-* "$BENCH_LOG" \
    "$LOGS/report-errors.log" "$RESULT"; do
    [[ -f "$f" ]] && cp "$f" "$OUT/"
  done
fi
((NFAIL == 0))
