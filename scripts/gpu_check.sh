#!/usr/bin/env bash
# One prepared run on a GPU machine with no network and a preinstalled CUDA torch (Python 3.12,
# pytest, ninja; numpy and pytest-benchmark used where present): preflight, build, the named CUDA
# test files each under a timeout, the fused-Adam benchmark, compute-sanitizer's memcheck over the
# kernel tests if time remains, and a summary table. Fits 8 minutes on one H200 (GPU_CHECK_BUDGET_S).
#
#   bash scripts/gpu_check.sh             # logs, and summary.txt, under $OUT (or ./gpu_check_out)
#   bash scripts/gpu_check.sh --dry-run   # every step that needs no GPU: preflight, the build's
#                                         # decision (no rebuild), collection of the named files,
#                                         # the benchmark's arguments, the summary (tests/test_gpu_check.py)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bash scripts/gpu_check.sh [--dry-run]; got '$1'" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
OUTDIR=${OUT:-gpu_check_out}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
# Each step's log goes to $OUTDIR/logs/, packed into logs.tgz at the end of a GPU run (a device
# machine hands back few files): $OUTDIR keeps summary.txt, logs.tgz and the profile's trace.
LOGDIR="$OUTDIR/logs"
mkdir -p "$LOGDIR"
export ZEROFAST_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# 200M fp32 elements: 3.2 GB per state tensor, far past the 60 MB L2, and a few seconds per case.
export ZEROFAST_BENCH_NUMEL=${ZEROFAST_BENCH_NUMEL:-200000000}
START=$(date +%s)
ROWS=()
FAILED=0

# The CUDA test files, by name (collecting `-m cuda tests` would import every module).
KERNEL_TESTS="tests/test_fused_adam.py tests/test_quant_state.py"  # fp32 and 8-bit kernels
ENGINE_TESTS="tests/test_cuda_engine.py"
RANK_TESTS="tests/test_cuda_ranks.py"

# Steps that only measure or look further: running out of time there is reported, not a failure.
OPTIONAL_STEPS=" profile benchmark memcheck "

left() { echo $((BUDGET - ($(date +%s) - START))); }

# record NAME STATUS SECONDS NOTE
record() {
  ROWS+=("$(printf '%-22s %-8s %6s  %s' "$1" "$2" "$3" "$4")")
  if [ "$2" = FAIL ] || { [[ " TIMEOUT NOTRUN " = *" $2 "* ]] && [[ "$OPTIONAL_STEPS" != *" $1 "* ]]; }; then
    FAILED=1
  fi
  return 0
}

# step NAME TIMEOUT_S COMMAND...: run it under a timeout, log to $LOGDIR/NAME.log, record the outcome
step() {
  local name=$1 limit=$2
  shift 2
  local t0 rc avail
  avail=$(($(left) - 15)) # the summary's margin
  if [ "$avail" -lt 10 ]; then
    record "$name" NOTRUN 0 "no time left of ${BUDGET} s"
    return 1
  fi
  [ "$limit" -gt "$avail" ] && limit=$avail
  t0=$(date +%s)
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$LOGDIR/$name.log" 2>&1
  rc=$?
  local took=$(($(date +%s) - t0)) last
  last=$(grep -E "passed|failed|error|skipped|collected|tests? " "$LOGDIR/$name.log" | tail -1 | cut -c1-90)
  if [ $rc -eq 0 ]; then
    record "$name" PASS "$took" "${last:-ok}"
  elif [ $rc -eq 5 ] && [ $DRY -eq 1 ]; then  # pytest: nothing collected (a GPU-only selection here)
    record "$name" PASS "$took" "arguments accepted; nothing to collect without a GPU"
    rc=0
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    record "$name" TIMEOUT "$took" "over ${limit}s; see logs/$name.log"
  else
    record "$name" FAIL "$took" "${last:-rc $rc}; see logs/$name.log"
    tail -25 "$LOGDIR/$name.log"
  fi
  return $rc
}

summary() {
  {
    echo "== summary ($([ $DRY -eq 1 ] && echo dry-run || echo GPU run), $(($(date +%s) - START)) s of ${BUDGET} s)"
    printf '%-22s %-8s %6s  %s\n' step status s note
    printf '%s\n' "${ROWS[@]}"
    echo "== $([ $FAILED -eq 0 ] && echo PASS || echo FAIL)"
  } | tee "$OUTDIR/summary.txt"
  if [ $DRY -eq 0 ]; then
    [ -f "$OUTDIR/step_trace.json" ] && gzip -f "$OUTDIR/step_trace.json"
    tar czf "$OUTDIR/logs.tgz" -C "$OUTDIR" logs && rm -rf "$LOGDIR"
  fi
}

if [ $DRY -eq 0 ]; then
  echo "== machine"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" | tee "$LOGDIR/machine.log"
fi

echo "== preflight"
if $PY scripts/cuda_toolkit.py >"$LOGDIR/toolkit.log" 2>&1; then
  record toolkit PASS 0 "$(head -2 "$LOGDIR/toolkit.log" | tr '\n' ' ' | cut -c1-90)"
elif [ $DRY -eq 1 ]; then
  record toolkit SKIP 0 "$(tail -1 "$LOGDIR/toolkit.log" | cut -c1-90)"
