#!/usr/bin/env bash
# Device calls for the speculative round (issue 20). SPEC=1: the speculative GPU tests (lossless in every
# round mode and with the reduced draft vocabulary, truncation, the transaction in both designs, the
# sampling distribution). BENCH=1: the 27B bench with K drafts and --accept-prob three times — ReplaySSM
# with the full MTP head (fused, eager and host-driven rounds), with a 32,768-id draft head, and in the
# snapshot design (VARIANTS='name::flags|…' picks others). FULL=1: the rest of the GPU tier. Logs and JSON to $OUT.
# Run from the repository root on the GPU machine:  SPEC=1 bash lab/gpu_rounds.sh
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. NINFER_BUILD_DIR=${NINFER_BUILD_DIR:-/tmp/ninfer-build}
shown() { tr '\r' '\n' < "$1" | grep -v "it/s\]" | grep -v "kernel/s" | grep -v "^\s*$" | tail -"$2"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${SPEC:-0}" = 1 ]; then
  timeout ${SPEC_S:-500} python3 -m pytest -m gpu tests/gpu/test_speculative_gpu.py -q -s -rf -p no:cacheprovider \
    ${SPEC_K:+-k "$SPEC_K"} > $OUT/spec_tests.log 2>&1
  echo "speculative tests: rc $?"; grep -E "K=|top_k|passed|failed|FAILED|Error|error" $OUT/spec_tests.log | tail -${SPEC_TAIL:-60}
fi
if [ "${BENCH:-0}" = 1 ]; then
  IFS='|' read -ra variants <<< "${VARIANTS:-replayssm::|vocab::--draft-vocab 32768|snapshot::--state-mode snapshot}"
  for variant in "${variants[@]}"; do
    name=${variant%%::*}; extra=${variant#*::}
    timeout ${BENCH_S:-150} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --draft ${K:-3} \
      --accept-prob ${P:-0.8} --prefill '' --output-tokens 256 --repeats 1 $extra \
      --json $OUT/bench_$name.json > $OUT/bench_$name.log 2>&1
    echo "bench $name: rc $?"; shown $OUT/bench_$name.log ${BENCH_TAIL:-22}
  done
fi
if [ "${FULL:-0}" = 1 ]; then
  timeout ${TESTS_S:-300} python3 -m pytest -m gpu tests/gpu -q -s -rf -p no:cacheprovider \
    --deselect tests/gpu/test_speculative_gpu.py > $OUT/gpu_tests.log 2>&1
  echo "gpu tier (without the speculative file): rc $?"; grep -E "passed|failed|FAILED" $OUT/gpu_tests.log | tail -12
fi
