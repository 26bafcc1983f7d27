#!/usr/bin/env bash
# Same-session A/B of this tree against another checkout of the project (OLD=dir, e.g. the last commit
# unpacked with `git archive HEAD compiler templates ninfer_gen lab model_specs tests | tar -x -C
# build/old_tree`, carried to the device): the GPU tier on this tree, then in both trees the decode
# GEMVs in the kernel lab (`--only gemv`, chained launches) and the decode step (lab/step_ab.py; this
# tree's with VARIANTS, '|'-separated NINFER_GEMV overrides, the first `base`). Logs to $OUT.
# Run from the repository root on the GPU machine:  OLD=build/old_tree bash lab/gpu_tree_ab.sh
set -uo pipefail
: "${OUT:?set OUT}" "${OLD:?set OLD to the other tree}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
root=$(pwd)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
NINFER_BUILD_DIR=/tmp/nb-new timeout ${TESTS_S:-240} python3 -m pytest -m gpu tests/gpu -q -rf -p no:cacheprovider \
  2>&1 | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|error" | tail -12
for side in new old; do
  dir=$([ $side = new ] && echo "$root" || echo "$root/$OLD")
  (cd "$dir" && NINFER_BUILD_DIR=/tmp/nb-$side timeout ${LAB_S:-150} python3 -m lab.kernel_lab --only gemv \
    --out $OUT/lab_$side.json 2>&1 | grep -v "it/s\]" > $OUT/lab_$side.log)
  echo "lab $side: rc $?"; grep -E "^(gemv|device)" $OUT/lab_$side.log | awk '{print $1, $2, $(NF-1), $NF}'
done
for side in old new; do
  dir=$([ $side = new ] && echo "$root" || echo "$root/$OLD")
  variants=$([ $side = new ] && echo "${VARIANTS:-base}" || echo base)
  (cd "$dir" && NINFER_BUILD_DIR=/tmp/nb-$side timeout ${AB_S:-200} python3 -m lab.step_ab --variants "$variants" \
    --omission "${OMISSION:-0}" --json $OUT/step_ab_$side.json 2>&1 | grep -v "it/s\]" | grep -v "kernel/s" \
    > $OUT/step_ab_$side.log)
  echo "step_ab $side: rc $?"; tail -${AB_TAIL:-14} $OUT/step_ab_$side.log
done
