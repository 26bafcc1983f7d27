#!/usr/bin/env bash
# One device call for a session's closing figures: the whole GPU tier, Nsight Compute on the decode
# GEMVs (lab/gemv_ncu.py, one report per shape), then the 27B bench. Logs to $OUT.
# Run from the repository root on the GPU machine:  bash lab/gpu_session.sh
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. NINFER_BUILD_DIR=${NINFER_BUILD_DIR:-/tmp/ninfer-build}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout ${TESTS_S:-240} python3 -m pytest -m gpu tests/gpu -q -rf -p no:cacheprovider 2>&1 \
  | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|error" | tail -12
for shape in ${NCU_SHAPES:-q5g64:5120x17408:residual q4g64:34816x5120:silu_mul q5g64:5120x6144:residual}; do
  timeout ${NCU_S:-90} ncu --clock-control none --kernel-name regex:gemv --launch-skip 4 --launch-count 1 \
    --set full --import-source no python3 -m lab.gemv_ncu --shapes $shape >> $OUT/ncu.txt 2>&1
  echo "ncu $shape: rc $?"
done
timeout ${BENCH_S:-260} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml ${BENCH_ARGS:-} \
  --json $OUT/bench.json 2>&1 | grep -v "it/s\]" | tee $OUT/bench.log | tail -${BENCH_TAIL:-30}
