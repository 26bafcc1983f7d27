#!/usr/bin/env bash
# Session 31's device calls (logs to $OUT as it goes; a call brings back at most 8 files). Results in
# lab/results/s31_*, the account in lab/NOTES.md (session 31). Ran (H100): lanes,c8; i32 (PS=0.8); i32,i31 (PS="0.5 0.2",
# ASESS=1); pf; adapt (PS=0.5, then 0.2).
# PART=lanes: the step's Q4_K / Q5_K GEMV keys on the lane-order unit layout (lab/kq_lanes.py, an experiment beside
#   tile order): each variant's bits against the shipped key on the same blocks, then chained µs and Σ launches × µs.
# PART=c8: lab/gpu_session30.sh's (the GGUF on the sm_86 path at C1 and C8).
source lab/gpu_script_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cohorts() {  # TAG P...: the cohort bench (C1, C8: fixed K = 3, adaptive, plain) at each accept probability, logs to $OUT/TAG.log
  local tag=$1 p; shift
  for p in "$@"; do
    timeout ${COHORT_S:-150} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --concurrency 1,8 \
      --draft 3 --accept-prob $p --draft-vocab 32768 --output-tokens ${TOKENS:-256} --adaptive \
      --json $OUT/${tag}_cohort_$p.json > /tmp/${tag}_cohort_$p.log 2>&1
    echo "cohort bench p=$p: rc $?" | tee -a $OUT/$tag.log; shown /tmp/${tag}_cohort_$p.log 24 | tee -a $OUT/$tag.log
    rm -f $OUT/${tag}_cohort_$p.png; stamp "$tag $p done"
  done
}
if part lanes; then
  timeout ${LANES_S:-240} python3 -m lab.kq_lanes --out $OUT/lanes.json > $OUT/lanes.log 2>&1
  echo "kq_lanes: rc $?"; shown $OUT/lanes.log 40; stamp "lanes done"
fi
if part c8; then
  PART=c8 bash lab/gpu_session30.sh
fi
# PART=pf: L2 prefetches of whole row tiles on the shipped staged k-quant keys (the next block's tile, its own).
if part pf; then
  timeout ${PF_S:-200} python3 -m lab.kq_lanes --pf --out $OUT/pf.json > $OUT/pf.log 2>&1
  echo "kq_lanes --pf: rc $?"; shown $OUT/pf.log 60; stamp "pf done"
fi
# PART=i32: issue 32's lines on the current tree, one call — the Q4G64 27B's C1 bench (plain fraction of the read
#   ceiling, launches, MTP3 round / step, every K: --per-k), the sm_86 path's plain step, then the cohort bench (C1 and
#   C8: fixed K = 3, adaptive, plain) at each accept probability in PS. ≤ 8 files: one log, the JSONs.
if part i32; then
  timeout ${C1_S:-150} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --draft 3 --accept-prob 0.8 \
    --draft-vocab 32768 --output-tokens 512 --repeats 1 --prefill '' --per-k --json $OUT/i32_c1.json > /tmp/i32_c1.log 2>&1
  echo "C1 bench: rc $?" | tee -a $OUT/i32.log; shown /tmp/i32_c1.log 40 | tee -a $OUT/i32.log; stamp "c1 done"
  timeout ${ARCH_S:-120} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --arch-path sm_86 \
    --output-tokens 256 --repeats 1 --prefill '' --json $OUT/i32_sm86.json > /tmp/i32_sm86.log 2>&1
  echo "sm_86 bench: rc $?" | tee -a $OUT/i32.log; shown /tmp/i32_sm86.log 20 | tee -a $OUT/i32.log; stamp "sm86 done"
  cohorts i32 ${PS:-0.8 0.5 0.2}
fi
# PART=i31: issue 31's lines on the current tree — the long-context GPU tests (lossless at 100K, the refusals), the 27B
#   bench at 1K / 32K / 128K (plain, MTP3, TTFT, peak), the attention lab at 32K / 128K, the agent bench (32K context,
#   8 turns, 1 and 4 sessions) at accept 0.8 and 0.3.
if part i31; then
  timeout ${LONGT_S:-120} python3 -m pytest -m gpu tests/gpu/test_long_context_gpu.py -q -s -rf -p no:cacheprovider \
    > /tmp/i31_tests.log 2>&1; echo "long tests: rc $?" | tee -a $OUT/i31.log; shown /tmp/i31_tests.log 12 | tee -a $OUT/i31.log
  stamp "long tests done"
  timeout ${LONG_S:-200} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --long-context --draft 3 \
    --accept-prob 0.8 --json $OUT/i31_long.json > /tmp/i31_long.log 2>&1
  echo "long bench: rc $?" | tee -a $OUT/i31.log; shown /tmp/i31_long.log 30 | tee -a $OUT/i31.log; stamp "long bench done"
  timeout ${ATTN_S:-90} python3 -m lab.attn_long --contexts 32768,131072 --t 1 --out $OUT/i31_attn.json > /tmp/i31_attn.log 2>&1
  echo "attention lab: rc $?" | tee -a $OUT/i31.log; shown /tmp/i31_attn.log 8 | tee -a $OUT/i31.log; stamp "attn done"
  for p in ${APS:-0.8 0.3}; do
    timeout ${AGENT_S:-150} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --workload agent \
      --context-tokens 32768 --turns 8 --sessions ${ASESS:-1,4} --draft 3 --accept-prob $p --draft-vocab 32768 \
      --json $OUT/i31_agent_$p.json > /tmp/i31_agent_$p.log 2>&1
    echo "agent bench p=$p: rc $?" | tee -a $OUT/i31.log; shown /tmp/i31_agent_$p.log 30 | tee -a $OUT/i31.log
    rm -f $OUT/i31_agent_$p.png; stamp "agent $p done"
  done
fi
# PART=adapt: the adaptive draft length after its two fixes (the round cost measured on throwaway lanes through the
#   adapter; a drop only beyond z standard errors): the cohort bench, C1 and C8, fixed K / adaptive / plain, each p.
if part adapt; then
  cohorts adapt ${PS:-0.5 0.2 0.8}
fi
