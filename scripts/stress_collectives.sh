#!/usr/bin/env bash
# Stress test of collectives in lockstep and of clean exits, on a loaded
# machine.
#
# Usage: scripts/stress_collectives.sh [ITERATIONS]   (default 20)
#
# Starts STRESS_HOGS busy loops (default: one per CPU core), allows core
# dumps (a crash's native stacks are read from its core with gdb), and
# runs scripts/stress_collectives.py, whose docstring says what each
# iteration launches (test workers, the examples, a keras-hub LoRA
# fine-tune), under which settings (DETAIL on and off, glibc's heap
# checks on and off) and how each launch is counted (ok, crash, exit,
# mismatch, timeout, other). STRESS_LAUNCH_TIMEOUT (default 400 s) bounds
# a launch; no iteration starts after STRESS_MAX_SECONDS (default 3600).
# The last line is the summary; the exit status is 0 only if every launch
# was ok.
set -euo pipefail

ITERATIONS="${1:-20}"
HOGS="${STRESS_HOGS:-$(nproc)}"
cd "$(dirname "$0")/.."

HOG_PIDS=()
stop_hogs() {
  for pid in "${HOG_PIDS[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
}
trap stop_hogs EXIT
for _ in $(seq "$HOGS"); do
  bash -c 'while :; do :; done' &
  HOG_PIDS+=("$!")
done

# Core files land in the crashing process's folder ("core" pattern).
ulimit -c unlimited 2>/dev/null || true
STRESS_ITERATIONS="$ITERATIONS" STRESS_HOGS="$HOGS" \
  python scripts/stress_collectives.py
