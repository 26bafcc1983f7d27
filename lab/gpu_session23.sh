#!/usr/bin/env bash
# Session 23's device calls (issue 31): the keys-split decode attention (templates/attn_decode_keys.cu.j2, shipped on
# sm_90) — call 1 (PART=keys): its kernel tests (reference, decode = verify bits, the ring's bits), the long-context
# lab with the ring timed beside it, then the engine's tests that run it (greedy with drafts = plain greedy after
# 40K / 100K-token prompts, speculative greedy and lossless); call 2 (PART=bench): the cohort bench (C1 / C8) and the
# long-context bench on the same tree. Logs to $OUT as it goes; lab/gpu_session14.sh does the parts it names.
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site NINFER_BUILD_DIR=${NINFER_BUILD_DIR:-/tmp/ninfer-build}
part() { [ -z "${PART:-}" ] || [[ ",$PART," == *",$1,"* ]]; }
source lab/device_wheels.sh
shown() { tr '\r' '\n' < "$1" | grep -v "it/s\]" | grep -v "kernel/s" | grep -v "^\s*$" | tail -"$2"; }
if part keys; then
  PART=attn ATTNT_S=${ATTNT_S:-200} ATTNL_S=${ATTNL_S:-150} ACTX=${ACTX:-4096,32768,131072} ASPLITS=66 AVAR=ring \
    bash lab/gpu_session14.sh
  timeout ${ENGT_S:-200} python3 -m pytest -m gpu tests/gpu/test_long_context_gpu.py tests/gpu/test_speculative_gpu.py \
    -k "not attn_decode and not attn_combine and not rope_kv and not attn_prefill" -v -rf -p no:cacheprovider \
    --durations=8 > $OUT/engine_tests.log 2>&1
  echo "engine tests: rc $?"; grep -a "PASSED\|FAILED\|ERROR" $OUT/engine_tests.log | sed 's/ *\[ *[0-9]*%\]//' | tail -30
  shown $OUT/engine_tests.log 12
fi
if part bench; then
  PART=cohortab CAB=base COHORT_S=${COHORT_S:-200} bash lab/gpu_session14.sh
  timeout ${LONG_S:-300} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --long-context --draft 3 \
    --accept-prob 0.8 --json $OUT/bench_long.json > $OUT/bench_long.log 2>&1; echo "long bench: rc $?"; shown $OUT/bench_long.log 30
fi
