#!/usr/bin/env bash
# Session 28's device calls (logs to $OUT as it goes; a call brings back at most 8 files). Results in
# lab/results/s28_*, the account in lab/NOTES.md (session 28).
# Ran (H100): PART=px on e20333c…a615942 and PART=xa on ec84068 — their keys (`prefetch_x`, `x_ahead`) were refuted
#   and removed, so rerunning them needs those commits; PART=tier on the final kernels.
# Ready, not run (the device budget ran out): PART=sl; PART=gate (prepared in session 27; the `gguf_step` lab of the
#   px call already answered its question: the gate/up's step time is its own key's, norm fold included).
# PART=px: issue 34 — activations asked of L1 ahead of their loads (key `prefetch_x`: the Q6_K down projection's
#   first-HMMA wait on x, 31.5 % of its PC samples): the same-bits cases, the `gguf_step` lab with and without it,
#   the GGUF step under each rule and the Q4G64 step beside it (issue 34's line); beside them, three stages for the
#   Q4_K output projection alone (6 units a warp at under a wave: ~1 unit in flight a warp).
# PART=xa: issue 34 — the next unit's activations loaded into registers while this unit computes (key `x_ahead`,
#   the first XA mma steps of a unit): the same-bits and stream-K cases, the GGUF step under two rule sets, the Q4G64
#   step beside it (issue 34's line), then the `gguf_step` lab under the first.
# PART=sl: issue 34 — the norm's tile sums in unit 1's cp.async group (key `ssq_late`): its same-bits cases, then the
#   GGUF step without and with it.
# PART=tier: the GPU tier, then the k-quant module but its stream-K cases.
# PART=gate: issue 34 — the stream-K cases, the `gguf_step` lab, Nsight Compute on the gate/up launched inside the
#   replayed graph (`--graph-profiling node`, sections + PC sampling summed by lab/ncu_stalls.py), both steps'
#   timelines.
source lab/gpu_script_env.sh
eval "$(sed -n '/^gguf_ab() {/,/^}/p' lab/gpu_session25.sh)"
eval "$(sed -n '/^q4g64_beside() {/,/^}/p' lab/gpu_session26.sh)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
G=/tmp/qwen3.8-27b-q4_k_m.gguf
PXRULES=${PXRULES:-"base|prefetch_x=1|prefetch_x=2|q4_k/5120x6144:stage_w=3"}
if part px; then
  [ -f $G ] || { timeout 300 python3 -m tools.synth_gguf $G --device cuda > /dev/null 2>&1; echo "GGUF write: rc $?"; }
  stamp "GGUF ready"
  timeout 150 python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "prefetch_x or stream_k" -q -rf -p no:cacheprovider \
    > $OUT/px_tests.log 2>&1; echo "prefetch_x tests: rc $?"; shown $OUT/px_tests.log 3; stamp "px tests done"
  timeout 200 python3 -m lab.kernel_lab --only gguf_step --ms 1 --gemv-variant prefetch_x=1 \
    --gemv-variant prefetch_x=2 --gemv-variant stage_w=3 --out /tmp/px_lab.json > $OUT/px_lab.log 2>&1
  echo "gguf_step lab: rc $?"; grep -a "Σ" $OUT/px_lab.log; stamp "px lab done"
  gguf_ab px "$PXRULES"; stamp "px step done"
  q4g64_beside px; stamp "px done"
fi
XA1=${XA1:-"q6_k:x_ahead=8;q4_k:x_ahead=2"}
if part xa; then
  [ -f $G ] || { timeout 300 python3 -m tools.synth_gguf $G --device cuda > /dev/null 2>&1; echo "GGUF write: rc $?"; }
  stamp "GGUF ready"
  timeout 150 python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "x_ahead or stream_k" -q -rf \
    -p no:cacheprovider > $OUT/xa_tests.log 2>&1; echo "x_ahead, stream-K tests: rc $?"; shown $OUT/xa_tests.log 3
  stamp "xa tests done"
  gguf_ab xa "base|$XA1|q6_k:x_ahead=8"; stamp "xa step done"
  q4g64_beside xa; stamp "q4g64 done"
  timeout 100 python3 -m lab.kernel_lab --only gguf_step --ms 1 --gemv-variant "$XA1" \
    --out /tmp/xa_lab.json > $OUT/xa_lab.log 2>&1
  echo "gguf_step lab: rc $?"; grep -a "Σ" $OUT/xa_lab.log; stamp "xa done"
