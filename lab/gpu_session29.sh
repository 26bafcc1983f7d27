#!/usr/bin/env bash
# Session 29's device calls (logs to $OUT as it goes; a call brings back at most 8 files). Results in
# lab/results/s29_*, the account in lab/NOTES.md (session 29).
# PART=sl: issue 34 — `ssq_late` shipped (the norm's tile sums in unit S − 1's cp.async group on every staged k-quant
#   key with scale_in: gemv_config.fold_config): its same-bits cases, the GGUF step with it (base) and without it
#   (`ssq_late=0`, a rule that reaches the folded keys since 09f8294), the Q4G64 step beside them (issue 34's line);
#   then, if the step gained (SL_KEEP_US µs or more), the GPU tier and the k-quant module on the shipped kernels.
# PART=long: issue 31's figures (lab/gpu_session25.sh PART=long), on an H200 if one is lent.
source lab/gpu_script_env.sh
eval "$(sed -n '/^gguf_ab() {/,/^}/p' lab/gpu_session25.sh)"
eval "$(sed -n '/^q4g64_beside() {/,/^}/p' lab/gpu_session26.sh)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
G=/tmp/qwen3.8-27b-q4_k_m.gguf
step_us() { python3 -c "import json,sys; print(round(1e3 * json.load(open(sys.argv[1]))['decode']['step_replay_ms']))" "$1"; }
if part sl; then
  [ -f $G ] || { timeout 300 python3 -m tools.synth_gguf $G --device cuda > /dev/null 2>&1; echo "GGUF write: rc $?"; }
  stamp "GGUF ready"
  timeout 60 python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "ssq_late" -q -rf -p no:cacheprovider \
    > $OUT/sl_tests.log 2>&1; echo "ssq_late tests: rc $?"; shown $OUT/sl_tests.log 2; stamp "sl tests done"
  gguf_ab sl "base|ssq_late=0"; stamp "sl step done"
  q4g64_beside sl; stamp "q4g64 done"
  with=$(step_us $OUT/bench_sl_ab0.json); without=$(step_us $OUT/bench_sl_ab1.json)
  echo "GGUF step: ssq_late ${with} µs, without ${without} µs"
  if [ $((without - with)) -ge ${SL_KEEP_US:-30} ]; then
    TESTS_S=200 PART=tests bash lab/gpu_session14.sh | tail -4; stamp "tier done"
    timeout 170 python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "not stream_k" -q -rf -p no:cacheprovider \
      > $OUT/kq_tests.log 2>&1; echo "k-quant tests: rc $?"; shown $OUT/kq_tests.log 3; stamp "k-quant tests done"
  fi
fi
if part long; then
  PART=long bash lab/gpu_session25.sh; stamp "long done"
fi
