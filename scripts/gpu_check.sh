#!/usr/bin/env bash
# One prepared run on a GPU machine with no network and a preinstalled CUDA torch (Python 3.12,
# pytest, ninja; numpy and pytest-benchmark used where present; no .venv needed): preflight, build,
# the named CUDA test files each under a timeout, the fused-Adam and host-offload benchmarks, compute-sanitizer's
# memcheck over the kernel tests if time remains, and a summary table. Fits 8 minutes on one H200
# (GPU_CHECK_BUDGET_S).
#
#   bash scripts/gpu_check.sh             # logs, and summary.txt, under $OUT (or ./gpu_check_out)
#   bash scripts/gpu_check.sh --dry-run   # every step that needs no GPU: the same preflight with its
#                                         # CUDA checks stubbed, collection of the named files, the
#                                         # benchmark's arguments, the summary (tests/test_gpu_check.py)
#   source scripts/gpu_check.sh           # the functions only, for tests/test_gpu_check.py
#
# What makes a run PASS: the preflight finds CUDA and a GPU (and, after the build, zerofast's CUDA
# kernels), else the run stops there as FAIL; every required step exits 0; a CUDA test step's pytest
# summary shows no skip but the two-GPU case (ALLOWED_SKIP). Each step runs in a process group of
# its own, and everything it started is killed at its limit (TIMEOUT) or when it ends.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The machine's python3 unless told (PYTHON) or unless the checkout has its own environment.
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then
  PY=$ROOT/.venv/bin/python
else
  PY=python3
fi
DRY=0
OUTDIR=${OUT:-gpu_check_out}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
# Seconds between TERM and KILL for a step's processes (a rank may be writing its outcome).
KILL_GRACE=${GPU_CHECK_KILL_GRACE_S:-10}
# Each step's log goes to $OUTDIR/logs/, packed into logs.tgz at the end of a GPU run (a device
# machine hands back few files): $OUTDIR keeps summary.txt, logs.tgz and the profile's trace.
LOGDIR="$OUTDIR/logs"
START=$(date +%s)
ROWS=()
FAILED=0

# The CUDA test files, by name (collecting `-m cuda tests` would import every module).
KERNEL_TESTS="tests/test_fused_adam.py tests/test_quant_state.py" # fp32 and 8-bit kernels
ENGINE_TESTS="tests/test_cuda_engine.py tests/test_cuda_offload.py" # the engine; the state offloaded from the GPU
RANK_TESTS="tests/test_cuda_ranks.py"

# Steps that only measure or look further: running out of time there is reported, not a failure.
OPTIONAL_STEPS=" profile benchmark offload-benchmark memcheck "

# The one skip a run on one GPU may show: the two-GPU test of RANK_TESTS,
# test_stage3_reduces_and_gathers_on_two_gpus_neither_hang_nor_drift. pytest's -rs summary names a
# skip by its file, line and reason, not by the test's name, so it is matched by file and reason
# (its reason is TWO_GPUS in tests/test_cuda_ranks.py; tests/test_gpu_check.py feeds this pattern
# pytest's own line for that test):
#   SKIPPED [1] tests/test_cuda_ranks.py:378: needs 2 GPUs (NCCL: one rank per GPU)
ALLOWED_SKIP='^SKIPPED \[1\] tests/test_cuda_ranks\.py:[0-9]+: needs 2 GPUs \(NCCL: one rank per GPU\)$'

# The preflight's Python checks, one snippet for the GPU run and the dry run: `cuda` (the interpreter,
# torch and pytest, then a GPU torch can use) and `kernels` (zerofast built with its CUDA kernels).
# Each prints its summary rows as "ROW<tab>STATUS<tab>NOTE" and exits 1 if one of them failed. With
# GPU_CHECK_STUB=1 (the dry run) the CUDA checks require nothing: through the same imports and calls,
# they say what they would require and what this machine has (status STUB).
PREFLIGHT_PY=$(
  cat <<'EOF'
import os
import sys

import torch

stub = os.environ.get("GPU_CHECK_STUB") == "1"


def row(name: str, ok: bool, wanted: str, found: str) -> bool:
    if stub:
        print(f"{name}\tSTUB\tstub: would require {wanted}; here {found}")
    else:
        print(f"{name}\t{'PASS' if ok else 'FAIL'}\t{found if ok else f'required {wanted}; got {found}'}")
    return ok or stub


check = sys.argv[1]
if check == "cuda":
    import pytest

    print(f"python\tPASS\t{sys.executable} {sys.version.split()[0]}, torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}), pytest {pytest.__version__}")
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(count))
    found = f"is_available()={available}, device_count()={count}" + (f": {names}" if names else "")
    ok = row("cuda", available and count >= 1, "torch.cuda.is_available() and torch.cuda.device_count() >= 1", found)
