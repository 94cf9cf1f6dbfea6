"""The launches of `stress_collectives.sh`, counted by how they end.

Run by `scripts/stress_collectives.sh` (which starts the CPU hogs and
allows core dumps) from the repository root; the environment says how
many iterations (`STRESS_ITERATIONS`), the launch timeout
(`STRESS_LAUNCH_TIMEOUT`, 400 s) and when to stop starting iterations
(`STRESS_MAX_SECONDS`, 3600).

Each iteration launches, on 2 gloo processes each, the test workers of
`WORKERS` (through `harness.launch`: reports, DETAIL by default) and the
user scripts of `SCRIPTS` (through `harness.run_script`, as a user
launches them: the examples, the keras-hub LoRA fine-tune, a training
script that falls off its end). Iterations cycle through four settings:
`TORCH_DISTRIBUTED_DEBUG` `DETAIL` or `OFF`, each with and without
glibc's heap checks (`libc_malloc_debug.so` with `MALLOC_CHECK_=3`, and
`MALLOC_PERTURB_`, which fills freed memory so that a late read or write
of a freed buffer shows).

Every launch is counted as one of:
- `ok`;
- `crash`: a process killed by a signal or a native abort (glibc's heap
  checks, "terminate called", "Fatal Python error") while it worked;
- `exit`: the same after its work was done (every report written, or
  the script's last line printed): a non-zero exit at exit;
- `mismatch`: collectives that did not pair (DETAIL's "Detected mismatch
  between collectives", gloo's "Received data size doesn't match");
- `timeout`: the launch outlived its timeout;
- `other`: any other failure.

A failed launch's whole output is kept in `failure.txt` in its folder;
each core file a crash left is read with gdb (`thread apply all bt`)
into `native_stacks.txt` there, and removed. The last line is the
summary; the exit status is 0 only if every launch was ok.
"""

import glob
import os
import subprocess
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
# (script, arguments, the line a process prints when its work is done).
SCRIPTS = [
    ("examples/mlp_model_parallel.py", [], "losses:"),
    ("examples/gemma_lora.py", [], "generated:"),
    ("integration_tests/workers/exit_worker.py", ["end"], "predicted"),
]
SETTINGS = [
    ("DETAIL", False),
    ("OFF", False),
    ("DETAIL", True),
    ("OFF", True),
]
MALLOC_DEBUG = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
CRASHES = (
    "SIGABRT",
    "SIGSEGV",
    "SIGBUS",
    "SIGILL",
    "SIGFPE",
    "Signal 6",
    "Signal 11",
    "terminate called",
    "Fatal Python error",
    "malloc(",
    "free(",
    "double free",
    "corrupted",
)
MISMATCHES = (
    "Detected mismatch between collectives",
    "Received data size doesn't match",
)


def environment(debug, heap_checks):
    env = {
        "TORCH_DISTRIBUTED_DEBUG": debug,
        "PYTHONFAULTHANDLER": "1",
        "TORCH_SHOW_CPP_STACKTRACES": "1",
    }
    if heap_checks and os.path.exists(MALLOC_DEBUG):
        env.update(
            LD_PRELOAD=MALLOC_DEBUG, MALLOC_CHECK_="3", MALLOC_PERTURB_="165"
        )
    return env


def outcome(failure, work_done):
    text = failure.output or str(failure)
    if "did not finish within" in str(failure):
        return "timeout"
    if any(name in text for name in MISMATCHES):
        return "mismatch"
    if any(name in text for name in CRASHES):
        return "exit" if work_done else "crash"
    return "exit" if work_done else "other"


def launch_worker(worker, args, work, env, timeout):
    """Launches a test worker; returns the failure (or None) and whether
    every rank wrote its report."""
    try:
        harness.launch(
            worker,
            2,
            work,
            args=[a.format(work=work) for a in args],
            timeout=timeout,
            env=env,
        )
        return None, True
    except harness.WorkerFailure as failure:
        reports = glob.glob(os.path.join(work, "results_*", "rank*.json"))
        return failure, len(reports) == 2


def launch_script(script, args, done_line, work, env, timeout):
    """Launches a user script from `work`; returns the failure (or None)
    and whether every process printed `done_line`."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        harness.run_script(os.path.abspath(script), 2, args, timeout, work)
        return None, True
    except harness.WorkerFailure as failure:
        output = failure.output or ""
        done = sum(
            line.lstrip().startswith("[rank")
            and done_line in line
            or line.startswith(done_line)
            for line in output.splitlines()
        )
        return failure, done >= 2
    finally:
        os.environ.clear()
        os.environ.update(saved)


def keep_failure(work, failure, since):
    """Keeps the launch's whole output and the native stacks of its core
    files (those written since `since`, here or in `work`)."""
    with open(os.path.join(work, "failure.txt"), "w") as f:
        f.write(str(failure))
        f.write("\n===== whole output =====\n")
        f.write(failure.output or "")
    cores = [
        path
        for folder in (".", work)
        for path in glob.glob(os.path.join(folder, "core*"))
        if os.path.getmtime(path) >= since
    ]
    for core in cores:
        stacks = subprocess.run(
            ["gdb", "-batch", "-ex", "thread apply all bt", sys.executable]
            + [core],
            capture_output=True,
            text=True,
            timeout=300,
        )
        with open(os.path.join(work, "native_stacks.txt"), "a") as f:
            f.write(f"===== {core} =====\n{stacks.stdout}\n{stacks.stderr}\n")
        os.remove(core)


def launches():
    for worker, args in WORKERS:
        yield (
            worker,
            lambda work, env, t, w=worker, a=args: launch_worker(
                w, a, work, env, t
            ),
        )
    for script, args, done_line in SCRIPTS:
        name = os.path.basename(script)
        yield (
            name,
            lambda work, env, t, s=script, a=args, d=done_line: launch_script(
                s, a, d, work, env, t
            ),
        )


def main():
    iterations = int(os.environ["STRESS_ITERATIONS"])
    timeout = int(os.environ.get("STRESS_LAUNCH_TIMEOUT", "400"))
    max_seconds = float(os.environ.get("STRESS_MAX_SECONDS", "3600"))
    counts = dict.fromkeys(
        ("ok", "crash", "exit", "mismatch", "timeout", "other"), 0
    )
    start = time.monotonic()
    total = 0
    for iteration in range(1, iterations + 1):
        if time.monotonic() - start > max_seconds:
            break
        debug, heap_checks = SETTINGS[(iteration - 1) % len(SETTINGS)]
        env = environment(debug, heap_checks)
        for name, launch in launches():
            work = tempfile.mkdtemp(prefix="stress_")
            launch_start = time.monotonic()
            since = time.time()
            failure, work_done = launch(work, env, timeout)
            result = "ok" if failure is None else outcome(failure, work_done)
            if failure is not None:
                keep_failure(work, failure, since)
                print(str(failure)[-3000:], flush=True)
                print(f"kept: {work}/failure.txt", flush=True)
            counts[result] += 1
            total += 1
            print(
                f"iteration {iteration} {name} debug={debug} "
                f"heap_checks={heap_checks}: {result} "
                f"({time.monotonic() - launch_start:.0f} s)",
                flush=True,
            )
    summary = " ".join(f"{key}={value}" for key, value in counts.items())
    print(
        f"stress: {total} launches, {os.environ.get('STRESS_HOGS')} CPU "
        f"hogs, {time.monotonic() - start:.0f} s: {summary}",
        flush=True,
    )
    return 0 if counts["ok"] == total else 1


if __name__ == "__main__":
    sys.exit(main())
