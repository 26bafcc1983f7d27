#!/usr/bin/env bash
# Session 27's device calls (logs to $OUT as it goes; a call brings back at most 8 files under $OUT). All ran once, on
# an H100, in the order below; results in lab/results/s27_*, the account in lab/NOTES.md (session 27).
# PART=src: issue 34 — where the k-quant GEMVs' warps wait, per SASS instruction: Nsight Compute's PC sampling
#   (SourceCounters) on the shipped Q6_K down projection, the Q4_K gate/up and the Q4_K output projection (M = 1),
#   summed by opcode / reason with lab/ncu_stalls.py; then the kernel lab's `q6lean` group at M = 1 (register caps).
source lab/gpu_script_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# ncu_src TAG SHAPE: the PC-sampled source page of SHAPE's shipped decode GEMV, its stalls summed ($OUT/src_TAG.txt)
ncu_src() {
  timeout ${NCU_S:-90} ncu --clock-control none --kernel-name regex:gemv --launch-skip 4 --launch-count 1 \
    --section SourceCounters --section WarpStateStats -f -o /tmp/src_$1 python3 -m lab.gemv_ncu --shapes $2 \
    > /tmp/src_$1.log 2>&1; echo "ncu $1 ($2): rc $?"
  ncu -i /tmp/src_$1.ncu-rep --page source --csv --print-source sass > /tmp/src_$1.csv 2> /tmp/src_$1.err
  python3 -m lab.ncu_stalls /tmp/src_$1.csv --top ${TOP:-45} > $OUT/src_$1.txt 2>&1
  [ "$1" = q6down ] && gzip -c /tmp/src_$1.csv > $OUT/src_$1.csv.gz
  head -4 $OUT/src_$1.txt; stamp "src $1 done"
}
if part src; then
  ncu_src q6down q6_k:5120x17408:residual
  ncu_src q4gu q4_k:34816x5120:silu_mul
  ncu_src q4out q4_k:5120x6144:residual
  timeout 150 python3 -m lab.kernel_lab --only q6lean --ms 1 --out /tmp/q6l.json > $OUT/q6lean_lab.log 2>&1
  echo "q6lean lab: rc $?"; grep -a "^gemv_\|copy" $OUT/q6lean_lab.log | tail -30; stamp "q6lean done"
fi
# PART=x: each unit's activations staged with its weights (key `stage_x`) — its same-bits cases, the kernel lab's `kqx`
#   group (M = 1, 4), the GGUF step without and with it at M = 1 (lab/gpu_session25.sh gguf_ab), then the PC sampling
#   of the Q6_K down projection with it and of the Q4_K gate/up and output projections as shipped.
eval "$(sed -n '/^gguf_ab() {/,/^}/p' lab/gpu_session25.sh)"
# q4g64_beside TAG: the Q4G64 plain step and issue 34's line against bench_TAG_ab0.json (lab/gpu_session26.sh)
eval "$(sed -n '/^q4g64_beside() {/,/^}/p' lab/gpu_session26.sh)"
XRULE=${XRULE:-"q4_k/m1:stage_x=1;q5_k/m1:stage_x=1;q6_k/m1:stage_x=1"}
if part x; then
  timeout 200 python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "activations" -q -rf -p no:cacheprovider \
    > $OUT/x_tests.log 2>&1; echo "stage_x tests: rc $?"; shown $OUT/x_tests.log 3; stamp "x tests done"
  timeout 200 python3 -m lab.kernel_lab --only kqx --ms ${KQMS:-1,4} --out /tmp/kqx_lab.json > $OUT/kqx_lab.log 2>&1
  echo "kqx lab: rc $?"; grep -a "^gemv_\|copy" $OUT/kqx_lab.log | tail -30; stamp "kqx lab done"
  gguf_ab x "base|$XRULE"; stamp "x step done"
  ncu_src q6downx q6_k:5120x17408:residual:stage_x=1
  ncu_src q4gu q4_k:34816x5120:silu_mul
  ncu_src q4out q4_k:5120x6144:residual
