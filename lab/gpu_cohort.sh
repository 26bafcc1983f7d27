#!/usr/bin/env bash
# Device calls for the cohort engine (issue 21). TESTS=1: the cohort and server GPU tests (tests/gpu/test_cohort_gpu.py, test_serve_gpu.py).
# REUSE=1: lab/prefix_reuse.py on the GPU (the small model's 8K two-turn conversation, TTFT with and without reuse).
# FIGURES=1: lab/cohort_gpu.py on the 27B (random weights): TTFT of first vs repeated requests after start-up,
# peak memory of C8 with a shared 16K KV pool and with 16K per lane, the C8 x 32K refusal.
# BENCH=1: `ninfer-gen bench --concurrency 1,2,4,8` on the 27B with --accept-prob (CONC, TOKENS, P).
# LONG=1: `ninfer-gen bench --long-prompt` on the 27B: a 32K-token prompt arrives while 7 lanes decode (P, BUDGET:
# the prefill tokens per step, default the chunk).
# AGENT=1: `ninfer-gen bench --workload agent` on the 27B (SESSIONS, TURNS, P), with and without prefix reuse.
# Logs and JSON to $OUT. Run from the repository root on the GPU machine:  TESTS=1 bash lab/gpu_cohort.sh
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. NINFER_BUILD_DIR=${NINFER_BUILD_DIR:-/tmp/ninfer-build}
shown() { tr '\r' '\n' < "$1" | grep -v "it/s\]" | grep -v "kernel/s" | grep -v "^\s*$" | tail -"$2"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# the server's and the grammar's packages, when the machine lacks them: wheels carried in build/wheels (no network)
for m in llguidance fastapi uvicorn openai anthropic httpx; do
  python3 -c "import $m" 2>/dev/null || python3 -m pip install -q --no-index --find-links build/wheels $m 2>&1 | tail -1
done
if [ "${TESTS:-0}" = 1 ]; then
  timeout ${TESTS_S:-300} python3 -m pytest -m gpu tests/gpu/test_cohort_gpu.py tests/gpu/test_serve_gpu.py -q -s -rf -p no:cacheprovider \
    > $OUT/cohort_tests.log 2>&1
  rc=$?; echo "cohort tests: rc $rc"; shown $OUT/cohort_tests.log ${TESTS_TAIL:-40}
  [ $rc = 0 ] || exit $rc              # the figures need working lanes
fi
if [ "${REUSE:-0}" = 1 ]; then        # prefix reuse: the 8K two-turn conversation on the small model, TTFT with/without
  timeout ${REUSE_S:-120} python3 -m lab.prefix_reuse --backend gpu > $OUT/prefix_reuse.log 2>&1
  echo "prefix reuse: rc $?"; shown $OUT/prefix_reuse.log 6
fi
if [ "${FIGURES:-0}" = 1 ]; then
  timeout ${FIGURES_S:-400} python3 -m lab.cohort_gpu --json $OUT/cohort_gpu.json > $OUT/cohort_gpu.log 2>&1
  echo "cohort figures: rc $?"; shown $OUT/cohort_gpu.log ${FIGURES_TAIL:-30}
fi
if [ "${BENCH:-0}" = 1 ]; then
  timeout ${BENCH_S:-400} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --concurrency ${CONC:-1,2,4,8} \
    --draft 3 --accept-prob ${P:-0.8} --output-tokens ${TOKENS:-256} --json $OUT/bench_cohort.json \
    > $OUT/bench_cohort.log 2>&1
  echo "cohort bench: rc $?"; shown $OUT/bench_cohort.log ${BENCH_TAIL:-30}
fi
if [ "${LONG:-0}" = 1 ]; then
  timeout ${LONG_S:-300} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --long-prompt ${LONG_N:-32768} \
    --running-lanes 7 --draft 3 --accept-prob ${P:-0.8} ${BUDGET:+--prefill-budget $BUDGET} \
    --json $OUT/bench_long${BUDGET:+_$BUDGET}.json > $OUT/bench_long${BUDGET:+_$BUDGET}.log 2>&1
  echo "long-prompt bench: rc $?"; shown $OUT/bench_long${BUDGET:+_$BUDGET}.log ${LONG_TAIL:-16}
fi
if [ "${AGENT:-0}" = 1 ]; then
  timeout ${AGENT_S:-400} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --workload agent \
    --sessions ${SESSIONS:-1,4,8} --turns ${TURNS:-4} --draft 3 --accept-prob ${P:-0.8} --json $OUT/bench_agent.json \
    > $OUT/bench_agent.log 2>&1
  echo "agent bench: rc $?"; shown $OUT/bench_agent.log ${AGENT_TAIL:-24}
fi