elif check == "kernels":
    import zerofast

    has = zerofast.has_cuda_kernels()
    ok = row("cuda-kernels", has, "zerofast.has_cuda_kernels()", f"has_cuda_kernels()={has} ({zerofast.__file__})")
else:
    sys.exit(f"unknown preflight check {check!r}")
sys.exit(0 if ok else 1)
EOF
)

left() { echo $((BUDGET - ($(date +%s) - START))); }

# record NAME STATUS SECONDS NOTE
record() {
  ROWS+=("$(printf '%-22s %-8s %6s  %s' "$1" "$2" "$3" "$4")")
  if [ "$2" = FAIL ] || { [[ " TIMEOUT NOTRUN " = *" $2 "* ]] && [[ "$OPTIONAL_STEPS" != *" $1 "* ]]; }; then
    FAILED=1
  fi
  return 0
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

# preflight CHECK: one of PREFLIGHT_PY's checks (at most 120 s: a CUDA driver can hang), its rows
# recorded; a failure, or Python not getting as far as a row, ends the run as FAIL, since nothing
# after it would mean anything.
preflight() {
  local check=$1 log="$LOGDIR/preflight-$1.log" rc rows row status note
  run_in_group 120 "$log" env GPU_CHECK_STUB=$DRY "$PY" -c "$PREFLIGHT_PY" "$check"
  rc=$?
  rows=$(grep -E $'^[a-z-]+\t(PASS|FAIL|STUB)\t' "$log")
  while IFS=$'\t' read -r row status note; do
    [ -n "$note" ] && record "$row" "$status" 0 "$note"
  done <<<"$rows"
  if [ $rc -ne 0 ]; then
    if [ $rc -eq 124 ]; then
      record "preflight-$check" TIMEOUT 120 "over 120 s; see logs/preflight-$check.log"
    elif ! grep -q $'\tFAIL\t' <<<"$rows"; then
      record "preflight-$check" FAIL 0 "$(tail -1 "$log" | cut -c1-160)"
    fi
    cat "$log"
    summary
    exit 1
  fi
}

# step_pids PGID TAG: the step's live processes (zombies aside): its process group, and any process
# that left the group but carries the step's tag in its environment (torchrun starts its workers in
# sessions of their own: start_new_session=True in torch/distributed/elastic/multiprocessing/
# subprocess_handler; Jenkins' ProcessTreeKiller finds a build's processes by the same means).
step_pids() {
  {
    ps -e -o pid=,pgid=,stat= 2>/dev/null | awk -v g="$1" '$2 == g && $3 !~ /^Z/ { print $1 }'
    grep -lzx "GPU_CHECK_STEP=$2" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3
  } | sort -u
}

# stop_step PGID TAG: TERM to every process of the step, KILL to those left after KILL_GRACE seconds,
# then the wait until none runs.
stop_step() {
  local pids end=$((SECONDS + KILL_GRACE))
  pids=$(step_pids "$1" "$2")
  [ -z "$pids" ] && return 0
  kill -TERM -- "-$1" $pids 2>/dev/null
  while [ $SECONDS -lt $end ] && [ -n "$(step_pids "$1" "$2")" ]; do sleep 0.2; done
  pids=$(step_pids "$1" "$2")
  [ -z "$pids" ] && return 0
  kill -KILL -- "-$1" $pids 2>/dev/null
  # SIGKILL takes effect when the process next runs: on a loaded machine a killed process can still
  # show as running for a moment, so the step ends only once none does (bounded, as the TERM wait).
  end=$((SECONDS + KILL_GRACE + 5))
  while [ $SECONDS -lt $end ] && [ -n "$(step_pids "$1" "$2")" ]; do sleep 0.1; done
  return 0
}

# run_in_group LIMIT LOG COMMAND...: COMMAND in a session (so a process group) of its own, output to
# LOG. Past LIMIT seconds every process of the step is stopped (stop_step): all ranks and their
# children, not only COMMAND, which a plain timeout would leave running where they left the group.
# Processes left when COMMAND ends (ranks outliving their launcher, holding the GPU) are stopped too.
# Returns COMMAND's status, or 124 past the limit (as timeout(1)).
run_in_group() {
  local limit=$1 log=$2
  shift 2
  local tag="$$.$RANDOM.$(date +%s%N)" end=$((SECONDS + limit)) rc leader leftover
  # Without job control (a script) a background job is no group leader, so setsid makes the new
  # session in the job itself without forking: $! is the group's id.
  GPU_CHECK_STEP=$tag setsid "$@" </dev/null >"$log" 2>&1 &
  leader=$!
  while [ $SECONDS -lt $end ] && kill -0 "$leader" 2>/dev/null; do sleep 0.2; done
  if kill -0 "$leader" 2>/dev/null; then
    echo "== gpu_check: over ${limit} s: stopping the step's processes $(step_pids "$leader" "$tag" | tr '\n' ' ')" >>"$log"
    stop_step "$leader" "$tag"
    wait "$leader"
    return 124
  fi
  wait "$leader"
  rc=$?
  leftover=$(step_pids "$leader" "$tag" | tr '\n' ' ')
  if [ -n "$leftover" ]; then
    echo "== gpu_check: the step left processes running; stopping $leftover" >>"$log"
    stop_step "$leader" "$tag"
  fi
  return $rc
}

# skip_verdict LOG: "PASS" when pytest's short summary in LOG lists no skip but ALLOWED_SKIP, else
# "FAIL <count> unexpected skip(s): <each summary line>" (a line of -rs stands for [N] skips).
skip_verdict() {
  grep -E '^SKIPPED \[[0-9]+\] ' "$1" | grep -Ev "$ALLOWED_SKIP" | awk '
    { count += substr($2, 2, length($2) - 2); sub(/^SKIPPED /, ""); lines = lines (NR > 1 ? "; " : "") $0 }
    END { print (NR == 0 ? "PASS" : "FAIL " count " unexpected skip(s): " lines) }'
}

# step [--skips] NAME LIMIT_S COMMAND...: run it under its limit (run_in_group), log to $LOGDIR/NAME.log,
# record the outcome. --skips: a CUDA test step, which also fails on a skip other than ALLOWED_SKIP.
step() {
  local check_skips=0
  if [ "$1" = --skips ]; then
    check_skips=1
    shift
  fi
  local name=$1 limit=$2
  shift 2
  local t0 rc avail log="$LOGDIR/$name.log" margin
  avail=$(($(left) - 15)) # the summary's margin
  if [ "$avail" -lt 10 ]; then
    record "$name" NOTRUN 0 "no time left of ${BUDGET} s"
    return 1
  fi
  [ "$limit" -gt "$avail" ] && limit=$avail
  t0=$(date +%s)
  # The ranks' own timeout ends before the step's limit (tests/test_cuda_ranks.py _ranks_timeout), so
  # that a hang is reported by the harness naming the stuck ranks, not by the kill, which names none.
  margin=$((limit > 60 ? 30 : limit / 2))
  ZEROFAST_RANKS_DEADLINE=$((t0 + limit - margin)) run_in_group "$limit" "$log" "$@"
  rc=$?
  local took=$(($(date +%s) - t0)) last verdict
  last=$(grep -E "passed|failed|error|skipped|collected|tests? " "$log" | tail -1 | cut -c1-90)
  [ $rc -eq 0 ] && [ $check_skips -eq 1 ] && verdict=$(skip_verdict "$log")
  if [ "${verdict:-PASS}" != PASS ]; then
    record "$name" FAIL "$took" "${verdict#FAIL }; see logs/$name.log"
    return 1
  elif [ $rc -eq 0 ]; then
    record "$name" PASS "$took" "${last:-ok}"
  elif [ $rc -eq 5 ] && [ $DRY -eq 1 ]; then # pytest: nothing collected (a GPU-only selection here)
    record "$name" PASS "$took" "arguments accepted; nothing to collect without a GPU"
    rc=0
  elif [ $rc -eq 124 ]; then
    record "$name" TIMEOUT "$took" "over ${limit}s, every process of the step killed; see logs/$name.log"
  else
    record "$name" FAIL "$took" "${last:-rc $rc}; see logs/$name.log"
    tail -25 "$log"
  fi
  return $rc
}

# The environment of every step.
export_env() {
  export ZEROFAST_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  # gloo binds to the interface the host name resolves to; a machine without network may have none
  # that works, so its ranks talk over loopback (they all run here).
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
  # 200M fp32 elements: 3.2 GB per state tensor, far past the 60 MB L2, and a few seconds per case.
  export ZEROFAST_BENCH_NUMEL=${ZEROFAST_BENCH_NUMEL:-200000000}
}

preflight_steps() {
  echo "== preflight (python $PY)"
  preflight cuda # a run where CUDA is unavailable stops here: it can never report PASS
  if [ $DRY -eq 0 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$LOGDIR/machine.log" 2>&1
    cat "$LOGDIR/machine.log"
  fi
  if "$PY" "$ROOT/scripts/cuda_toolkit.py" >"$LOGDIR/toolkit.log" 2>&1; then
    record toolkit PASS 0 "$(head -2 "$LOGDIR/toolkit.log" | tr '\n' ' ' | cut -c1-90)"
  elif [ $DRY -eq 1 ]; then
    record toolkit SKIP 0 "$(tail -1 "$LOGDIR/toolkit.log" | cut -c1-90)"
  else
    record toolkit FAIL 0 "$(tail -1 "$LOGDIR/toolkit.log" | cut -c1-90)"
    cat "$LOGDIR/toolkit.log"
    summary
    exit 1
  fi
  if "$PY" -c "import numpy" 2>/dev/null; then
    record numpy PASS 0 "present"
  else
    record numpy SKIP 0 "absent: the numpy round trip in test_checkpoint_safe skips (not run here anyway)"
  fi
  HAVE_BENCH=0
  if "$PY" -c "import pytest_benchmark" 2>/dev/null; then
    HAVE_BENCH=1
    record pytest-benchmark PASS 0 "present"
  else
    record pytest-benchmark SKIP 0 "absent: the fused-Adam benchmark is skipped"
  fi
}

build_steps() {
  echo "== build"
  if [ $DRY -eq 1 ]; then
    record build SKIP 0 "dry run: no rebuild; the check below reads the extension this checkout has"
  elif ! step build 300 "$PY" setup.py build_ext --inplace; then
    summary
    exit 1
  fi
  preflight kernels # the build must have made the CUDA kernels, or the CUDA tests would skip
}

cuda_test_steps() {
  echo "== CUDA tests"
  local pytest_args=(-m pytest -q -x -ra -p no:cacheprovider -m cuda)
  if [ $DRY -eq 1 ]; then
    # One collection of the named files' CUDA tests, counted per file.
    step collect 120 "$PY" "${pytest_args[@]}" --collect-only $KERNEL_TESTS $ENGINE_TESTS $RANK_TESTS
    local named file n counts status
    for named in "kernel-tests $KERNEL_TESTS" "engine-tests $ENGINE_TESTS" "rank-tests $RANK_TESTS"; do
      set -- $named
      counts="" status=PASS
      for file in "${@:2}"; do
        n=$(grep -c "^$file::" "$LOGDIR/collect.log")
        [ "$n" -gt 0 ] || status=FAIL # a named file without CUDA tests: renamed, or its marks lost
        counts+="${counts:+, }$n tests collected from $file"
      done
      record "$1" $status 0 "$counts"
    done
  else
    step --skips kernel-tests 90 "$PY" "${pytest_args[@]}" $KERNEL_TESTS
    step --skips engine-tests 120 "$PY" "${pytest_args[@]}" $ENGINE_TESTS
    step --skips rank-tests 240 "$PY" "${pytest_args[@]}" $RANK_TESTS
  fi
}

demo_and_profile_steps() {
  echo "== demo (make demo's job: NCCL, one rank per GPU, DDP and the reference stage beside it)"
  local demo_args=(--compare --steps 8 --model tiny)
  if [ $DRY -eq 1 ]; then
    step demo-args 60 "$PY" -c "import sys; from zerofast.tools.train import parse_args; a = parse_args(sys.argv[1:]); print('nproc', a.nproc)" "${demo_args[@]}"
  else
    step demo 120 "$PY" -m zerofast.train "${demo_args[@]}"
  fi

  echo "== profile (a stage-2 bf16 step: the GPU's idle time before the update; the trace goes to \$OUT)"
  if [ $DRY -eq 1 ]; then
    step profile-args 60 "$PY" scripts/profile_step.py --help
  else
    step profile 90 "$PY" -m torch.distributed.run --nproc-per-node 1 scripts/profile_step.py --out "$OUTDIR" &&
      grep "GPU idle" "$LOGDIR/profile.log"
  fi
}

benchmark_steps() {
  echo "== fused-Adam benchmark (ZEROFAST_BENCH_NUMEL=$ZEROFAST_BENCH_NUMEL)"
  local bench_args=(-m pytest -q -p no:cacheprovider benchmarks/bench_adam.py -k cuda --benchmark-only
    --benchmark-columns=min,median,max,rounds --benchmark-max-time=0.5)
  if [ $HAVE_BENCH -eq 0 ]; then
    record benchmark SKIP 0 "pytest-benchmark absent"
  elif [ $DRY -eq 1 ]; then
    step benchmark-args 120 "$PY" "${bench_args[@]}" --collect-only
  elif [ "$(left)" -lt 60 ]; then
    record benchmark SKIP 0 "$(left) s left"
  else
    step benchmark 90 "$PY" "${bench_args[@]}" && grep -A10 "zerofast summary" "$LOGDIR/benchmark.log"
  fi

  echo "== host offload benchmark (ZeroAdam's state in pinned host memory against it on the GPU and torch's AdamW on the CPU)"
  local offload_args=(-m pytest -q -p no:cacheprovider benchmarks/bench_offload.py -k host_from_gpu --benchmark-only)
  if [ $HAVE_BENCH -eq 0 ]; then
    record offload-benchmark SKIP 0 "pytest-benchmark absent"
  elif [ $DRY -eq 1 ]; then
    step offload-benchmark-args 120 "$PY" "${offload_args[@]}" --collect-only
  elif [ "$(left)" -lt 120 ]; then
    record offload-benchmark SKIP 0 "$(left) s left"
  else
    step offload-benchmark 150 "$PY" "${offload_args[@]}" && grep -A8 "host from a GPU" "$LOGDIR/offload-benchmark.log"
  fi

  echo "== compute-sanitizer memcheck over the kernel tests"
  local sanitizer san_args
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  san_args=(--tool memcheck --error-exitcode 1 "$PY" -m pytest -q -x -ra -p no:cacheprovider -m cuda $KERNEL_TESTS)
  if [ -z "$sanitizer" ]; then
    record memcheck SKIP 0 "compute-sanitizer not found"
  elif [ $DRY -eq 1 ]; then
    record memcheck SKIP 0 "dry run: would run $sanitizer ${san_args[*]:0:3} ..."
  elif [ "$(left)" -lt 90 ]; then
    record memcheck SKIP 0 "$(left) s left"
  else
    # Without torch's caching allocator, so that an access past a tensor lands outside any allocation.
    step --skips memcheck $(($(left) - 20)) env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" "${san_args[@]}"
  fi
}

main() {
  case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") ;;
    *)
      echo "usage: bash scripts/gpu_check.sh [--dry-run]; got '$1'" >&2
      exit 2
      ;;
  esac
  cd "$ROOT" || exit 2
  mkdir -p "$LOGDIR"
  export_env
  preflight_steps
  build_steps
  cuda_test_steps
  demo_and_profile_steps
  benchmark_steps
  summary
  exit $FAILED
}

# Sourced (tests/test_gpu_check.py): the functions only.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