fi
# (PART=x ran once: `stage_x` for the k-quants was removed after it — lab/NOTES.md session 27.)
# PART=sk: stream-K grids (key `stream_k`) — its GPU cases (reference, batch invariance), the kernel lab's `streamk`
#   group, the GGUF step with the down projections and then also the output projections on one wave of 4 blocks an SM,
#   and the Q4G64 step beside it (issue 34's line, same call).
SKD="q6_k/5120x17408/m8:splits=1,stream_k=$((4 * ${SMS:-132})),min_blocks=4;q4_k/5120x17408/m8:splits=1,stream_k=$((4 * ${SMS:-132})),min_blocks=4"
SKO="q4_k/5120x6144/m8:stream_k=$((4 * ${SMS:-132})),min_blocks=4"
if part sk; then
  timeout 200 python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "stream_k" -q -rf -p no:cacheprovider \
    > $OUT/sk_tests.log 2>&1; echo "stream_k tests: rc $?"; shown $OUT/sk_tests.log 3; stamp "sk tests done"
  timeout 200 python3 -m lab.kernel_lab --only streamk --ms 1 --out /tmp/sk_lab.json > $OUT/sk_lab.log 2>&1
  echo "streamk lab: rc $?"; grep -a "^gemv_\|copy" $OUT/sk_lab.log | tail -40; stamp "streamk lab done"
  gguf_ab sk "${SKAB:-base|$SKD|$SKD;$SKO}"; stamp "sk step done"
  q4g64_beside sk; stamp "sk done"
fi
# PART=final: the stream-K down projections shipped — issue 34's line (the GGUF and Q4G64 plain steps, same call), every
#   k-quant GPU case, the GPU tier, MTP3 on the GGUF (its 4-row verify under the 128-register cap).
if part final; then
  gguf_ab final base; q4g64_beside final; stamp "line done"
  timeout ${KQ_S:-200} python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -q -rf -p no:cacheprovider \
    > $OUT/kq_tests.log 2>&1; echo "k-quant tests: rc $?"; shown $OUT/kq_tests.log 4; stamp "kq tests done"
  PART=tests bash lab/gpu_session14.sh | grep -av "NVIDIA\|^H100\|^H200" | tail -30; stamp "tier done"
  timeout 150 python3 -m ninfer_gen.cli bench --weights /tmp/qwen3.8-27b-q4_k_m.gguf --draft 3 --accept-prob 0.8 \
    --draft-vocab 32768 --output-tokens 256 --repeats 1 --prefill '' --json $OUT/bench_final_mtp3.json \
    > /tmp/bench_final_mtp3.log 2>&1; echo "GGUF MTP3: rc $?"; shown /tmp/bench_final_mtp3.log 8; stamp "final done"
fi
# PART=final2: every k-quant GPU case (the test variants of the capped stream-K keys uncapped), the GGUF step as shipped
#   and with the Q4_K gate/up under 5- and 6-block register caps (96 / 80 registers), the Q4G64 step beside it.
if part final2; then
  timeout ${KQ_S:-240} python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -q -rf -p no:cacheprovider \
    > $OUT/kq_tests.log 2>&1; echo "k-quant tests: rc $?"; shown $OUT/kq_tests.log 4; stamp "kq tests done"
  gguf_ab final2 "${GAB2:-base|q4_k/34816x5120/m8:min_blocks=5|q4_k/34816x5120/m8:min_blocks=6}"; q4g64_beside final2
  stamp "final2 done"
fi
# PART=tl: where the GGUF step's time goes beside the Q4G64 step's — lab/step_timeline.py (CUPTI trace of graph
#   replays, each kernel group charged its advance of the step's end) on both, the bench's 32K bucket (the last call).
if part tl; then
  G=/tmp/qwen3.8-27b-q4_k_m.gguf
  [ -f $G ] || { timeout 300 python3 -m tools.synth_gguf $G --device cuda > /dev/null 2>&1; echo "GGUF write: rc $?"; }
  for w in gguf q4g64; do
    timeout 150 python3 -m lab.step_timeline --max-context 32832 $([ $w = gguf ] && echo --weights $G) \
      --json $OUT/tl_$w.json > $OUT/tl_$w.log 2>&1; echo "timeline $w: rc $?"; shown $OUT/tl_$w.log 24
    stamp "timeline $w done"
  done
fi
# PART=pdl: the timeline's hypothesis — the gate/up starts late because the output projection's blocks (3 an SM at
#   110–138 registers) leave no room in the register file for a gate/up block under programmatic launch: the GGUF step
#   with the output projection under a 5-block cap (≤ 102 registers), and with the gate/up under one too. (Refuted:
#   7.182 → 7.301 / 7.312 ms.)
if part pdl; then
  gguf_ab pdl "base|q4_k/5120x6144/m8:min_blocks=5|q4_k/5120x6144/m8:min_blocks=5;q4_k/34816x5120/m8:min_blocks=5"
  stamp "pdl done"
fi
