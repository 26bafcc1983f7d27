#!/usr/bin/env bash
# Session 26's device calls (logs to $OUT as it goes; a call brings back at most 8 files under $OUT).
# PART=tl: issue 34 — the tile-looping k-quant grid (key `tile_loop`, an experiment): its same-bits cases, the kernel
#   lab's `tileloop` group beside `kqlean` (stage_w 3), the GGUF step with gate/up looping and with three stages
#   (lab/gpu_session25.sh PART=tl), then Nsight Compute on the shipped Q4_K gate/up and its Q4G64 twin (NCU=0 skips).
# PART=tm: the k-quant blocks in 16-row tile order (key `tiled`): its same-bits cases and the `tiled` lab group.
#   (tl and tm ran once, in session 26: `tile_loop` was removed after them, and `tiled` became the device layout, so
#   neither part runs on this tree any more; kept as the record of what ran.)
# PART=ship: the tile-order layout shipped — every k-quant case, the GGUF step A/B (three stages), Q4G64, GGUF MTP3.
# PART=final: the tier, the sweeps, the GGUF and Q4G64 steps in one call.
# PART=splits: the k-quant projections' K splits (and, since, 8-warp blocks) — lab, the best (warps, splits) per shape as a
#   rule, its reference check, the step A/B.
# PART=down3: the shipped split rule's 17,408-column cases and the GGUF step.
# PART=ncu (next session): Nsight Compute on the k-quant down and output projections beside their group-64 twins.
# PART=kq: every k-quant and GGUF GPU case (the review's kernel-source edits since the last run).
# PART=tier: the GPU tier (lab/gpu_session14.sh PART=tests). PART=long: issue 31's figures (lab/gpu_session24.sh).
source lab/gpu_script_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
eval "$(sed -n '/^gguf_ab() {/,/^}/p' lab/gpu_session25.sh)"   # gguf_ab TAG VARIANTS: the GGUF step per NINFER_GEMV rule
# q4g64_beside TAG: the Q4G64 path's plain step (256 tokens) and issue 34's line against the GGUF step gguf_ab TAG wrote
# first (bench_TAG_ab0.json).
q4g64_beside() {
  timeout 200 python3 -m ninfer_gen.cli bench model_specs/qwen3.8-27b.yaml --no-vision --output-tokens 256 \
    --repeats 1 --prefill '' --json $OUT/bench_$1_q4g64.json > /tmp/bench_$1_q4g64.log 2>&1
  echo "Q4G64 plain: rc $?"; grep -a "decode step (graph\|bandwidth eff\|copy" /tmp/bench_$1_q4g64.log
  python3 - $OUT/bench_$1_q4g64.json $OUT/bench_$1_ab0.json <<'PY'
import json, sys
q, g = (json.load(open(p))["decode"]["bandwidth_efficiency"] for p in sys.argv[1:])
print(f"plain decode / same-run copy: Q4G64 {q:.1%}, GGUF Q4_K_M {g:.1%}: {'PASS' if g >= q - 0.05 else 'FAIL'} (>= Q4G64 - 5 points)")
PY
}
# ncu_shapes "FMT:NxK:EPI ...": Nsight Compute (speed of light, occupancy, warp states, memory, instructions) on each
# shape's shipped decode GEMV (lab/gemv_ncu.py), the report in $OUT/kq_ncu.txt and its summary lines printed.
ncu_shapes() {
  for shape in $1; do
    timeout ${NCU_S:-60} ncu --clock-control none --kernel-name regex:gemv --launch-skip 4 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats \
      python3 -m lab.gemv_ncu --shapes $shape >> $OUT/kq_ncu.txt 2>&1
    echo "ncu $shape: rc $?"
  done
  grep -a "gemv_.*(\|Duration\|DRAM Throughput\|Registers Per\|Achieved Occupancy\|Issue Slots Busy\|L2 Hit\|Active Warps Per\|Warp Cycles Per Issued\|Executed Instructions  \|represents about" $OUT/kq_ncu.txt | head -80
  stamp "ncu done"
}
if part tl; then
  PART=tl bash lab/gpu_session25.sh | grep -av "^\[\|NVIDIA\|^H100\|^H200"; stamp "tl done"
  if [ "${NCU:-1}" = 1 ] && command -v ncu > /dev/null; then
    ncu_shapes "${KQNCU_SHAPES:-q4_k:34816x5120:silu_mul q4g64:34816x5120:silu_mul}"
  fi
fi
if part tm; then                     # issue 34: the k-quant blocks in 16-row tile order (key `tiled`, an experiment):
                                     # its same-bits cases, then the kernel lab's `tiled` group (Q4_K shapes, Q5_K 10240)
  timeout 200 python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "tile_order" -q -rf -p no:cacheprovider \
    > $OUT/tm_tests.log 2>&1; echo "tiled tests: rc $?"; shown $OUT/tm_tests.log 3; stamp "tiled tests done"
  timeout ${TM_S:-200} python3 -m lab.kernel_lab --only tiled --ms ${KQMS:-1,8} --out /tmp/tm_lab.json \
    > $OUT/tm_lab.log 2>&1; echo "tiled lab: rc $?"; grep -a "^gemv_\|copy" $OUT/tm_lab.log | tail -${KQROWS:-60}
  stamp "tiled lab done"
