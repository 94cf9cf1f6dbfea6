#!/usr/bin/env bash
# Stress test of collectives in lockstep, on a loaded machine.
#
# Usage: scripts/stress_collectives.sh [ITERATIONS]   (default 20)
#
# Each iteration launches the training, metrics, callbacks, checkpoint and
# (fully sharded) collectives workers of integration_tests/ on 2 gloo
# processes each (through
# integration_tests/harness.py: CPU, a fresh port, a hard timeout), while
# STRESS_HOGS busy loops (default: one per CPU core) load the machine.
# Odd iterations run with TORCH_DISTRIBUTED_DEBUG=DETAIL (the harness's
# default: a mismatched collective fails naming both ops), even ones with
# it OFF, as a user runs (a mismatch there is a gloo abort or a hang).
# Every launch is counted as ok, abort (a rank killed by a signal: SIGABRT,
# SIGSEGV, SIGBUS, SIGILL, SIGFPE; or gloo's "Received data size doesn't
# match expected size"), timeout (the launch outlived
# STRESS_LAUNCH_TIMEOUT, default 400 s) or other failure; a failed
# launch's whole output (workers run with PYTHONFAULTHANDLER=1) is kept in
# failure.txt in its directory. No iteration starts after
# STRESS_MAX_SECONDS (default 3600) have passed.
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

STRESS_ITERATIONS="$ITERATIONS" STRESS_HOGS="$HOGS" python - <<'PYTHON'
import os
import sys
import tempfile
import time

sys.path.insert(0, "integration_tests")
import harness  # noqa: E402

WORKERS = [
    ("training_worker.py", ["dp:mlp:adamw:dropout", "mp:transformer:sgd"]),
    ("metrics_worker.py", ["dp", "mp"]),
    ("callbacks_worker.py", ["dp", "mp"]),
    ("checkpoint_callbacks_worker.py", ["{work}", "dp,mp"]),
    # Fully sharded steps: unit gathers in forward (issued ahead) and
    # again in backward.
    ("collectives_worker.py", ["fsdpflat:adamw", "fsdp:sgd", "fsdpremat:sgd"]),
]
iterations = int(os.environ["STRESS_ITERATIONS"])
launch_timeout = int(os.environ.get("STRESS_LAUNCH_TIMEOUT", "400"))
max_seconds = float(os.environ.get("STRESS_MAX_SECONDS", "3600"))


SIGNALS = ("SIGABRT", "SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE")


def outcome(failure):
    text = str(failure)
    if "did not finish within" in text:
        return "timeout"
    if any(name in text for name in SIGNALS) or "Received data size" in text:
        return "abort"
    return "other"


counts = {"ok": 0, "abort": 0, "timeout": 0, "other": 0}
start = time.monotonic()
done = 0
for iteration in range(1, iterations + 1):
    if time.monotonic() - start > max_seconds:
        break
    debug = "DETAIL" if iteration % 2 else "OFF"
    for worker, args in WORKERS:
        work = tempfile.mkdtemp(prefix="stress_")
        launch_start = time.monotonic()
        try:
            harness.launch(
                worker,
                2,
                work,
                args=[a.format(work=work) for a in args],
                timeout=launch_timeout,
                env={"TORCH_DISTRIBUTED_DEBUG": debug},
            )
            result = "ok"
        except harness.WorkerFailure as failure:
            result = outcome(failure)
            # The whole output (every rank's message), kept for diagnosis.
            with open(os.path.join(work, "failure.txt"), "w") as f:
                f.write(str(failure))
                f.write("\n===== whole output =====\n")
                f.write(failure.output or "")
            print(str(failure)[-3000:], flush=True)
            print(f"whole output: {work}/failure.txt", flush=True)
        counts[result] += 1
        print(
            f"iteration {iteration} {worker} debug={debug}: {result} "
            f"({time.monotonic() - launch_start:.0f} s)",
            flush=True,
        )
    done = iteration
print(
    f"stress: {done} iterations x {len(WORKERS)} workers, "
    f"{os.environ['STRESS_HOGS']} CPU hogs, "
    f"{time.monotonic() - start:.0f} s: ok={counts['ok']} "
    f"aborts={counts['abort']} timeouts={counts['timeout']} "
    f"other failures={counts['other']}",
    flush=True,
)
sys.exit(0 if counts["ok"] == done * len(WORKERS) else 1)
PYTHON
