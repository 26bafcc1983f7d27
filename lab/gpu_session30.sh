#!/usr/bin/env bash
# Session 30's device calls (logs to $OUT as it goes; a call brings back at most 8 files). Results in
# lab/results/s30_*, the account in lab/NOTES.md (session 30).
# Ran (H100) on d231bd3: lab/gpu_session29.sh PART=w1 (the Q4_K gate/up in one- and two-warp blocks: refuted) and
#   PART=arch (the 3090's kernels beside sm_90: Q4G64 76.7 / 83.1 %, GGUF 64.4 / 76.3 %).
# PART=arch2: the two arch paths apart — `rtx3090` (the card's kernels exactly: grids for its 82 SMs, so on a 132-SM
#   GPU a one-wave stream-K grid leaves 50 SMs idle) and `sm_86` (the same arch's code, grids for this GPU's SMs) —
#   the plain step of the GGUF and of the Q4G64 27B on `sm_86`, the GGUF on `rtx3090` and both on the native path
#   (same call), then the GPU tier (its arch-path cases now on `rtx3090`), then MTP3 on the GGUF's sm_86 path.
# PART=c8: the GGUF on the sm_86 path at C1 and C8 (MTP3, adaptive K, plain; the cohort bench).
source lab/gpu_script_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
G=/tmp/qwen3.8-27b-q4_k_m.gguf
bench() {  # TAG WEIGHTS-ARGS... : one plain-decode bench, its figures shown, its JSON under $OUT
  local tag=$1; shift
  timeout 150 python3 -m ninfer_gen.cli bench "$@" --output-tokens 256 --repeats 1 --prefill '' \
    --json $OUT/bench_$tag.json > /tmp/bench_$tag.log 2>&1
  echo "$tag: rc $?" | tee -a $OUT/arch2.log
  grep -a "device\|decode step\|bandwidth eff\|launches" /tmp/bench_$tag.log | tee -a $OUT/arch2.log
  stamp "$tag done"
}
if part arch2; then
  [ -f $G ] || { timeout 300 python3 -m tools.synth_gguf $G --device cuda > /dev/null 2>&1; echo "GGUF write: rc $?"; }
  stamp "GGUF ready"
  bench gguf_sm86 --weights $G --arch-path sm_86
  bench q4g64_sm86 model_specs/qwen3.8-27b.yaml --no-vision --arch-path sm_86
  bench gguf_rtx3090 --weights $G --arch-path rtx3090
  bench gguf_native --weights $G
  bench q4g64_native model_specs/qwen3.8-27b.yaml --no-vision
  TESTS_S=200 PART=tests bash lab/gpu_session14.sh | tail -4; stamp "tier done"     # the arch-path cases on rtx3090
  bench gguf_sm86_mtp3 --weights $G --arch-path sm_86 --draft 3 --accept-prob 0.8 --draft-vocab 32768
  grep -a "per round\|tok/s\|plain" /tmp/bench_gguf_sm86_mtp3.log | tail -8
fi
if part c8; then      # a 3090 user's case on its code path: the GGUF at C1 and C8 with MTP3, adaptive K and plain
  [ -f $G ] || { timeout 300 python3 -m tools.synth_gguf $G --device cuda > /dev/null 2>&1; echo "GGUF write: rc $?"; }
  stamp "GGUF ready"
  timeout ${C8_S:-380} python3 -m ninfer_gen.cli bench --weights $G --arch-path ${C8_PATH:-sm_86} --concurrency 1,8 --draft 3 \
    --accept-prob 0.8 --draft-vocab 32768 --output-tokens 256 --adaptive --json $OUT/bench_gguf_c8.json \
    > $OUT/bench_gguf_c8.log 2>&1
  echo "GGUF C1/C8 cohort bench: rc $?"; shown $OUT/bench_gguf_c8.log 30; stamp "c8 done"
fi
