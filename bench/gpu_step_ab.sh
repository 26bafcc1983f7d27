#!/usr/bin/env bash
# Decode-GEMV variants in the 27B step, in one device call: the GPU kernel tests of the variant fields
# (TESTS_K=…, default the biased ones), then bench/step_ab.py over VARIANTS ('|'-separated NINFER_GEMV
# overrides, the first the baseline) with the omission profile of OMISSION (indices). Logs to $OUT.
# Run from the repository root on the GPU machine:  bash bench/gpu_step_ab.sh
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. NINFER_BUILD_DIR=${NINFER_BUILD_DIR:-/tmp/ninfer-build}
VARIANTS=${VARIANTS:-"base|biased=1|5120x17408:biased=1|34816x5120:biased=1|5120x6144:biased=1;6144x5120:biased=1|10240x5120:biased=1;12288x5120:biased=1"}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout ${TESTS_S:-200} python3 -m pytest -m gpu tests/gpu/test_kernels_gpu.py -q -k "${TESTS_K:-bz}" -p no:cacheprovider \
  2>&1 | tee $OUT/variant_tests.log | tail -5
timeout ${AB_S:-350} python3 -m bench.step_ab --variants "$VARIANTS" --omission "${OMISSION:-0,1}" --json $OUT/step_ab.json \
  2>&1 | grep -v "it/s\]" | grep -v "kernel/s" | tee $OUT/step_ab.log | tail -16
