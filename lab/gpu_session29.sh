#!/usr/bin/env bash
# Session 29's device calls (logs to $OUT as it goes; a call brings back at most 8 files). Results in
# lab/results/s29_*, the account in lab/NOTES.md (session 29).
# Ran (H100): PART=sl on 9007951 (`ssq_late` shipped; refuted: the step 7.058 → 7.048 ms, and reverted) — rerunning
#   it needs that commit.
# Ran (H100): PART=gsk on 7b07b9b — the Q4_K gate/up as one or two stream-K waves (rules `stream_k=528/1056,
#   min_blocks=4`); refuted in the kernel lab (38.9 → 42.0 µs chained). Its batch-invariance case spilled at M = 16 / 32
#   under the cap (the harness then failed every later case; the case was removed) and the rules' benches exited 2
#   (their logs stayed on the device).
# PART=h31: issue 31's end-to-end figures on an H200 (the long-context bench: plain and MTP3 at 1K / 32K / 128K,
#   TTFT at 8K / 32K / 128K, peak), then the attention decode at 32K / 128K against the read ceiling (lab.attn_long).
# PART=w1: issue 34 — the Q4_K gate/up in one-warp blocks (`warps=1`: a warp owns a 16-row tile's 20 units, no block
#   barrier or cross-warp sum; 112 registers at M = 1 under min_blocks 16: 18 blocks an SM, 2,376 ≥ 2,176 — one wave)
#   and in two-warp blocks (`warps=2`, min_blocks 8: 10 units a warp, 1.8 waves); the rules' batch-invariance cases,
#   the GGUF step under each, the Q4G64 step beside them.
# PART=arch: the 3090's code path (sm_86 PTX the driver JIT-compiles, no PDL) beside the sm_90 path in one call, for
#   the Q4G64 27B (issue 32: last measured in session 15) and the Q4_K_M GGUF (its sm_86 stream-K grids, never run);
#   then MTP3 on the GGUF (issue 34; last run in session 27).
# PART=long: issue 31's figures (lab/gpu_session25.sh PART=long), on an H200 if one is lent.
# (PART=arch ran in session 30 on d231bd3, where `--arch-path sm_86` was the rtx3090 card's kernels; since ba458bb
#   that is `--arch-path rtx3090`, and `sm_86` sizes the grids for the device: lab/gpu_session30.sh PART=arch2.)
source lab/gpu_script_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if part h31; then
  timeout 330 python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --long-context --draft 3 \
    --accept-prob 0.8 --json $OUT/bench_long.json > $OUT/bench_long.log 2>&1; echo "long bench: rc $?"
  shown $OUT/bench_long.log 30; stamp "long bench done"
  timeout 100 python3 -m lab.attn_long --contexts 32768,131072 --t 1 --out $OUT/attn_long.json > $OUT/attn_long.log 2>&1
  echo "attention lab: rc $?"; shown $OUT/attn_long.log 8; stamp "h31 done"
fi
G=/tmp/qwen3.8-27b-q4_k_m.gguf
W1=${W1:-"q4_k/34816x5120/m8:warps=1,min_blocks=16;q4_k/34816x5120:warps=1"}
W2=${W2-"q4_k/34816x5120/m8:warps=2,min_blocks=8;q4_k/34816x5120:warps=2"}
if part w1; then
  eval "$(sed -n '/^gguf_ab() {/,/^}/p' lab/gpu_session25.sh)"
  eval "$(sed -n '/^q4g64_beside() {/,/^}/p' lab/gpu_session26.sh)"
  [ -f $G ] || { timeout 300 python3 -m tools.synth_gguf $G --device cuda > /dev/null 2>&1; echo "GGUF write: rc $?"; }
  stamp "GGUF ready"
  timeout 60 python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "(invariance and silu_mul-warps) or fewer_warps" -q -rf \
    -p no:cacheprovider > $OUT/w1_tests.log 2>&1; echo "warps=1/2 tests: rc $?"; shown $OUT/w1_tests.log 3
  stamp "w1 tests done"
  gguf_ab w1 "base|$W1${W2:+|$W2}"; stamp "w1 step done"        # (W2= BESIDE=0: the short call)
  [ "${BESIDE:-1}" = 1 ] && { q4g64_beside w1; stamp "w1 done"; }
fi
if part arch; then
  for w in q4g64 gguf; do                # (in order of need: whatever finishes comes back if the call is cut)
    [ $w = gguf ] && [ ! -f $G ] && { timeout 300 python3 -m tools.synth_gguf $G --device cuda > /dev/null 2>&1
                                      echo "GGUF write: rc $?"; stamp "GGUF ready"; }
    for a in sm_86 sm_90; do
      timeout 150 python3 -m ninfer_gen.cli bench $([ $w = gguf ] && echo --weights $G || echo model_specs/qwen3.8-27b.yaml \
        --no-vision) $([ $a = sm_86 ] && echo --arch-path sm_86) --output-tokens 256 --repeats 1 --prefill '' --json $OUT/bench_${w}_$a.json \
        > /tmp/bench_${w}_$a.log 2>&1
      echo "$w $a plain: rc $?" | tee -a $OUT/arch.log
      grep -a "decode step (graph\|bandwidth eff\|copy\|launches" /tmp/bench_${w}_$a.log | tee -a $OUT/arch.log
      stamp "$w $a done"
    done
  done
  timeout 150 python3 -m ninfer_gen.cli bench --weights $G --draft 3 --accept-prob 0.8 --draft-vocab 32768 \
    --output-tokens 256 --repeats 1 --prefill '' --json $OUT/bench_gguf_mtp3.json > $OUT/bench_gguf_mtp3.log 2>&1
  echo "GGUF MTP3: rc $?"; shown $OUT/bench_gguf_mtp3.log 12; stamp "arch done"
fi
if part long; then
  PART=long bash lab/gpu_session25.sh; stamp "long done"
fi
