#!/usr/bin/env bash
# Decode-GEMV variants in one device call: the gemv GPU tests (every stream setting gives the same bits), the
# kernel lab's variant group (gemv9: each variant against v1 in the same run), then the 27B decode
# bench once per NINFER_GEMV setting in VARIANTS (';'-separated, '' = the shipped config).
# Run from the repository root on the GPU machine:  bash lab/gpu_gemv_variants.sh   (logs to $OUT)
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 NINFER_BUILD_DIR=${NINFER_BUILD_DIR:-/tmp/ninfer-build}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
timeout ${TESTS_S:-200} python3 -m pytest -m gpu tests/gpu/test_kernels_gpu.py -k "${TESTS_K:-gemv}" -q -rf \
  -p no:cacheprovider 2>&1 | tee $OUT/gemv_tests.log | tail -${TESTS_TAIL:-8}
timeout ${LAB_S:-200} python3 -m lab.kernel_lab --only ${LAB_ONLY:-gemv9} --out $OUT/lab.json > $OUT/lab.log 2>&1
echo "lab rc $?"
python3 - "$OUT/lab.json" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
print(f"{'kernel':<58} {'us':>7} {'copy%':>6} {'chain':>7} {'copy%':>6} bits")
for r in rows:
    if "error" in r:
        print(f"{r['name'][:58]:<58} FAILED {r['error'][:60]}"); continue
    print(f"{r['name'][:58]:<58} {r['us_median']:>7.1f} {100*r['frac_copy']:>6.1f} {r['us_chain']:>7.1f} "
          f"{100*r['frac_copy_chain']:>6.1f} {'=' if r.get('bits_equal_v1', True) else 'DIFF'}")
EOF
IFS=';' read -ra VS <<< "${VARIANTS-}"
[ ${#VS[@]} -eq 0 ] && VS=("")
i=0
for v in "${VS[@]}"; do
  echo "== bench NINFER_GEMV='$v'"
  NINFER_GEMV="$v" timeout ${BENCH_S:-150} python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml \
    ${BENCH_ARGS:---prefill '' --output-tokens 256 --repeats 1} --json $OUT/bench_$i.json 2>&1 \
    | grep -v "it/s\]" > $OUT/bench_$i.log
  grep -E "decode tok/s|graph replay|bandwidth efficiency|TTFT|saved by leaving|prefill [0-9]|vs HF" $OUT/bench_$i.log | cut -c1-400
  i=$((i+1))
done
