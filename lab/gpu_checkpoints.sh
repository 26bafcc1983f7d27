#!/usr/bin/env bash
# Full-size checkpoints in one device call (issue 23): the GPU loaders against the CPU ones (GPU tests),
# then lab/checkpoint_bench.py on a synthetic HF checkpoint of SPEC — cold dd of its shards, the streaming
# load from HF layout, `convert`, the container's load with and without hash checks, host RSS growth of
# each against (largest tensor + 1 GiB), planes and greedy tokens of the two loads compared.
# Run from the repository root on the GPU machine:  bash lab/gpu_checkpoints.sh   (JSON and logs to $OUT)
# Variables: SPEC (default lab/qwen3.8-9b.yaml: 18.4 GB bf16 + 5.9 GB converted, fits the 64 GiB disk;
# model_specs/qwen3.8-27b.yaml needs NO_CONVERT=1 there), WORK (scratch folder for the checkpoint, never
# under $OUT; default /tmp/ninfer-ckpt), KEEP=1 keeps it, NO_CONVERT=1, TOKENS (default 8), PY (python3).
# CPU dry run of the same steps: OUT=/tmp/o SPEC=model_specs/qwen3.8-tiny.yaml bash lab/gpu_checkpoints.sh
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. NINFER_BUILD_DIR=${NINFER_BUILD_DIR:-/tmp/ninfer-build}
PY=${PY:-python3}
SPEC=${SPEC:-lab/qwen3.8-9b.yaml}
WORK=${WORK:-/tmp/ninfer-ckpt}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU: CPU run"
df -h "$(dirname "$WORK")" | tail -1
free -g | head -2
timeout ${TESTS_S:-75} $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_checkpoint_stream.py -rs \
  2>&1 | tee $OUT/quantiser_tests.log | tail -5
extra=""
[ "${NO_CONVERT:-0}" = 1 ] && extra="--no-convert"
timeout ${BENCH_S:-500} $PY -m lab.checkpoint_bench --spec "$SPEC" --work "$WORK" --json $OUT/checkpoints.json \
  --tokens ${TOKENS:-8} $extra 2>&1 | grep -v "it/s\]\|B/s\]" | tee $OUT/checkpoints.log | tail -25
rc=${PIPESTATUS[0]}
[ "${KEEP:-0}" = 1 ] || rm -rf "$WORK"
echo "checkpoint_bench exit $rc"
exit $rc
