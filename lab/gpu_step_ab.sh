#!/usr/bin/env bash
# Decode-step variants of the 27B shape, in one device call: the GPU bit tests of the decode GEMV's
# stream fields (TESTS_K=…), then lab/step_ab.py over VARIANTS ('|'-separated NINFER_GEMV overrides,
# the first the baseline; see its docstring) with the omission profile of OMISSION (indices). Logs to $OUT.
# Run from the repository root on the GPU machine:  VARIANTS="base|5120x17408:depth=8" bash lab/gpu_step_ab.sh
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. NINFER_BUILD_DIR=${NINFER_BUILD_DIR:-/tmp/ninfer-build}
VARIANTS=${VARIANTS:-"base|5120x17408:depth=8|5120x6144:min_blocks=3"}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout ${TESTS_S:-240} python3 -m pytest -m gpu tests/gpu -q -k "${TESTS_K:-stream_fields}" -p no:cacheprovider \
  2>&1 | tee $OUT/variant_tests.log | tail -5
timeout ${AB_S:-350} python3 -m lab.step_ab --variants "$VARIANTS" --omission "${OMISSION:-0}" --json $OUT/step_ab.json \
  2>&1 | grep -v "it/s\]" | grep -v "kernel/s" | tee $OUT/step_ab.log | tail -16
