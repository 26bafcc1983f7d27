#!/usr/bin/env bash
# The device calls of sessions 13–14 (issues 30–34): the GPU tier's cohort, speculative, runtime and arch-path
# files, the 27B C1 bench through the engine (K = 3, 32K draft head, accept 0.8), the cohort bench C1/C8 (fixed,
# adaptive, plain), the sm_86 path, serve with no flags, long context, k-quants, and images (vision).
# PART=attn,pattn,fixes,sdiag,tests,bench,fold,chain,cohort,arch,serve,long,pace,kq,gguf27,vision,agent,kqlab,kqab,kqlean,vlab,kqncu,buckets,verify,cohortab,stepab,attnncu (default: all, in that order). Logs to $OUT
# as it goes. `chain` (session 15, issue 32 item 2): joined GEMV launches — their bit tests, then the same-run step
# A/B of off / group / chain on the sm_90 path and on the sm_86 path.
# The text benches load the 27B with --no-vision (the figures earlier sessions compare with); `vision` measures
# the default load (tower on: M-RoPE plans, the tower's memory) beside them.
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site NINFER_BUILD_DIR=${NINFER_BUILD_DIR:-/tmp/ninfer-build}
shown() { tr '\r' '\n' < "$1" | grep -v "it/s\]" | grep -v "kernel/s" | grep -v "^\s*$" | tail -"$2"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
source lab/device_wheels.sh
part() { [ -z "${PART:-}" ] || [[ ",$PART," == *",$1,"* ]]; }
if part attn; then                   # session 16 (issue 31 item 2): the tensor-core decode attention — its kernel tests
                                     # (every case key, past 32K), then the long-context lab at 4K / 32K / 128K
                                     # (AVAR: lab template variants, e.g. vahead, ring; ACG: combine split groups, e.g. 1,4)
  timeout ${ATTNT_S:-240} python3 -m pytest -m gpu tests/gpu/test_kernels_gpu.py tests/gpu/test_long_context_gpu.py \
    -k "attn_decode or attn_combine" -v -rf -p no:cacheprovider > $OUT/attn_tests.log 2>&1
  echo "attn tests: rc $?"; grep -a "PASSED\|FAILED\|ERROR" $OUT/attn_tests.log | sed 's/ *\[ *[0-9]*%\]//' | tail -30
  grep -a "rel\|max\|Error" $OUT/attn_tests.log | head -20
  timeout ${ATTNL_S:-200} python3 -m lab.attn_long --out $OUT/attn_long.json --splits ${ASPLITS:-132,264} \
    --contexts ${ACTX:-4096,32768,131072} ${AVAR:+--variant $AVAR} ${ACG:+--combine-groups $ACG} > $OUT/attn_long.log 2>&1
  echo "attn lab: rc $?"; shown $OUT/attn_long.log 30
fi
if part pattn; then                  # session 17 (issue 31, 128K TTFT): the prefill attention over a long history,
                                     # the shipped INT8 kernel vs the archived v1 (lab/templates/attn_prefill_v1.cu.j2);
                                     # PARCH=sm_86: the 3090's 4-warp tiling, run as PTX (never timed yet);
                                     # PVAR=mma: also the mma.sync kernel (sm_90's before its wgmma one), wg: the
                                     # wgmma one (sm_90 only); either runs the wgmma kernel's GPU test first
  if [ -n "${PVAR:-}" ]; then
    timeout ${PWGT_S:-120} python3 -m pytest -m gpu tests/gpu/test_attn_prefill_wg_gpu.py -v -rf -p no:cacheprovider \
      > $OUT/attn_prefill_wg_tests.log 2>&1
    echo "prefill wg tests: rc $?"; grep -a "PASSED\|FAILED\|ERROR\|exceeded\|NaN" $OUT/attn_prefill_wg_tests.log | head -12
  fi
  timeout ${PATTN_S:-150} python3 -m lab.attn_prefill_long --out $OUT/attn_prefill_long.json \
    --history ${PHIST:-8192,32768,131072} --chunk ${PCHUNK:-4096} ${PARCH:+--arch $PARCH} ${PVAR:+--variant $PVAR} \
    > $OUT/attn_prefill_long.log 2>&1
  echo "prefill attn lab: rc $?"; shown $OUT/attn_prefill_long.log 24
fi
if part fixes; then                  # session 15's fixes made after its device time: the 5/8-prompt cohort mismatch
                                     # (a leaving lane's row left RUNNING), the second-turn setup of two cohort tests
  timeout ${DIAG_S:-150} python3 -m lab.cohort_diag --n 5,8 > $OUT/cohort_diag.log 2>&1
  echo "cohort diag: rc $?"; grep -a "^n = " $OUT/cohort_diag.log
  timeout ${FIXT_S:-240} python3 -m pytest -m gpu tests/gpu/test_cohort_gpu.py tests/gpu/test_fold_in_verify_gpu.py \
    "tests/gpu/test_chains_gpu.py::test_a_cohort_gives_the_default_builds_tokens_in_every_chain_mode" -v -s -rf \
    -p no:cacheprovider > $OUT/fixes_tests.log 2>&1
  echo "fixes tests: rc $?"; grep -a "PASSED\|FAILED\|ERROR" $OUT/fixes_tests.log | sed 's/ *\[ *[0-9]*%\]//' | tail -20
fi
if part sdiag; then                  # session 17: the sampled request that parted from its solo run at 8 lanes
  timeout ${SDIAG_S:-150} python3 -m lab.cohort_sampled_diag ${SDIAG_ARGS:-} > $OUT/sampled_diag.log 2>&1
  echo "sampled diag: rc $?"; grep -a "request 5\|lanes:" $OUT/sampled_diag.log; tail -5 $OUT/sampled_diag.log
fi
if part tests; then
  timeout ${TESTS_S:-330} python3 -m pytest -m gpu ${TIER:-tests/gpu/test_cohort_gpu.py tests/gpu/test_speculative_gpu.py \
    tests/gpu/test_vision_kernels_gpu.py tests/gpu/test_vision_gpu.py tests/gpu/test_arch_path_gpu.py \
    tests/gpu/test_runtime_gpu.py tests/gpu/test_gguf_gpu.py} -v -s -rf -p no:cacheprovider --durations=12 \
    > $OUT/tier.log 2>&1
  echo "tier: rc $?"; grep -a "PASSED\|FAILED\|ERROR" $OUT/tier.log | sed 's/ *\[ *[0-9]*%\]//' | tail -60; shown $OUT/tier.log 25
fi
if part bench; then
  timeout ${BENCH_S:-300} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --draft 3 --accept-prob 0.8 \
    --draft-vocab 32768 --output-tokens 512 --repeats 1 --prefill '' --per-k --json $OUT/bench_c1.json > $OUT/bench_c1.log 2>&1
  echo "C1 bench: rc $?"; shown $OUT/bench_c1.log 40
fi
if part fold; then                   # issue 32 item 3: rounds that fold inside the next verify, tier test and C1/C8 bench
  timeout ${FOLDT_S:-150} python3 -m pytest -m gpu tests/gpu/test_fold_in_verify_gpu.py -q -s -rf -p no:cacheprovider \
    > $OUT/fold_tests.log 2>&1; echo "fold-in-verify tests: rc $?"; shown $OUT/fold_tests.log 8
  NINFER_FOLD_IN_VERIFY=1 timeout ${FOLD_S:-300} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision \
    --draft 3 --accept-prob 0.8 --draft-vocab 32768 --output-tokens 512 --repeats 1 --prefill '' \
    --json $OUT/bench_fold_c1.json > $OUT/bench_fold_c1.log 2>&1
  echo "C1 bench, fold in verify: rc $?"; shown $OUT/bench_fold_c1.log 24
fi
if part chain; then                  # issue 32 item 2: decode GEMVs in fewer launches (CompileOptions.chain)
  timeout ${CHAINT_S:-300} python3 -m pytest -m gpu tests/gpu/test_chains_gpu.py -v -s -rf -p no:cacheprovider \
    > $OUT/chain_tests.log 2>&1; echo "chain tests: rc $?"; shown $OUT/chain_tests.log 10
  for arch in "" sm_86; do
    timeout ${CHAINAB_S:-200} python3 -m lab.step_ab --variants "base|env:NINFER_CHAIN=group|env:NINFER_CHAIN=chain" \
      ${arch:+--arch-path $arch} --rounds 5 --json $OUT/chain_ab${arch:+_$arch}.json > $OUT/chain_ab${arch:+_$arch}.log 2>&1
    echo "step A/B ${arch:-sm_90}: rc $?"; shown $OUT/chain_ab${arch:+_$arch}.log 6
  done
fi
if part stepab; then                 # session 20: the 27B decode step under '|'-separated variants in SAB (lab.step_ab:
                                     # base, NINFER_GEMV rule sets, env:NAME=VALUE), each its own graph, one process
  timeout ${STEPAB_S:-200} python3 -m lab.step_ab --variants "${SAB:-base}" ${SARCH:+--arch-path $SARCH} --rounds 5 \
    --json $OUT/step_ab.json > $OUT/step_ab.log 2>&1
  echo "step A/B: rc $?"; shown $OUT/step_ab.log 8
fi
if part cohort; then                 # C1 and C8, fixed K, adaptive and plain, at each accept probability in PS
  for p in ${PS:-0.8}; do
    timeout ${COHORT_S:-300} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --concurrency ${CONC:-1,8} \
      --draft 3 --accept-prob $p --draft-vocab 32768 --output-tokens ${TOKENS:-256} --adaptive --cohort-repeats ${CREP:-1} \
      --json $OUT/bench_cohort_$p.json > $OUT/bench_cohort_$p.log 2>&1
    echo "cohort bench p=$p: rc $?"; shown $OUT/bench_cohort_$p.log 24
  done
fi
if part cohortab; then               # session 20 (issue 32's C8 line): the cohort bench C1/C8 (MTP3 and plain) under each
                                     # '|'-separated variant in CAB, one process each: base (none), a NINFER_GEMV rule
                                     # set, or env:NAME=VALUE (e.g. env:NINFER_FOLD_IN_VERIFY=1)
  IFS='|' read -ra VS <<< "${CAB:-base}"; i=0
  for v in "${VS[@]}"; do
    [ "$v" = base ] && v=""
    ev=CAB_VARIANT=$i; [[ "$v" == env:* ]] && { ev="${v#env:}"; v=""; }
    env "$ev" NINFER_GEMV="$v" timeout ${COHORT_S:-300} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision \
      --concurrency ${CONC:-1,8} --draft 3 --accept-prob ${CABP:-0.8} --draft-vocab 32768 --output-tokens ${TOKENS:-256} \
      --cohort-repeats ${CREP:-1} --json $OUT/bench_cohortab$i.json > /tmp/cohortab$i.log 2>&1
    echo "cohort bench ${VS[$i]}: rc $?" | tee -a $OUT/cohortab.log; shown /tmp/cohortab$i.log 12 | tee -a $OUT/cohortab.log
    rm -f $OUT/bench_cohortab$i.png          # (≤ 8 files come back: one log for all variants, a JSON each)
    i=$((i + 1))
  done
fi
if part arch; then
  timeout ${ARCH_S:-300} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --arch-path sm_86 \
    --output-tokens 256 --repeats 1 --prefill '' --json $OUT/bench_sm86.json > $OUT/bench_sm86.log 2>&1
  echo "sm_86 bench: rc $?"; shown $OUT/bench_sm86.log 30
fi
if part serve; then                  # serve with no flags but the weights: its start-up lines and /v1/models
  timeout ${SERVE_S:-170} python3 -m ninfer_gen.cli serve --weights model_specs/qwen3.8-27b.yaml > $OUT/serve.log 2>&1 &
  python3 - <<'PY' > $OUT/models.json
import json, time, urllib.request
for _ in range(160):
    try:
        print(json.dumps(json.load(urllib.request.urlopen("http://127.0.0.1:8000/v1/models", timeout=2)))); break
    except Exception:
        time.sleep(1)
PY
  echo "serve:"; grep -a "memory plan\|serving\|error" $OUT/serve.log | head -5; cat $OUT/models.json
  kill %1 2>/dev/null; wait
fi
if part long; then                   # issue 31: long-context GPU tests, the 27B bench at 1K/32K/128K, the attention lab
  timeout ${LONGT_S:-200} python3 -m pytest -m gpu tests/gpu/test_long_context_gpu.py -q -s -rf -p no:cacheprovider \
    > $OUT/long_tests.log 2>&1; echo "long tests: rc $?"; shown $OUT/long_tests.log 12
  timeout ${LONG_S:-300} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --long-context --draft 3 \
    --accept-prob 0.8 --json $OUT/bench_long.json > $OUT/bench_long.log 2>&1; echo "long bench: rc $?"; shown $OUT/bench_long.log 30
  timeout ${ATTN_S:-120} python3 -m lab.attn_long --out $OUT/attn_long.json --splits 132,264 > $OUT/attn_long.log 2>&1
  echo "attn lab: rc $?"; shown $OUT/attn_long.log 16
fi
if part pace; then                   # issue 31 item 6: a 32K prompt beside 7 decoding lanes, unpaced and paced to a gap
  for gap in "" ${GAPS:-40}; do
    timeout ${PACE_S:-240} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --long-prompt 32768 \
      --running-lanes 7 --draft 3 --accept-prob 0.8 --draft-vocab 32768 ${gap:+--max-gap-ms $gap} \
      --json $OUT/bench_pace_${gap:-none}.json > $OUT/bench_pace_${gap:-none}.log 2>&1
    echo "long prompt, gap bound ${gap:-none}: rc $?"; shown $OUT/bench_pace_${gap:-none}.log 8
  done
fi
if part kq; then                     # issue 34: k-quant kernels vs reference, the GGUF GPU tests
  timeout ${KQ_S:-200} python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py tests/gpu/test_gguf_gpu.py -q -s -rf \
    -p no:cacheprovider > $OUT/kq_tests.log 2>&1; echo "k-quant tests: rc $?"; shown $OUT/kq_tests.log 16
fi
if part gguf27; then                 # issue 34's 27B line: a Q4_K_M-style 27B GGUF of random blocks (drawn on the GPU), host
                                     # RSS of its loads, plain decode beside the Q4G64 path's (same flags), MTP3, C1/C8
  G=${GGUF:-/tmp/qwen3.8-27b-q4_k_m.gguf}
  [ -f $G ] || { timeout ${GGUFW_S:-300} python3 -m tools.synth_gguf $G --device cuda > $OUT/gguf_write.json 2> $OUT/gguf_write.log
                 echo "GGUF write: rc $?"; cat $OUT/gguf_write.json; }
  if [ "${GGUF_RSS:-1}" = 1 ]; then                 # GGUF_RSS=0 / GGUF_C8=0 skip the host-RSS loads / the cohort bench
  timeout ${GGUFR_S:-300} python3 -m lab.gguf_rss --gguf $G --modes stream,gpu --work /tmp/gguf-rss --json $OUT/gguf_rss.json \
    > $OUT/gguf_rss.log 2>&1; echo "GGUF host RSS: rc $?"; grep -a "^stream:\|^gpu:" $OUT/gguf_rss.log
  fi
  timeout ${GGUFB_S:-300} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --output-tokens 512 \
    --repeats 1 --prefill '' --json $OUT/bench_q4g64_plain.json > $OUT/bench_q4g64_plain.log 2>&1
  echo "Q4G64 plain: rc $?"; shown $OUT/bench_q4g64_plain.log 12
  timeout ${GGUFB_S:-300} python3 -m ninfer_gen.cli bench --weights $G --output-tokens 512 --repeats 1 --prefill '' \
    --json $OUT/bench_gguf_plain.json > $OUT/bench_gguf_plain.log 2>&1
  echo "GGUF plain: rc $?"; shown $OUT/bench_gguf_plain.log 12
  python3 - $OUT/bench_q4g64_plain.json $OUT/bench_gguf_plain.json <<'PY'
import json, sys
q, g = (json.load(open(p))["decode"]["bandwidth_efficiency"] for p in sys.argv[1:])
print(f"plain decode / same-run copy: Q4G64 {q:.1%}, GGUF Q4_K_M {g:.1%}: {'PASS' if g >= q - 0.05 else 'FAIL'} (>= Q4G64 - 5 points)")
PY
  timeout ${GGUFB_S:-300} python3 -m ninfer_gen.cli bench --weights $G --draft 3 --accept-prob 0.8 --draft-vocab 32768 \
    --output-tokens 512 --repeats 1 --prefill '' --json $OUT/bench_gguf_mtp3.json > $OUT/bench_gguf_mtp3.log 2>&1
  echo "GGUF MTP3: rc $?"; shown $OUT/bench_gguf_mtp3.log 16
  if [ "${GGUF_C8:-1}" = 1 ]; then
  timeout ${GGUFC_S:-300} python3 -m ninfer_gen.cli bench --weights $G --concurrency 1,8 --draft 3 --accept-prob 0.8 \
    --draft-vocab 32768 --output-tokens 256 --json $OUT/bench_gguf_c8.json > $OUT/bench_gguf_c8.log 2>&1
  echo "GGUF C1/C8: rc $?"; shown $OUT/bench_gguf_c8.log 16
  fi
  [ -n "${KEEP_GGUF:-}" ] || rm -f $G
fi
if part vision; then                 # issue 33: the M-RoPE kernels, images through the GPU engine, the 27B image line
  timeout ${VISIONT_S:-200} python3 -m pytest -m gpu tests/gpu/test_vision_kernels_gpu.py tests/gpu/test_vision_gpu.py \
    -q -s -rf -p no:cacheprovider > $OUT/vision_tests.log 2>&1; echo "vision tests: rc $?"; shown $OUT/vision_tests.log 16
  timeout ${VISION_S:-300} python3 -m lab.vision_bench --out $OUT/vision_27b.json > $OUT/vision_27b.log 2>&1
  echo "vision 27B: rc $?"; shown $OUT/vision_27b.log 8
  timeout ${VISIONK_S:-200} python3 -m lab.vision_bench --vision-kernels --out $OUT/vision_27b_kernels.json \
    > $OUT/vision_27b_kernels.log 2>&1; echo "vision 27B, compiled encoder: rc $?"; shown $OUT/vision_27b_kernels.log 8
  timeout ${VSTEP_S:-200} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --output-tokens 256 --repeats 1 \
    --prefill '' --json $OUT/bench_tower.json > $OUT/bench_tower.log 2>&1   # plain C1 with the tower (M-RoPE plans)
  echo "C1 with the tower: rc $?"; shown $OUT/bench_tower.log 12
fi
if part agent; then                  # issue 31 item 5: agent sessions on a 32K repository context, 8 turns, 1 and 4
                                     # sessions, with and without prefix reuse (AREUSE=--no-reuse-run skips the latter)
  for p in ${APS:-0.8 0.3}; do
    timeout ${AGENT_S:-300} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --workload agent \
      --context-tokens ${ACONTEXT:-32768} --turns ${ATURNS:-8} --sessions ${ASESS:-1,4} --draft 3 --accept-prob $p \
      --draft-vocab 32768 ${AREUSE:-} --json $OUT/bench_agent_$p.json > $OUT/bench_agent_$p.log 2>&1
    echo "agent bench p=$p: rc $?"; shown $OUT/bench_agent_$p.log 30
  done
fi
if part kqlab; then                  # session 18 (issue 34): the k-quant GEMVs beside their group-64 twins, with register caps
                                     # and 8-warp blocks (lab/kernel_lab.py KQUANT_VARIANTS), M = 1 and 4
  timeout ${KQLAB_S:-200} python3 -m lab.kernel_lab --only kquant --ms ${KQMS:-1,4} --out $OUT/kquant_lab.json \
    > $OUT/kquant_lab.log 2>&1; echo "k-quant lab: rc $?"; grep -a "^gemv_" $OUT/kquant_lab.log | tail -${KQROWS:-90}
fi
if part kqab; then                   # session 18 (issue 34): the 27B Q4_K_M GGUF's plain decode under NINFER_GEMV variants
  G=${GGUF:-/tmp/qwen3.8-27b-q4_k_m.gguf}
  [ -f $G ] || { timeout ${GGUFW_S:-300} python3 -m tools.synth_gguf $G --device cuda > $OUT/gguf_write.json 2> $OUT/gguf_write.log
                 echo "GGUF write: rc $?"; }
  IFS='|' read -ra VS <<< "${GAB:-base|stage_w=0|stage_w=3}"; i=0      # '|'-separated; base: no override
  for v in "${VS[@]}"; do
    [ "$v" = base ] && v=""
    NINFER_GEMV="$v" timeout ${GGUFB_S:-120} python3 -m ninfer_gen.cli bench --weights $G --output-tokens 256 --repeats 1 \
      --prefill '' --json $OUT/bench_gguf_ab$i.json > $OUT/bench_gguf_ab$i.log 2>&1
    echo "GGUF plain, NINFER_GEMV='$v': rc $?"; grep -a "decode tok/s\|decode step (graph\|bandwidth eff\|copy" $OUT/bench_gguf_ab$i.log
    i=$((i + 1))
  done
fi
if part kqlean; then                 # issue 34: `kq_lean` (the Q4_K/Q5_K unit math in fewer instructions, common/kq_lean.j2) — its
                                     # GPU tests (reference, staged = loaded bits, batch invariance), then the kernel lab's
                                     # `kqlean` group (shipped vs kq_lean, M = KQMS); the GGUF step: PART=kqab GAB="base|kq_lean=1"
  timeout ${KQLT_S:-300} python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "kl_sm or lean" -q -rf \
    -p no:cacheprovider > $OUT/kqlean_tests.log 2>&1; echo "kq_lean tests: rc $?"; shown $OUT/kqlean_tests.log 16
  timeout ${KQLL_S:-200} python3 -m lab.kernel_lab --only kqlean --ms ${KQMS:-1,4,8} --out $OUT/kqlean_lab.json \
    > $OUT/kqlean_lab.log 2>&1; echo "kq_lean lab: rc $?"; grep -a "^gemv_" $OUT/kqlean_lab.log | tail -${KQROWS:-90}
fi
if part vlab; then                   # session 18 (issue 33's compiled encoder, 89.9 ms vs torch's 42.1): its kernels timed,
                                     # with their launch counts in the 27B one-image plan
  timeout ${VLAB_S:-150} python3 -m lab.kernel_lab --only vision --out $OUT/vision_lab.json > $OUT/vision_lab.log 2>&1
  echo "vision kernel lab: rc $?"; grep -a "^attn_vision\|^gemm_bf16\|^layernorm\|^pos_embed\|^27B encoder" $OUT/vision_lab.log
fi
if part kqncu; then                  # session 19 (issue 34): Nsight Compute on the k-quant GEMVs and their group-64 twin (NCUM: rows),
                                     # shipped and staged (lab/gemv_ncu.py FMT:NxK:EPI[:RULE]), one report per shape
  for shape in ${KQNCU_SHAPES:-q4_k:34816x5120:silu_mul q4_k:34816x5120:silu_mul:stage_w=2 q4g64:34816x5120:silu_mul \
               q6_k:5120x17408:residual q6_k:5120x17408:residual:stage_w=2}; do
    timeout ${NCU_S:-90} ncu --clock-control none --kernel-name regex:gemv --launch-skip 4 --launch-count 1 \
      --set full --import-source no python3 -m lab.gemv_ncu --shapes $shape ${NCUM:+--m $NCUM} >> $OUT/kq_ncu.txt 2>&1
    echo "ncu $shape: rc $?"
  done
  grep -a "gemv_\|Duration\|Memory Throughput\|DRAM Throughput\|Executed Ipc A\|Registers Per\|Achieved Occupancy\|Issue Slots Busy\|No Eligible\|Executed Instructions  " $OUT/kq_ncu.txt | grep -av "us per launch" | head -80
fi
if part attnncu; then                 # session 21 (issue 31): Nsight Compute on the decode attention at 32K keys (T = 1; ANCU_RE
                                     # picks the kernel, AVAR a lab variant) and the prefill attention at a 32K history
  timeout ${NCU_S:-120} ncu --clock-control none --kernel-name regex:${ANCU_RE:-attn_decode} --launch-skip 5 --launch-count 1 \
    --set full --import-source no python3 -m lab.attn_long --contexts 32768 --t 1 --iters 3 --out /tmp/attn_ncu.json \
    ${AVAR:+--variant $AVAR} > $OUT/attn_ncu.txt 2>&1; echo "ncu decode attention: rc $?"
  timeout ${NCU_S:-120} ncu --clock-control none --kernel-name regex:'attn_prefill.*_w' --launch-skip 1 --launch-count 1 \
    --set full --import-source no python3 -m lab.attn_prefill_long --history 32768 --iters 2 --warmup 1 --check-tokens 16 \
    --out /tmp/attn_prefill_ncu.json >> $OUT/attn_ncu.txt 2>&1; echo "ncu prefill attention: rc $?"
  grep -a "attn_\|Duration\|Memory Throughput\|DRAM Throughput\|L1/TEX Hit\|Executed Ipc A\|Registers Per\|Achieved Occupancy\|Issue Slots Busy\|No Eligible\|Stall\|Pipe\|Shared Memory\|Bank" \
    $OUT/attn_ncu.txt | grep -av "us per\|^attn_.*grid" | head -90
fi
if part verify; then                 # session 20 (issue 32's C8 line): the C8 verify's 32-row GEMVs under row-tile / load-depth
                                     # variants (lab/kernel_lab.py VERIFY_VARIANTS): Σ ms and % of copy per variant
  timeout ${VERIFY_S:-240} python3 -m lab.kernel_lab --only verify --out $OUT/verify_lab.json > $OUT/verify_lab.log 2>&1
  echo "verify GEMVs lab: rc $?"; grep -a "^verify B" $OUT/verify_lab.log
fi
if part buckets; then                # session 19 (issue 32's C8 line): the decode GEMVs of the 27B's B = 1 and B = 8 steps and
                                     # of the C8 verify (32 rows), with launches per bucket: Σ ms, % of copy, TFLOP/s per bucket
  timeout ${BUCKETS_S:-200} python3 -m lab.kernel_lab --only buckets --out $OUT/buckets_lab.json > $OUT/buckets_lab.log 2>&1
  echo "bucket GEMVs lab: rc $?"; grep -a "^gemv_\|^27B step" $OUT/buckets_lab.log
fi
