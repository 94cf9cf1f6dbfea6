"""Launches gloo worker processes under a hard timeout and collects results.

A worker is a script in `integration_tests/workers/`. It runs under
`torch.distributed.run` (torchrun) on a fresh local port, performs its
checks, and reports values with `report(...)`; the test process then
compares the reports of all ranks, with each other and with a
single-process reference. A hang fails the launch at `timeout` seconds.
"""

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np

WORKERS_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "workers"
)
RESULT_DIR_ENV = "KERAS_DTENSOR_TEST_RESULT_DIR"
# Set to 1 to run the workers on NCCL, one visible GPU per process.
NCCL_ENV_VAR = "KERAS_DTENSOR_TEST_NCCL"


def require(module_name):
    """Imports `module_name` for a test file that needs it.

    Outside CI, a test file whose optional dependency (keras-hub, grain)
    is not installed is skipped. CI (`CI` set) installs every test
    requirement, so there a failed import fails the file: a broken
    install is never hidden as a skip.
    """
    if os.environ.get("CI"):
        return importlib.import_module(module_name)
    import pytest

    return pytest.importorskip(module_name)


class WorkerFailure(AssertionError):
    """A launch failed, timed out, or a rank reported nothing.

    The message holds the tail of the launch's output; `output` holds all
    of it (stdout, then stderr), or None.
    """

    def __init__(self, message, output=None):
        super().__init__(message)
        self.output = output


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
    _run_torchrun(
        os.path.join(WORKERS_DIR, worker),
        nprocs,
        [*_rendezvous_args(torchrun_args), *torchrun_args],
        [str(a) for a in args],
        worker_env(result_dir, timeout, env, nprocs=nprocs),
        timeout,
    )
    return [_read_report(result_dir, rank, worker) for rank in range(nprocs)]


def run_script(script, nprocs, args, timeout, root):
    """Runs `script` (a path) with `args` under torchrun on `nprocs` gloo
    processes on a fresh port, from the folder `root`, as a user launches
    a benchmark: no worker report, one thread per process, collectives
    bounded by `KERAS_DTENSOR_TIMEOUT_SECONDS` (120 s).

    Raises:
        WorkerFailure: it did not finish within `timeout` seconds, or it
            exited with a non-zero status.
    """
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    env["KERAS_DTENSOR_TIMEOUT_SECONDS"] = "120"
    _run_torchrun(
        script,
        nprocs,
        ["--master_addr=127.0.0.1", f"--master_port={free_port()}"],
        args,
        env,
        timeout,
        cwd=root,
    )


