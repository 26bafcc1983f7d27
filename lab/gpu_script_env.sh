# Sourced by the GPU session scripts (lab/gpu_session24.sh, lab/gpu_session25.sh): the environment every step runs in
# and the helpers — part NAME (is NAME in $PART, or $PART empty), shown FILE N (a log's last N lines without progress
# bars), stamp TEXT (seconds since the script started) — then the carried wheels, installed once per machine.
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site NINFER_BUILD_DIR=${NINFER_BUILD_DIR:-/tmp/ninfer-build}
part() { [ -z "${PART:-}" ] || [[ ",$PART," == *",$1,"* ]]; }
shown() { tr '\r' '\n' < "$1" | grep -v "it/s\]" | grep -v "kernel/s" | grep -v "^\s*$" | tail -"$2"; }
t0=$SECONDS; stamp() { echo "[$((SECONDS - t0)) s] $*"; }
source lab/device_wheels.sh
