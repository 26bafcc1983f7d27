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
# The chat page's browser test (tests/test_ui_browser.py) drives Debian's headless Chromium through its
# ChromeDriver. Installed once (about 20 s with the package lists; nothing to do afterwards); where apt-get or
# root is missing, or the install fails, this says so and the test skips.
if ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium chromium-driver >/dev/null; } \
      || echo "setup: installing chromium and chromium-driver failed: tests/test_ui_browser.py will skip" >&2
  else
    echo "setup: no chromium/chromedriver and no root apt-get to install them: tests/test_ui_browser.py will skip" >&2
  fi
fi