else
  record toolkit FAIL 0 "$(tail -1 "$LOGDIR/toolkit.log" | cut -c1-90)"
  cat "$LOGDIR/toolkit.log"
  summary
  exit 1
fi
if $PY -c "import numpy" 2>/dev/null; then
  record numpy PASS 0 "present"
else
  record numpy SKIP 0 "absent: the numpy round trip in test_checkpoint_safe skips (not run here anyway)"
fi
HAVE_BENCH=0
if $PY -c "import pytest_benchmark" 2>/dev/null; then
  HAVE_BENCH=1
  record pytest-benchmark PASS 0 "present"
else
  record pytest-benchmark SKIP 0 "absent: the fused-Adam benchmark is skipped"
fi

echo "== build"
if [ $DRY -eq 1 ]; then
  # No rebuild: the extension this checkout has, and what a build would decide.
  step build-check 120 $PY -c "import torch, zerofast; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| zerofast._C imports; has_cuda_kernels:', zerofast.has_cuda_kernels())"
else
  if step build 300 $PY setup.py build_ext --inplace; then
    step cuda-kernels 60 $PY -c "import zerofast; assert zerofast.has_cuda_kernels(), 'built without the CUDA kernels'; print('has_cuda_kernels: True')"
  fi
  if [ $FAILED -ne 0 ]; then
    summary
    exit 1
  fi
fi

echo "== CUDA tests"
if [ $DRY -eq 1 ]; then
  # One collection of the named files (every test in them is marked cuda), counted per file.
  step collect 120 $PY -m pytest -q --collect-only -p no:cacheprovider -m cuda $KERNEL_TESTS $ENGINE_TESTS $RANK_TESTS
  for named in "kernel-tests $KERNEL_TESTS" "engine-tests $ENGINE_TESTS" "rank-tests $RANK_TESTS"; do
    set -- $named
    n=$(grep -c "^$2::" "$LOGDIR/collect.log")
    record "$1" "$([ "$n" -gt 0 ] && echo PASS || echo FAIL)" 0 "$n tests collected from $2"
  done
else
  step kernel-tests 90 $PY -m pytest -q -x -p no:cacheprovider $KERNEL_TESTS -m cuda
  step engine-tests 120 $PY -m pytest -q -x -p no:cacheprovider $ENGINE_TESTS
  step rank-tests 240 $PY -m pytest -q -x -p no:cacheprovider $RANK_TESTS
fi

echo "== demo (make demo's job: NCCL, one rank per GPU, DDP and the reference stage beside it)"
DEMO_ARGS=(--compare --steps 8 --model tiny)
if [ $DRY -eq 1 ]; then
  step demo-args 60 $PY -c "import sys; from zerofast.tools.train import parse_args; a = parse_args(sys.argv[1:]); print('nproc', a.nproc)" "${DEMO_ARGS[@]}"
else
  step demo 120 $PY -m zerofast.train "${DEMO_ARGS[@]}"
fi

echo "== profile (a stage-2 bf16 step: the GPU's idle time before the update; the trace goes to \$OUT)"
if [ $DRY -eq 1 ]; then
  step profile-args 60 $PY scripts/profile_step.py --help
else
  step profile 90 $PY -m torch.distributed.run --nproc-per-node 1 scripts/profile_step.py --out "$OUTDIR" &&
    grep "GPU idle" "$LOGDIR/profile.log"
fi

echo "== fused-Adam benchmark (ZEROFAST_BENCH_NUMEL=$ZEROFAST_BENCH_NUMEL)"
BENCH_ARGS=(-m pytest -q -p no:cacheprovider benchmarks/bench_adam.py -k cuda --benchmark-only
  --benchmark-columns=min,median,max,rounds --benchmark-max-time=0.5)
if [ $HAVE_BENCH -eq 0 ]; then
  record benchmark SKIP 0 "pytest-benchmark absent"
elif [ $DRY -eq 1 ]; then
  step benchmark-args 120 $PY "${BENCH_ARGS[@]}" --collect-only
elif [ "$(left)" -lt 60 ]; then
  record benchmark SKIP 0 "$(left) s left"
else
  step benchmark 90 $PY "${BENCH_ARGS[@]}" && grep -A10 "zerofast summary" "$LOGDIR/benchmark.log"
fi

echo "== compute-sanitizer memcheck over the kernel tests"
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
SAN_ARGS=(--tool memcheck --error-exitcode 1 $PY -m pytest -q -x -p no:cacheprovider $KERNEL_TESTS -m cuda)
if [ -z "$SANITIZER" ]; then
  record memcheck SKIP 0 "compute-sanitizer not found"
elif [ $DRY -eq 1 ]; then
  record memcheck SKIP 0 "dry run: would run $SANITIZER ${SAN_ARGS[*]:0:3} ..."
elif [ "$(left)" -lt 90 ]; then
  record memcheck SKIP 0 "$(left) s left"
else
  # Without torch's caching allocator, so that an access past a tensor lands outside any allocation.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 step memcheck $(($(left) - 20)) "$SANITIZER" "${SAN_ARGS[@]}"
fi

summary
exit $FAILED
