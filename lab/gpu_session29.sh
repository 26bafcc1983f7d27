#!/usr/bin/env bash
# Session 29's device calls (logs to $OUT as it goes; a call brings back at most 8 files). Results in
# lab/results/s29_*, the account in lab/NOTES.md (session 29).
# Ran (H100): PART=sl on 9007951 (`ssq_late` shipped; refuted: the step 7.058 → 7.048 ms, and reverted) — rerunning
#   it needs that commit.
# PART=gsk: issue 34 — the Q4_K gate/up (2,176 blocks: 4.1 waves of four an SM, 5 units a warp) as one or two
#   stream-K waves (rules `stream_k=528/1056,min_blocks=4`): its batch-invariance and stream-K cases, the GGUF step
#   under each rule, the Q4G64 step beside them (issue 34's line), the `gguf_step` lab under the first.
# PART=long: issue 31's figures (lab/gpu_session25.sh PART=long), on an H200 if one is lent.
source lab/gpu_script_env.sh
eval "$(sed -n '/^gguf_ab() {/,/^}/p' lab/gpu_session25.sh)"
eval "$(sed -n '/^q4g64_beside() {/,/^}/p' lab/gpu_session26.sh)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
G=/tmp/qwen3.8-27b-q4_k_m.gguf
GSK1=${GSK1:-"q4_k/34816x5120:stream_k=528,min_blocks=4"}
GSK2=${GSK2:-"q4_k/34816x5120:stream_k=1056,min_blocks=4"}
if part gsk; then
  [ -f $G ] || { timeout 300 python3 -m tools.synth_gguf $G --device cuda > /dev/null 2>&1; echo "GGUF write: rc $?"; }
  stamp "GGUF ready"
  timeout 100 python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "stream_k and 34816" -q -rf -p no:cacheprovider \
    > $OUT/gsk_tests.log 2>&1; echo "gate/up stream-K tests: rc $?"; shown $OUT/gsk_tests.log 3; stamp "gsk tests done"
  gguf_ab gsk "base|$GSK1|$GSK2"; stamp "gsk step done"
  q4g64_beside gsk; stamp "q4g64 done"
  timeout 150 python3 -m lab.kernel_lab --only gguf_step --ms 1 --gemv-variant "$GSK1" --out /tmp/gsk_lab.json \
    > $OUT/gsk_lab.log 2>&1; echo "gguf_step lab: rc $?"; grep -a "34816\|Σ" $OUT/gsk_lab.log | tail -6; stamp "gsk done"
fi
if part long; then
  PART=long bash lab/gpu_session25.sh; stamp "long done"
fi