fi
if part gate; then
  [ -f $G ] || { timeout 300 python3 -m tools.synth_gguf $G --device cuda > /dev/null 2>&1; echo "GGUF write: rc $?"; }
  timeout 120 python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "stream_k" -q -rf -p no:cacheprovider \
    > $OUT/sk_tests.log 2>&1; echo "stream-K tests: rc $?"; shown $OUT/sk_tests.log 3; stamp "sk tests done"
  timeout 150 python3 -m lab.kernel_lab --only gguf_step --ms 1 --out /tmp/gs_lab.json > $OUT/gguf_step_lab.log 2>&1
  echo "gguf_step lab: rc $?"; grep -a "^gemv_\|copy\|Σ" $OUT/gguf_step_lab.log | tail -24; stamp "gguf_step lab done"
  timeout 200 ncu --graph-profiling node --clock-control none --kernel-name regex:gemv_q4_k_n34816 --launch-skip 8 \
    --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section SourceCounters \
    -f -o /tmp/gu_step python3 -m lab.step_timeline --weights $G --max-context 32832 --replays 2 > /tmp/gu_step.log 2>&1
  echo "ncu gate/up in the step: rc $?"
  ncu -i /tmp/gu_step.ncu-rep --page details > $OUT/gu_step_ncu.txt 2>&1
  ncu -i /tmp/gu_step.ncu-rep --page source --csv --print-source sass > /tmp/gu_step.csv 2>/dev/null
  python3 -m lab.ncu_stalls /tmp/gu_step.csv --top 30 >> $OUT/gu_step_ncu.txt 2>&1
  grep -a "Duration\|DRAM Throughput\|Achieved Active\|Registers Per\|by opcode\|by reason" $OUT/gu_step_ncu.txt | head
  stamp "ncu step gate/up done"
  for w in gguf q4g64; do
    timeout 150 python3 -m lab.step_timeline --max-context 32832 $([ $w = gguf ] && echo --weights $G) \
      --json $OUT/tl_$w.json > $OUT/tl_$w.log 2>&1; echo "timeline $w: rc $?"; shown $OUT/tl_$w.log 8
  done
  stamp "gate done"
fi
if part sl; then                     # the rows' tile sums in unit 1's copy group (key ssq_late): same bits, then the step
  [ -f $G ] || { timeout 300 python3 -m tools.synth_gguf $G --device cuda > /dev/null 2>&1; echo "GGUF write: rc $?"; }
  timeout 60 python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "ssq_late" -q -rf -p no:cacheprovider \
    > $OUT/sl_tests.log 2>&1; echo "ssq_late tests: rc $?"; shown $OUT/sl_tests.log 2; stamp "sl tests done"
  gguf_ab sl "base|ssq_late=1"; stamp "sl done"
fi
if part tier; then                   # the final tree: the GPU tier, then the k-quant module but the stream-K cases (run
                                     # in PART=xa on the same kernels)
  TESTS_S=200 PART=tests bash lab/gpu_session14.sh | tail -4; stamp "tier done"
  timeout 170 python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "not stream_k" -q -rf -p no:cacheprovider \
    > $OUT/kq_tests.log 2>&1; echo "k-quant tests: rc $?"; shown $OUT/kq_tests.log 3; stamp "k-quant tests done"
fi
if part long; then                   # issue 31's figures, on an H200 if one is lent
  PART=long bash lab/gpu_session25.sh; stamp "long done"
fi
