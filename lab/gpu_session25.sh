#!/usr/bin/env bash
# Session 25's device calls (logs to $OUT as it goes).
# PART=q6: `q6_lean` (issue 34: Q6_K's unit math in fewer instructions, the same bits) — the k-quant and GGUF GPU tests
#   (every Q6_K case against the reference, q6_lean = without it bit for bit), the kernel lab's `q6lean` group
#   (shipped / without / 4-, 5- and 2-block caps) and `kqlean` group (Q4_K/Q5_K: shipped / code_bias alone / 5- and
#   6-block caps), M = 1 and 8, then issue 34's 27B line on a Q4_K_M-style GGUF: Q4G64 and
#   GGUF plain decode as fractions of the same-run copy and MTP3 (lab/gpu_session14.sh PART=gguf27, the file kept).
# PART=q6b: the same with rows of 272 bytes (the 256-byte rows of the first version had 8-way bank conflicts): the Q6_K
#   cases, the q6lean lab, the GGUF step with and without q6_lean. PART=b5: five blocks an SM at 10,240 rows — its
#   cases, the GGUF step with and without it (and without q6_lean), the Q4G64 step in the same call.
# PART=sweep: the exhaustive compile sweeps CI samples (pytest -m sweep: every sm_90 key, every sm_86 k-quant key) on
#   the device's cores. PART=tier: the GPU tier (lab/gpu_session14.sh PART=tests).
# PART=long: on an H200, issue 31's figures (lab/gpu_session24.sh PART=early,bench).
# PART=tl (for session 26): the tile-looping k-quant grid and the third stage, in the lab and in the GGUF step.
source lab/gpu_script_env.sh          # OUT, PYTHONPATH, part / shown / stamp, the carried wheels
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# gguf_ab TAG VARIANTS: the 27B Q4_K_M GGUF's plain step under each '|'-separated NINFER_GEMV rule set (base: none),
# written to /tmp/qwen3.8-27b-q4_k_m.gguf first if missing; the reports under $OUT as bench_TAG_ab<i>.json.
gguf_ab() {
  local G=/tmp/qwen3.8-27b-q4_k_m.gguf i=0 v
  [ -f $G ] || { timeout 300 python3 -m tools.synth_gguf $G --device cuda > /tmp/gguf_write.json 2> /tmp/gguf_write.log
                 echo "GGUF write: rc $?"; }
  IFS='|' read -ra VS <<< "$2"
  for v in "${VS[@]}"; do
    [ "$v" = base ] && v=""
    NINFER_GEMV="$v" timeout 150 python3 -m ninfer_gen.cli bench --weights $G --output-tokens 256 --repeats 1 \
      --prefill '' --json $OUT/bench_$1_ab$i.json > /tmp/bench_$1_ab$i.log 2>&1
    echo "GGUF plain, NINFER_GEMV='$v': rc $?"
    grep -a "decode step (graph\|bandwidth eff\|copy\|saved by" /tmp/bench_$1_ab$i.log
    i=$((i + 1))
  done
}
if part q6; then
  PART=kq bash lab/gpu_session14.sh; stamp "k-quant tests done"
  timeout ${Q6L_S:-240} python3 -m lab.kernel_lab --only ${KQLAB:-q6lean,kqlean} --ms ${KQMS:-1,8} \
    --out $OUT/q6lean_lab.json \
    > $OUT/q6lean_lab.log 2>&1; echo "q6lean lab: rc $?"; grep -a "^gemv_" $OUT/q6lean_lab.log | tail -${KQROWS:-20}
  stamp "q6lean, kqlean lab done"
  KEEP_GGUF=1 GGUF_RSS=${GGUF_RSS:-0} GGUF_C8=0 PART=gguf27 bash lab/gpu_session14.sh; stamp "gguf27 done"
fi
if part q6b; then                    # q6_lean with conflict-free rows (272 B): its same-bits and Q6_K tests, the q6lean
                                     # lab, the GGUF step with and without it (≤ 8 files under $OUT: what a call brings
                                     # back)
  timeout ${KQ_S:-200} python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "q6" -q -rf -p no:cacheprovider \
    > $OUT/q6_tests.log 2>&1; echo "q6 tests: rc $?"; shown $OUT/q6_tests.log 4; stamp "q6 tests done"
  timeout ${Q6L_S:-240} python3 -m lab.kernel_lab --only ${KQLAB:-q6lean} --ms ${KQMS:-1,8} --out /tmp/q6lean_lab.json \
    > $OUT/q6lean_lab.log 2>&1; echo "q6lean lab: rc $?"; grep -a "^gemv_" $OUT/q6lean_lab.log | tail -${KQROWS:-40}
  stamp "q6lean lab done"
  gguf_ab gguf "${GAB:-base|q6_lean=0}"
  stamp "q6b done"
fi
if part b5; then                     # five blocks an SM for 10,240-row k-quant GEMVs (one wave): their GPU cases, then
                                     # the GGUF step as shipped, without the rule, without it and q6_lean (session 23's
                                     # kernels), and the Q4G64 path's step in the same call (issue 34's line)
  timeout 200 python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "10240" -q -rf -p no:cacheprovider \
    > $OUT/b5_tests.log 2>&1; echo "b5 tests: rc $?"; shown $OUT/b5_tests.log 3; stamp "b5 tests done"
  gguf_ab b5 "${GAB:-base|10240x5120/m8:min_blocks=3|10240x5120/m8:min_blocks=3,q6_lean=0;q6_lean=0}"
  timeout 200 python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --output-tokens 256 \
    --repeats 1 --prefill '' --json $OUT/bench_b5_q4g64.json > /tmp/bench_b5_q4g64.log 2>&1
  echo "Q4G64 plain: rc $?"; grep -a "decode step (graph\|bandwidth eff\|copy" /tmp/bench_b5_q4g64.log; stamp "b5 done"
fi
if part tl; then                     # next session (issue 34): the tile-looping grid (key `tile_loop`, an experiment) —
                                     # its same-bits cases, the kernel lab's `tileloop` group beside `kqlean` (which now
                                     # carries stage_w 3), and the GGUF step with looping grids of 4 blocks an SM
  timeout 200 python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "tile_looping" -q -rf -p no:cacheprovider \
    > $OUT/tl_tests.log 2>&1; echo "tile_loop tests: rc $?"; shown $OUT/tl_tests.log 3; stamp "tile_loop tests done"
  timeout 300 python3 -m lab.kernel_lab --only ${KQLAB:-tileloop,kqlean} --ms ${KQMS:-1,8} --out /tmp/tl_lab.json \
    > $OUT/tl_lab.log 2>&1; echo "tileloop lab: rc $?"; grep -a "^gemv_" $OUT/tl_lab.log | tail -${KQROWS:-30}
  stamp "tileloop lab done"
  gguf_ab tl "${GAB:-base|34816x5120/m8:tile_loop=528|m8:stage_w=3}"; stamp "tl done"   # (10,240 rows spill under it)
fi
if part sweep; then
  NINFER_SWEEP=1 timeout ${SWEEP_S:-300} python3 -m pytest tests/test_kernels_compile.py -m sweep -q -rf \
    -p no:cacheprovider --durations=5 > $OUT/sweep.log 2>&1; echo "sweep: rc $?"; shown $OUT/sweep.log 12
  stamp "sweep done"
fi
if part tier; then
  PART=tests bash lab/gpu_session14.sh; stamp "tier done"
fi
if part long; then
  PART=early,bench bash lab/gpu_session24.sh; stamp "long done"
fi
