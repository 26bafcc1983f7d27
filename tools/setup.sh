#!/usr/bin/env bash
# Creates .venv in the repository and installs ninfer-gen with its test extra. Idempotent.
# The CPU build of torch is pinned so a machine without a GPU does not pull a multi-GB CUDA build;
# set NINFER_TORCH (e.g. NINFER_TORCH=torch) to choose another torch requirement.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "${NINFER_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e '.[test]'
