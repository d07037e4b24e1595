#!/usr/bin/env bash
# Launches the README's example under torchrun, again and again, and counts the launches that did
# not exit 0: what a scheduler would mark failed ([Note: clean exit] in csrc/work_keeper.cpp).
#
#   bash scripts/exit_check.sh [LAUNCHES] [LANES]     # default 50 launches, 3 side by side
#
# The example is taken from README.md as it stands. The launches cycle through stages 1, 2 and 3,
# each with and without dist.destroy_process_group() at its end; LANES launches run side by side
# (each is 2 ranks), so a 2-core machine is loaded as a busy machine is. Prints one line per
# launch that failed (its log is kept under $OUT or ./exit_check_out) and a table per
# configuration; exits 1 if any launch failed. docs/testing.md has the measured result.
set -uo pipefail
cd "$(dirname "$0")/.."
LAUNCHES=${1:-50}
LANES=${2:-3}
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUTDIR=${OUT:-exit_check_out}
mkdir -p "$OUTDIR"
rm -f "$OUTDIR"/*.log "$OUTDIR"/result.*

# The README's example: the first ```python block.
awk '/^```python$/{on=1; next} /^```$/{if (on) exit} on' README.md >"$OUTDIR/example.py"
grep -q "ZeroAdam(model, stage=3" "$OUTDIR/example.py" || {
  echo "exit_check.sh: README.md's example no longer builds ZeroAdam(model, stage=3, ...)" >&2
  exit 2
}
for stage in 1 2 3; do
  sed "s/ZeroAdam(model, stage=3/ZeroAdam(model, stage=$stage/" "$OUTDIR/example.py" >"$OUTDIR/stage$stage.py"
  { cat "$OUTDIR/stage$stage.py"; echo "dist.destroy_process_group()"; } >"$OUTDIR/stage$stage-destroy.py"
done
CONFIGS=(stage1 stage2 stage3 stage1-destroy stage2-destroy stage3-destroy)

# launch I: configuration I mod 6, on a port of its own; records "CONFIG RC" in result.I
launch() {
  local i=$1 config=${CONFIGS[$(($1 % 6))]}
  local port=$((29500 + 1 + i % 1000 * 7 + RANDOM % 7))
  OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 300 \
    "$PY" -m torch.distributed.run --nproc-per-node 2 --master-port "$port" "$OUTDIR/$config.py" \
    >"$OUTDIR/launch-$i.log" 2>&1
  local rc=$?
  echo "$config $rc" >"$OUTDIR/result.$i"
  if [ $rc -ne 0 ] || grep -q "terminate called" "$OUTDIR/launch-$i.log"; then
    echo "launch $i ($config): exit $rc$(grep -m1 -o 'terminate called.*' "$OUTDIR/launch-$i.log" | sed 's/^/, /')"
  else
    rm -f "$OUTDIR/launch-$i.log"
  fi
}

START=$(date +%s)
for ((i = 0; i < LAUNCHES; i++)); do
  while [ "$(jobs -rp | wc -l)" -ge "$LANES" ]; do wait -n; done
  launch "$i" &
done
wait
SECONDS_TAKEN=$(($(date +%s) - START))

echo "== $LAUNCHES launches of README.md's example, $LANES side by side, $SECONDS_TAKEN s, torch $("$PY" -c 'import torch; print(torch.__version__)')"
printf '%-16s %8s %8s\n' configuration launches failed
FAILED=0
for config in "${CONFIGS[@]}"; do
  n=$(cat "$OUTDIR"/result.* | grep -c "^$config ")
  bad=$(cat "$OUTDIR"/result.* | grep "^$config " | grep -vc " 0$")
  FAILED=$((FAILED + bad))
  printf '%-16s %8s %8s\n' "$config" "$n" "$bad"
done
echo "== $([ $FAILED -eq 0 ] && echo "all exited 0" || echo "$FAILED failed")"
exit $((FAILED > 0))
