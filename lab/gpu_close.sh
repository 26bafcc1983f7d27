#!/usr/bin/env bash
# One device call that closes a session: an optional last step A/B (VARIANTS: '|'-separated NINFER_GEMV
# overrides, the first `base`, at the bench's context and KV bucket), the whole GPU tier, HF
# transformers' baseline the same day, then the 27B bench against it. If a variant beats `base` by more
# than WIN (default 0.5 %), the bench runs with it exported as NINFER_GEMV (the rule it is to become
# must give the same plan: check on the CPU before committing it; an override applies to every M of its
# shape, so a register cap may make some bucket spill and the bench refuse — its rc and log say so).
# Raw logs and JSON to $OUT; what is shown has the progress bars' carriage returns turned into lines.
# Run from the repository root on the GPU machine:  VARIANTS="base|34816x5120:min_blocks=6" bash lab/gpu_close.sh
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. NINFER_BUILD_DIR=${NINFER_BUILD_DIR:-/tmp/ninfer-build}
shown() { tr '\r' '\n' < "$1" | grep -v "it/s\]" | grep -v "kernel/s" | grep -v "^\s*$" | tail -"$2"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
if [ -n "${VARIANTS:-}" ]; then
  timeout ${AB_S:-200} python3 -m lab.step_ab --context 1053 --max-context 32832 --variants "$VARIANTS" \
    --json $OUT/step_ab.json > $OUT/step_ab.log 2>&1
  echo "step_ab: rc $?"; shown $OUT/step_ab.log 12
  win=$(python3 - "$OUT/step_ab.json" "${WIN:-0.005}" <<'EOF'
import json, sys
v = json.load(open(sys.argv[1]))["variants"]
best = min(v, key=lambda k: v[k]["step_ms"])
print(best if best != "base" and v[best]["step_ms"] < (1 - float(sys.argv[2])) * v["base"]["step_ms"] else "")
EOF
)
  [ -n "$win" ] && export NINFER_GEMV="$win"
  echo "bench variant: ${win:-base}"
fi
NINFER_GEMV= timeout ${TESTS_S:-240} python3 -m pytest -m gpu tests/gpu -q -s -rf -p no:cacheprovider 2>&1 \
  | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|error" | tail -8
timeout ${HF_S:-240} python3 -m lab.hf_baseline --out $OUT/hf_baseline.json > $OUT/hf_baseline.log 2>&1
echo "hf_baseline: rc $?"; shown $OUT/hf_baseline.log 8
timeout ${BENCH_S:-260} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --hf-json $OUT/hf_baseline.json \
  --json $OUT/bench.json > $OUT/bench.log 2>&1
echo "bench: rc $?"; shown $OUT/bench.log ${BENCH_TAIL:-26}
