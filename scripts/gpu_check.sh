#!/usr/bin/env bash
# One script for a GPU machine with no network and a preinstalled CUDA torch (2.11 or newer,
# Python 3.12, pytest, pytest-benchmark, ninja): builds zerofast against that torch, runs the CUDA
# tests and the GPU benchmarks, prints a summary. Meant to finish in under 8 minutes on one H200.
#   bash scripts/gpu_check.sh            # logs and tables also go to $OUT (or ./gpu_check_out)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTDIR=${OUT:-gpu_check_out}
mkdir -p "$OUTDIR"
export ZEROFAST_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

echo "== build (in place)"
start=$(date +%s)
if ! $PY setup.py build_ext --inplace >"$OUTDIR/build.log" 2>&1; then
  tail -40 "$OUTDIR/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "built in $(( $(date +%s) - start )) s"
$PY -c "import zerofast; assert zerofast.has_cuda_kernels(), 'no CUDA kernels'; print('has_cuda_kernels: True')" || exit 1

echo "== CUDA tests"
$PY -m pytest -q -m cuda tests 2>&1 | tee "$OUTDIR/tests.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== GPU benchmarks (fused Adam, 500M elements)"
$PY -m pytest -q benchmarks/bench_adam.py -k cuda --benchmark-only \
  --benchmark-columns=min,median,max,rounds 2>&1 | tee "$OUTDIR/bench.log" | grep -A8 "zerofast summary"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== summary: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