fi
if part ship; then                   # issue 34: the blocks in tile order as the k-quant device layout, Q4_K three stages —
                                     # every k-quant / GGUF case, the GGUF step with and without the three stages, the
                                     # Q4G64 step (the line's other side), MTP3 on the GGUF (its draft head in tile order)
  PART=kq bash lab/gpu_session14.sh | grep -av "NVIDIA\|^H100\|^H200"; stamp "kq done"
  gguf_ab ship "${GAB:-base|m8:stage_w=2}"; stamp "GGUF A/B done"
  q4g64_beside ship
  timeout 200 python3 -m ninfer_gen.cli bench --weights /tmp/qwen3.8-27b-q4_k_m.gguf --draft 3 --accept-prob 0.8 \
    --draft-vocab 32768 --output-tokens 256 --repeats 1 --prefill '' --json $OUT/bench_ship_mtp3.json \
    > $OUT/bench_ship_mtp3.log 2>&1; echo "GGUF MTP3: rc $?"; shown $OUT/bench_ship_mtp3.log 10; stamp "ship done"
fi
if part final; then                  # the final tree: the GPU tier, the exhaustive compile sweeps, the GGUF step beside the
                                     # Q4G64 step (issue 34's line) in the same call
  PART=tests bash lab/gpu_session14.sh | grep -av "NVIDIA\|^H100\|^H200"; stamp "tier done"
  NINFER_SWEEP=1 timeout ${SWEEP_S:-240} python3 -m pytest tests/test_kernels_compile.py -m sweep -q -rf \
    -p no:cacheprovider > $OUT/sweep.log 2>&1; echo "sweep: rc $?"; shown $OUT/sweep.log 4; stamp "sweep done"
  gguf_ab final base
  q4g64_beside final
  stamp "final done"
fi
if part splits; then                 # issue 34: the K splits of the step's k-quant down / output / GDN-input projections —
                                     # the kernel lab's `kqsplits` (M = 1), the fastest chained count per shape as a rule
                                     # (where it beats the shipped one by > 2 %), its keys against the reference
                                     # (lab/rule_check.py), then the GGUF step without and with the rule
  timeout 150 python3 -m lab.kernel_lab --only kqsplits --ms 1 --out /tmp/ks_lab.json > $OUT/ks_lab.log 2>&1
  echo "kqsplits lab: rc $?"; grep -a "^gemv_" $OUT/ks_lab.log | tail -30; stamp "kqsplits lab done"
  RULE=$(python3 - /tmp/ks_lab.json <<'PY'
import json, re, sys
from compiler.kernels import gemv
from compiler.targets import lookup
import torch
major, minor = torch.cuda.get_device_capability()
target = lookup(f"sm_{major}{minor}")
best = {}
for r in json.load(open(sys.argv[1]))["results"]:
    if "error" in r or not r["name"].startswith("gemv_"):
        continue
    fmt, n, k = re.match(r"gemv_(\w+?_k)_n(\d+)_k(\d+)_", r["name"]).groups()
    s = int((re.search(r"_s(\d+)_", r["name"]) or [0, 1])[1])
    w = int(re.search(r"_w(\d+)t", r["name"])[1])
    best.setdefault((fmt, int(n), int(k)), {})[(w, s)] = r["us_chain"]
rules = []
for (fmt, n, k), t in best.items():
    key = gemv.make_key(fmt, n, k, 1, target, "none")
    shipped = (key.warps, key.splits)
    w, s = min(t, key=t.get)
    print(f"{fmt} {n}x{k}: shipped (warps, splits) {shipped} {t.get(shipped, 0):.1f} us, best {(w, s)} {t[(w, s)]:.1f} us",
          file=sys.stderr)
    if (w, s) != shipped and shipped in t and t[(w, s)] < 0.98 * t[shipped]:
        rules.append(f"{fmt}/{n}x{k}:warps={w},splits={s}")
print(";".join(rules))
PY
)
  echo "rule: '$RULE'"
  if [ -n "$RULE" ]; then
    timeout 200 python3 -m lab.rule_check "$RULE" > $OUT/rule_check.log 2>&1; echo "rule check: rc $?"
    shown $OUT/rule_check.log 16; stamp "rule check done"
      gguf_ab splits "base|$RULE"; stamp "splits done"
  fi
fi
if part down3; then                  # the shipped k-quant split rule (down projections cut in 3): their GPU cases, the step
  timeout 150 python3 -m pytest -m gpu tests/gpu/test_kquant_gpu.py -k "17408" -q -rf -p no:cacheprovider \
    > $OUT/down3_tests.log 2>&1; echo "17408 cases: rc $?"; shown $OUT/down3_tests.log 3; stamp "down3 tests done"
  gguf_ab down3 base; stamp "down3 done"
fi
if part ncu; then                    # next session (issue 34): Nsight Compute on what still loses — the Q6_K and Q4_K down
                                     # projections (3 splits) and the output projection (under a wave) beside their
                                     # group-64 twins
  ncu_shapes "${KQNCU_SHAPES:-q6_k:5120x17408:residual q4_k:5120x17408:residual q5g64:5120x17408:residual \
              q4_k:5120x6144:residual q5g64:5120x6144:residual}"
fi
if part kq; then
  PART=kq bash lab/gpu_session14.sh | grep -av "NVIDIA\|^H100\|^H200"; stamp "kq done"
fi
if part tier; then
  PART=tests bash lab/gpu_session14.sh | grep -av "NVIDIA\|^H100\|^H200"; stamp "tier done"
fi
if part long; then
  PART=early,bench bash lab/gpu_session24.sh; stamp "long done"
fi
