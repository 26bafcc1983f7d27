#!/usr/bin/env bash
# Session 24's device calls. PART=valid: the merged tree of session 23 (keys-split decode attention + kq_lean
# shipped together) through its GPU tests — the attention kernels and the engine's long-context / speculative tests
# (lab/gpu_session23.sh PART=keys, with the lab beside the ring), the k-quant and GGUF tests, the GPU tier.
# PART=early: the decode attention's first copies before the PDL wait (attn_decode `early`) and the combine in
# 256-thread blocks — their tests, the lab beside the keys split without them, the engine's tests (a first version
# also folded attn_combine into the decode: PART=fold of commit 316e830, refuted). PART=tier: the GPU tier.
# PART=bench: the cohort bench and the long-context bench (lab/gpu_session23.sh PART=bench). Logs to $OUT as it goes.
source lab/gpu_script_env.sh          # OUT, PYTHONPATH, part / shown / stamp, the carried wheels
if part valid; then
  PART=keys bash lab/gpu_session23.sh; stamp "keys done"
  PART=kq,tests bash lab/gpu_session14.sh; stamp "kq, tier done"
fi
if part early; then                  # the keys split's first copies before the PDL wait (attn_decode `early`, shipped on sm_90)
                                     # and attn_combine in 256-thread blocks (room beside the decode's blocks): the attention
                                     # kernel tests, the lab beside the split without early copies and the 1,024-thread
                                     # combine (4w), then the engine's long-context / speculative tests
  timeout ${EARLYT_S:-200} python3 -m pytest -m gpu tests/gpu/test_kernels_gpu.py tests/gpu/test_long_context_gpu.py \
    -k "attn_decode or attn_combine" -q -rf -p no:cacheprovider > $OUT/early_tests.log 2>&1
  echo "early tests: rc $?"; grep -a "FAILED\|ERROR\|passed\|failed" $OUT/early_tests.log | tail -12
  timeout ${EARLYL_S:-200} python3 -m lab.attn_long --out $OUT/attn_long_early.json --splits ${ASPLITS:-66} \
    --contexts ${ACTX:-4096,32768,131072} --variant ${AVAR:-keys} --combine-whole > $OUT/attn_long_early.log 2>&1
  echo "early lab: rc $?"; shown $OUT/attn_long_early.log 30; stamp "early lab done"
  timeout ${ENGT_S:-200} python3 -m pytest -m gpu tests/gpu/test_long_context_gpu.py tests/gpu/test_speculative_gpu.py \
    -k "not attn_decode and not attn_combine and not rope_kv and not attn_prefill" -q -rf -p no:cacheprovider \
    > $OUT/engine_tests.log 2>&1; echo "engine tests: rc $?"; shown $OUT/engine_tests.log 6; stamp "early done"
fi
if part tier; then
  PART=tests bash lab/gpu_session14.sh; stamp "tier done"
fi
if part bench; then
  PART=bench bash lab/gpu_session23.sh; stamp "bench done"
fi
