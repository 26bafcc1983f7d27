#!/usr/bin/env bash
# Decode-step variants of the 27B shape, in one device call: the GPU tests of the unshipped variants
# (TESTS_K=…, default the biased and self-normalising GEMVs and the norm fold's runtime check), then
# bench/step_ab.py over VARIANTS ('|'-separated, the first the baseline; see its docstring) with the
# omission profile of OMISSION (indices). Logs to $OUT.
# Run from the repository root on the GPU machine:  bash bench/gpu_step_ab.sh
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. NINFER_BUILD_DIR=${NINFER_BUILD_DIR:-/tmp/ninfer-build}
# Default: the norm fold and biased codes (NOTES.md 2026-12-01 session 2), then the down projection's
# block structure (8 or 16 warps splitting K inside the block instead of 4 warps × 6 slices),
# deeper register batches (depth 8) and two register batches in flight (pipeline).
VARIANTS=${VARIANTS:-"base|NINFER_NORM_INTO_GEMV=1|biased=1|NINFER_NORM_INTO_GEMV=1 biased=1|5120x17408:biased=1|34816x5120:biased=1|5120x6144:biased=1;6144x5120:biased=1|5120x17408:warps=8,splits=3|5120x17408:warps=8,splits=6|5120x17408:warps=16,splits=2|5120x17408:depth=8|34816x5120:depth=8|5120x6144:depth=8|5120x17408:pipeline=1|5120x17408:pipeline=1,prefetch=0|34816x5120:pipeline=1,interleave=0|5120x6144:pipeline=1,interleave=0;6144x5120:pipeline=1,interleave=0"}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout ${TESTS_S:-240} python3 -m pytest -m gpu tests/gpu -q -k "${TESTS_K:-bz or rn or norm}" -p no:cacheprovider \
  2>&1 | tee $OUT/variant_tests.log | tail -5
timeout ${AB_S:-350} python3 -m bench.step_ab --variants "$VARIANTS" --omission "${OMISSION:-0,1}" --json $OUT/step_ab.json \
  2>&1 | grep -v "it/s\]" | grep -v "kernel/s" | tee $OUT/step_ab.log | tail -16