def _run_torchrun(script, nprocs, torchrun_args, args, env, timeout, cwd=None):
    """Runs `script` under torchrun on `nprocs` processes on this machine.

    Raises:
        WorkerFailure: it did not finish within `timeout` seconds (the
            whole process group is killed), or exited with a non-zero
            status.
    """
    name = os.path.basename(script)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nprocs}",
        "--nnodes=1",
        *torchrun_args,
        script,
        *args,
    ]
    try:
        completed = subprocess.run(
            command,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as error:
        raise WorkerFailure(
            f"{name} on {nprocs} processes did not finish within "
            f"{timeout}s.\n{_tail(error.stdout)}\n{_tail(error.stderr)}",
            output=_whole(error.stdout, error.stderr),
        ) from None
    if completed.returncode != 0:
        raise WorkerFailure(
            f"{name} on {nprocs} processes exited with "
            f"{completed.returncode}.\n{_tail(completed.stdout)}\n"
            f"{_tail(completed.stderr)}",
            output=_whole(completed.stdout, completed.stderr),
        )


def launch_reference_and_runs(
    worker, tmp_path_factory, reference_args, runs, timeout=240, env=None
):
    """Runs `worker` once on one process, then once per process count.

    Args:
        worker: file name of the worker script in `integration_tests/workers`.
        tmp_path_factory: pytest's `tmp_path_factory`.
        reference_args: the worker's arguments for the single-process
            reference launch.
        runs: a dict of process count to the worker's arguments for that
            launch.
        timeout: hard limit in seconds for each launch.
        env: extra environment variables for the multi-process launches.

    Returns:
        `(reference, reports)`: the single-process report, and a dict of
        process count to the list of every rank's report.
    """
    name = os.path.splitext(worker)[0]
    (reference,) = launch(
        worker,
        1,
        tmp_path_factory.mktemp(f"{name}_reference"),
        args=list(reference_args),
        timeout=timeout,
    )
    reports = {
        nprocs: launch(
            worker,
            nprocs,
            tmp_path_factory.mktemp(f"{name}_{nprocs}"),
            args=list(args),
            timeout=timeout,
            env=env,
        )
        for nprocs, args in runs.items()
    }
    return reference, reports


def assert_losses_match(reports, reference, rtol):
    """Every rank's per-step losses have the reference's count and agree
    with them within `rtol` (relative)."""
    expected = np.asarray(reference["batch_losses"])
    for report in reports:
        losses = np.asarray(report["batch_losses"])
        assert losses.shape == expected.shape
        np.testing.assert_allclose(losses, expected, rtol=rtol)


def launch_references_first(
    worker, nprocs, tmp_path, references, runs, timeout=240, env=None
):
    """Runs `worker` once on `nprocs` processes: `references`, then `runs`.

    The reference runs train without a distribution, so every process
    runs each of them by itself, before any distributed run: the same
    numbers as a one-process launch of them, without that launch's start.
    Each reference run's values (reported under `<name>/`) must be equal
    on every process.

    Args:
        worker: file name of the worker script in `integration_tests/workers`.
        nprocs: number of processes.
        tmp_path: a folder for the results.
        references: the worker's arguments for the reference runs, each
            also the prefix of its reported values.
        runs: the worker's arguments for the distributed runs.
        timeout: hard limit in seconds for the launch.
        env: extra environment variables.

    Returns:
        A list with one dict per rank, holding every run's values.
    """
    reports = launch(
        worker,
        nprocs,
        tmp_path,
        args=[*references, *runs],
        timeout=timeout,
        env=env,
    )
    for name in references:
        values = [run_values(report, name) for report in reports]
        if not values[0]:
            raise WorkerFailure(f"The reference run {name} reported nothing.")
        for rank, other in enumerate(values[1:], start=1):
            if other != values[0]:
                raise WorkerFailure(
                    f"The reference run {name} differs between processes "
                    f"0 and {rank}."
                )
    return reports


def run_values(report, name):
    """The values that one rank reported under `<name>/`, unprefixed."""
    prefix = name + "/"
    return {
        k[len(prefix) :]: v for k, v in report.items() if k.startswith(prefix)
    }


def _rendezvous_args(torchrun_args):
    if "--standalone" in torchrun_args:
        return []
    return ["--master_addr=127.0.0.1", f"--master_port={free_port()}"]


# The `TORCH_DISTRIBUTED_DEBUG` level of the workers, if not `DETAIL`.
DEBUG_ENV_VAR = "KERAS_DTENSOR_TEST_DISTRIBUTED_DEBUG"


def worker_env(
    result_dir, timeout, env=None, base=None, nprocs=1, gpu_count=None
):
    """The environment of a launch's workers.

    Workers use the torch backend, one thread each, the collective timeout
    `KERAS_DTENSOR_TIMEOUT_SECONDS` (half the launch's, at least 30 s) and
    `TORCH_DISTRIBUTED_DEBUG=DETAIL`: before each collective, torch checks
    that every rank issues the same operation on the same shapes, and fails
    naming both otherwise (`DEBUG_ENV_VAR` in `base` sets another level:
    `scripts/upstream_patches.sh` runs the patched keras, whose workers'
    single-process references build DDP, which torch 2.13.0 cannot
    construct over gloo under `DETAIL`). `PYTHONFAULTHANDLER=1` makes a
    worker killed by
    a signal print its Python stacks. Workers run on CPU and gloo whatever
    GPUs are visible (`CUDA_VISIBLE_DEVICES` is emptied), unless
    `NCCL_ENV_VAR` (`KERAS_DTENSOR_TEST_NCCL=1`) is set in `base` and there
    are at least `nprocs` GPUs: then the visible GPUs are kept and
    `initialize()` uses NCCL, one GPU per process.

    Args:
        result_dir: the folder the workers write their reports to.
        timeout: the launch's hard limit in seconds.
        env: extra variables, applied last.
        base: the environment to start from (default `os.environ`).
        nprocs: the number of processes of one node of the launch.
        gpu_count: the number of visible GPUs (default: as torch counts
            them, asked only when NCCL is requested).

    Returns:
        A dict of environment variables.
    """
    process_env = dict(os.environ if base is None else base)
    process_env.update(
        {
            "KERAS_BACKEND": "torch",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "KERAS_DTENSOR_TIMEOUT_SECONDS": str(max(30, timeout // 2)),
            "TORCH_DISTRIBUTED_DEBUG": process_env.get(DEBUG_ENV_VAR, "DETAIL"),
            # The workers' single-process references train without a
            # distribution: no DDP (a later keras would build one).
            "KERAS_DTENSOR_NO_DDP": "1",
            # A worker killed by a signal (SIGABRT, SIGSEGV) prints the
            # Python stacks of its threads.
            "PYTHONFAULTHANDLER": "1",
            RESULT_DIR_ENV: result_dir,
        }
    )
    if not _use_nccl(process_env, nprocs, gpu_count):
        process_env["CUDA_VISIBLE_DEVICES"] = ""
    process_env.update(env or {})
    return process_env


def _use_nccl(process_env, nprocs, gpu_count):
    """Whether NCCL was asked for and there is one GPU per process."""
    if process_env.get(NCCL_ENV_VAR) != "1":
        return False
    if gpu_count is None:
        import torch

        gpu_count = torch.cuda.device_count()
    return gpu_count >= nprocs


def _read_report(result_dir, rank, worker):
    path = os.path.join(result_dir, f"rank{rank}.json")
    if not os.path.exists(path):
        raise WorkerFailure(f"{worker}: rank {rank} reported nothing.")
    with open(path) as f:
        return json.load(f)


def _whole(stdout, stderr):
    """A launch's whole output: stdout, then stderr."""
    parts = []
    for text in (stdout, stderr):
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        parts.append(text or "")
    return "\n".join(parts)


def _tail(text, lines=60):
    if not text:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def launch_multi_node(
    worker,
    nnodes,
    tmp_path,
    args=(),
    timeout=240,
    env=None,
    nproc_per_node=1,
):
    """Runs `workers/<worker>` as `nnodes` torchrun invocations ("nodes").

    Each node is its own `torchrun --nnodes=<nnodes>` on this machine, and
    the nodes meet through a c10d rendezvous on 127.0.0.1, as torchrun on
    separate machines would. All nodes share one hard timeout: on timeout,
    or as soon as one node fails, the process groups of all nodes are
    killed.

    Args:
        worker: file name of the worker script in `integration_tests/workers`.
        nnodes: number of torchrun invocations.
        tmp_path: a folder for the results and the nodes' logs.
        args: extra command-line arguments for the worker.
        timeout: hard limit in seconds for the whole launch.
        env: extra environment variables.
        nproc_per_node: processes started by each invocation.

    Returns:
        A list with one dict per global rank: what that rank passed to
        `report`.
    """
    result_dir = os.path.join(
        str(tmp_path), f"results_{worker}_{nnodes}x{nproc_per_node}_nodes"
    )
    os.makedirs(result_dir, exist_ok=True)
    port = free_port()
    process_env = worker_env(result_dir, timeout, env, nprocs=nproc_per_node)
    log_paths = [
        os.path.join(result_dir, f"node{node}.log") for node in range(nnodes)
    ]
    nodes = []
    try:
        for node, log_path in enumerate(log_paths):
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nnodes}",
                f"--nproc_per_node={nproc_per_node}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                f"--rdzv_id=keras-dtensor-{port}",
                f"--rdzv_conf=is_host={int(node == 0)}",
                "--local_addr=127.0.0.1",
                os.path.join(WORKERS_DIR, worker),
                *[str(a) for a in args],
            ]
            with open(log_path, "w") as log:
                nodes.append(
                    subprocess.Popen(
                        command,
                        env=process_env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        failure = _wait_for_nodes(nodes, timeout)
    finally:
        for process in nodes:
            _kill_node(process)
    if failure:
        logs = []
        for node, log_path in enumerate(log_paths):
            with open(log_path, errors="replace") as f:
                logs.append(f"--- node {node} ---\n{_tail(f.read())}")
        raise WorkerFailure(
            f"{worker} on {nnodes} nodes {failure}.\n" + "\n".join(logs)
        )
    return [
        _read_report(result_dir, rank, worker)
        for rank in range(nnodes * nproc_per_node)
    ]


def _wait_for_nodes(nodes, timeout):
    """Waits for all nodes; returns why they failed, or None."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [process.poll() for process in nodes]
        failed = [
            (node, code)
            for node, code in enumerate(codes)
            if code not in (0, None)
        ]
        if failed:
            node, code = failed[0]
            return f"failed: node {node} exited with {code}"
        if all(code == 0 for code in codes):
            return None
        if time.monotonic() > deadline:
            return f"did not finish within {timeout}s"
        time.sleep(0.2)


def _kill_node(process):
    """Kills a node's torchrun and its workers.

    torchrun starts each worker in a session of its own, so the worker
    process groups are killed one by one, after torchrun is stopped so
    that it cannot start new ones.
    """
    if process.poll() is not None:
        return
    _signal_group(process.pid, signal.SIGSTOP)
    for pid in _child_pids(process.pid):
        _signal_group(pid, signal.SIGKILL)
    _signal_group(process.pid, signal.SIGKILL)
    process.wait()


def _signal_group(pid, signum):
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _child_pids(parent):
    """Ids of the live child processes of `parent` (empty without /proc)."""
    if not os.path.isdir("/proc"):
        return []
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name is in parentheses and may contain spaces.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == parent:
            children.append(int(entry))
    return children
