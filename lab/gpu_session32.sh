#!/usr/bin/env bash
# Session 32's device call (logs to $OUT as it goes; at most 8 files come back). Results in lab/results/s32_*, the
# account in lab/NOTES.md (session 32). Ran (H100): tier,adapt; buckets; chi,gap (CHI_S=440 GAP_S=100).
# PART=tier: the GPU tier (lab/gpu_session14.sh's `tests`) on the final tree of session 31 — the round cost measured on
#   throwaway lanes, the short-context guard, the policy's z — which no tier had run.
# PART=adapt: lab/gpu_session31.sh's cohort bench (C1, C8: fixed K = 3, adaptive, plain) at accept 0.8 (PS), the one p the
#   adaptive fixes were not measured at.
# PART=buckets: lab/gpu_session14.sh's `buckets` (the decode GEMVs of the B = 1 and B = 8 steps and of the C8 verify's 32
#   rows: Σ ms, % of copy, TFLOP/s) — issue 32's verify fraction, last measured in session 21.
# PART=gap: lab/step_gap.py — the plain step's host gap per step bucket (the adapter's steps against the bucket's
#   graph replayed back to back), the payoff of plain steps in flight.
# PART=cohort: the cohort GPU module alone (the round-cost test among its cases), after the review's refactor.
# PART=chi: the chi-square sampling cases (slow_gpu: 2 × 20,000 streams each; last run in session 10) — issue 32's
#   "the chi-square sampling test still passes", on the one engine's path.
source lab/gpu_script_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if part tier; then
  TESTS_S=${TESTS_S:-230} PART=tests bash lab/gpu_session14.sh | tail -40 | tee $OUT/tier_summary.log; stamp "tier done"
fi
if part adapt; then
  PS=${PS:-0.8} PART=adapt bash lab/gpu_session31.sh; stamp "adapt done"
fi
if part buckets; then
  PART=buckets bash lab/gpu_session14.sh | tee $OUT/buckets_summary.log; stamp "buckets done"
fi
if part cohort; then
  timeout ${COHORTT_S:-150} python3 -m pytest -m gpu tests/gpu/test_cohort_gpu.py -q -s -rf -p no:cacheprovider \
    > $OUT/cohort_tests.log 2>&1; echo "cohort tests: rc $?"; shown $OUT/cohort_tests.log 6; stamp "cohort done"
fi
if part chi; then
  timeout ${CHI_S:-420} python3 -m pytest -m slow_gpu tests/gpu/test_speculative_gpu.py -k sampling_matches -v -s -rf \
    -p no:cacheprovider --durations=4 > $OUT/chi.log 2>&1
  echo "chi-square cases: rc $?"; shown $OUT/chi.log 14; stamp "chi done"
fi
if part gap; then
  timeout ${GAP_S:-200} python3 -m lab.step_gap --out $OUT/gap.json > $OUT/gap.log 2>&1
  echo "step gap: rc $?"; shown $OUT/gap.log 12; stamp "gap done"
fi
