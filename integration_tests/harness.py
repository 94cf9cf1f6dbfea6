"""Launches gloo worker processes under a hard timeout and collects results.

A worker is a script in `integration_tests/workers/`. It runs under
`torch.distributed.run` (torchrun) on a fresh local port, performs its
checks, and reports values with `report(...)`; the test process then
compares the reports of all ranks, with each other and with a
single-process reference. A hang fails the launch at `timeout` seconds.
"""

import json
import os
import socket
import subprocess
import sys

WORKERS_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "workers"
)
RESULT_DIR_ENV = "KERAS_DTENSOR_TEST_RESULT_DIR"


class WorkerFailure(AssertionError):
    """A launch failed, timed out, or a rank reported nothing."""


def free_port():
    """Returns a local TCP port that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    worker, nprocs, tmp_path, args=(), timeout=240, env=None, torchrun_args=()
):
    """Runs `workers/<worker>` on `nprocs` gloo processes.

    Args:
        worker: file name of the worker script in `integration_tests/workers`.
        nprocs: number of processes.
        tmp_path: a folder for the results (pytest's `tmp_path`).
        args: extra command-line arguments for the worker.
        timeout: hard limit in seconds for the whole launch.
        env: extra environment variables.
        torchrun_args: extra torchrun options, e.g. `["--max-restarts=1"]`.
            With `--standalone`, torchrun picks the rendezvous itself
            (no fixed master port), which restarts need: with one store for
            all attempts, restarted workers find the killed ones' addresses
            (see also `TORCH_DISABLE_SHARE_RDZV_TCP_STORE`).

    Returns:
        A list with one dict per rank: what that rank passed to `report`.
    """
    result_dir = os.path.join(str(tmp_path), f"results_{worker}_{nprocs}")
    os.makedirs(result_dir, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nprocs}",
        "--nnodes=1",
        *_rendezvous_args(torchrun_args),
        *torchrun_args,
        os.path.join(WORKERS_DIR, worker),
        *[str(a) for a in args],
    ]
    process_env = dict(os.environ)
    process_env.update(
        {
            "KERAS_BACKEND": "torch",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "KERAS_DTENSOR_TIMEOUT_SECONDS": str(max(30, timeout // 2)),
            RESULT_DIR_ENV: result_dir,
        }
    )
    process_env.update(env or {})
    try:
        completed = subprocess.run(
            command,
            env=process_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as error:
        raise WorkerFailure(
            f"{worker} on {nprocs} processes did not finish within "
            f"{timeout}s.\n{_tail(error.stdout)}\n{_tail(error.stderr)}"
        ) from None
    if completed.returncode != 0:
        raise WorkerFailure(
            f"{worker} on {nprocs} processes exited with "
            f"{completed.returncode}.\n{_tail(completed.stdout)}\n"
            f"{_tail(completed.stderr)}"
        )
    return [_read_report(result_dir, rank, worker) for rank in range(nprocs)]


def _rendezvous_args(torchrun_args):
    if "--standalone" in torchrun_args:
        return []
    return ["--master_addr=127.0.0.1", f"--master_port={free_port()}"]


def _read_report(result_dir, rank, worker):
    path = os.path.join(result_dir, f"rank{rank}.json")
    if not os.path.exists(path):
        raise WorkerFailure(f"{worker}: rank {rank} reported nothing.")
    with open(path) as f:
        return json.load(f)


def _tail(text, lines=60):
    if not text:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])
