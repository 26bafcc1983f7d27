#!/usr/bin/env bash
# Session 31's device calls (logs to $OUT as it goes; a call brings back at most 8 files). Results in
# lab/results/s31_*, the account in lab/NOTES.md (session 31).
# PART=lanes: the step's Q4_K / Q5_K GEMV keys on the lane-order unit layout (lab/kq_lanes.py, an experiment beside
#   tile order): each variant's bits against the shipped key on the same blocks, then chained µs and Σ launches × µs.
# PART=c8: lab/gpu_session30.sh's (the GGUF on the sm_86 path at C1 and C8).
source lab/gpu_script_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if part lanes; then
  timeout ${LANES_S:-240} python3 -m lab.kq_lanes --out $OUT/lanes.json > $OUT/lanes.log 2>&1
  echo "kq_lanes: rc $?"; shown $OUT/lanes.log 40; stamp "lanes done"
fi
if part c8; then
  PART=c8 bash lab/gpu_session30.sh
fi
