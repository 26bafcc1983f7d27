#!/usr/bin/env bash
# One GPU session's checks, in one call (device time is scarce): the shipped model through the
# public API on the GPU, the GPU test tier, and the kernel lab. Logs and JSON go to $OUT.
# Run from the repository root on the GPU machine:  bash lab/gpu_check.sh
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 NINFER_BUILD_DIR=/tmp/ninfer-build
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 60 python3 -m ninfer_gen.cli run --prompt "def fibonacci(n):" --max-tokens 48 2>&1 | tee $OUT/run.log
timeout ${EVAL_S:-150} python3 -m tools.eval_small --json $OUT/eval_small.json 2>&1 | grep -v "it/s" | tail -3
timeout ${GPU_TESTS_S:-270} python3 -m pytest -m gpu tests/gpu -q -rf -p no:cacheprovider 2>&1 \
  | tee $OUT/gpu_tests.log | tail -40
timeout ${LAB_S:-150} python3 -m lab.kernel_lab --out $OUT/kernel_lab.json 2>&1 | tee $OUT/kernel_lab.log | tail -70
