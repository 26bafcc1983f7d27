#!/usr/bin/env bash
# Same-session A/B of this tree against another checkout of the project (OLD=dir, e.g. the last commit
# unpacked with `git archive HEAD | tar -x -C build/old_tree`, carried to the device): the GPU tier on
# this tree (TESTS=0 skips it), the decode GEMVs in the kernel lab in both trees (LAB=1), then the
# decode step (step_ab) in both trees, alternating old/new for ROUNDS rounds (this tree's with
# VARIANTS, '|'-separated; the first `base`) at CONTEXT tokens in a pool of MAX_CONTEXT (defaults: the
# bench's 1,053 and 32,832). A tree from before lab/ keeps its tools in bench/. Logs to $OUT.
# Run from the repository root on the GPU machine:  OLD=build/old_tree bash lab/gpu_tree_ab.sh
set -uo pipefail
: "${OUT:?set OUT}" "${OLD:?set OLD to the other tree}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
root=$(pwd)
tools() { [ -d "$1/lab" ] && echo lab || echo bench; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  NINFER_BUILD_DIR=/tmp/nb-new timeout ${TESTS_S:-300} python3 -m pytest -m gpu tests/gpu -q -rf -p no:cacheprovider \
    2>&1 | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|error" | tail -12
fi
if [ "${LAB:-0}" = 1 ]; then
  for side in new old; do
    dir=$([ $side = new ] && echo "$root" || echo "$root/$OLD")
    (cd "$dir" && NINFER_BUILD_DIR=/tmp/nb-$side timeout ${LAB_S:-150} python3 -m $(tools "$dir").kernel_lab --only gemv \
      --out $OUT/lab_$side.json 2>&1 | grep -v "it/s\]" > $OUT/lab_$side.log)
    echo "lab $side: rc $?"; grep -E "^(gemv|device)" $OUT/lab_$side.log | awk '{print $1, $2, $(NF-1), $NF}'
  done
fi
for round in $(seq 1 ${ROUNDS:-2}); do
  for side in old new; do
    dir=$([ $side = new ] && echo "$root" || echo "$root/$OLD")
    variants=$([ $side = new ] && echo "${VARIANTS:-base}" || echo base)
    log=$OUT/step_ab_${side}_$round
    (cd "$dir" && NINFER_BUILD_DIR=/tmp/nb-$side timeout ${AB_S:-200} python3 -m $(tools "$dir").step_ab \
      --variants "$variants" --context ${CONTEXT:-1053} --max-context ${MAX_CONTEXT:-32832} --json $log.json 2>&1 \
      | tr '\r' '\n' | grep -v "it/s\]" | grep -v "kernel/s" > $log.log)
    echo "step_ab $side round $round: rc $?"; tail -${AB_TAIL:-3} $log.log
  done
done
