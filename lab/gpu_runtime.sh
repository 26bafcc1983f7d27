#!/usr/bin/env bash
# Runtime checks in one device call: GPU tests (TESTS=…, default the runtime's), then the 27B bench
# (BENCH_ARGS=… adds options, e.g. --hf-json lab/results/hf_baseline_h200_2026-11-29.json).
# Run from the repository root on the GPU machine:  bash lab/gpu_runtime.sh   (logs to $OUT)
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 NINFER_BUILD_DIR=${NINFER_BUILD_DIR:-/tmp/ninfer-build}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout ${RT_TESTS_S:-240} python3 -m pytest -m gpu ${TESTS:-tests/gpu/test_runtime_gpu.py} -q -s -rf -p no:cacheprovider \
  2>&1 | tee $OUT/runtime_tests.log | grep -v "^$" | tail -${RT_TAIL:-30}
timeout ${BENCH_S:-240} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml ${BENCH_ARGS:-} \
  --json $OUT/bench.json 2>&1 | grep -v "it/s\]" | tee $OUT/bench.log | tail -${BENCH_TAIL:-25}
