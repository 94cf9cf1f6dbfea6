"""Benchmarks Keras distributed training on torch against native PyTorch.

Run under torchrun, from the repository root:

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 benchmarks/run.py

Every workload (MLP, transformer blocks, tiny Llama) runs in every mode:
single process, DataParallel, ModelParallel (tensor parallel), 2-D
(batch x model) and fully sharded. Each cell compares Keras with the same
model in plain PyTorch using PyTorch's own parallelism, measured in the
same run, and with the theoretical limits (see benchmarks/README.md).
Single-process cells and the mount-overhead measurement run on rank 0, in
subprocesses, while the other ranks wait.

Results go to `--out` (default `benchmarks/results/`): `<tag>.json`,
`<tag>.md` (the tables) and `<tag>.png` (a chart, when matplotlib is
installed).
"""

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import cell  # noqa: E402
import report  # noqa: E402
import single  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import workloads  # noqa: E402

import keras  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results")

# Environment variables of torchrun that must not reach the single-process
# subprocesses (they would make them join the process group).
TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)

# Starts `single.py` with the keras-dtensor mount removed (or kept) before
# keras is imported: its start-up hook, which would arm it at the first
# keras import, and its finder. Both variants start Python the same way.
_SINGLE_BOOT = (
    "import runpy, sys\n"
    "if {disable}:\n"
    "    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__\n"
    "        not in ('KerasOverlayFinder', 'KerasImportHook')]\n"
    "sys.path.insert(0, {here!r})\n"
    "sys.argv = ['single.py'] + sys.argv[1:]\n"
    "runpy.run_path({script!r}, run_name='__main__')\n"
)


def parse_args(argv=None):
    """Command-line flags."""
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = workloads.Config()
    parser.add_argument(
        "--workload",
        default=",".join(workloads.WORKLOADS),
        help="Comma-separated workloads: mlp, transformer, llama.",
    )
    parser.add_argument(
        "--modes",
        default=",".join(workloads.MODES),
        help="Comma-separated modes: single, dp, tp, 2d, fsdp.",
    )
    for field in ("hidden", "layers", "batch", "seq", "heads", "vocab"):
        parser.add_argument(
            f"--{field}", type=int, default=getattr(defaults, field)
        )
    parser.add_argument(
        "--optimizer", default=defaults.optimizer, choices=("sgd", "adamw")
    )
    parser.add_argument("--steps", type=int, default=20, help="Timed steps.")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--jit",
        action="store_true",
        help="Also time the Keras model with jit_compile=True (slow to "
        "compile on CPU).",
    )
    parser.add_argument(
        "--no-overhead",
        dest="overhead",
        action="store_false",
        help="Skip the mount-overhead measurement.",
    )
    parser.add_argument(
        "--single-timeout",
        type=int,
        default=1800,
        help="Hard limit in seconds for the single-process phase.",
    )
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument(
        "--tag", default=None, help="Output file name (default: n<world>)."
    )
    return parser.parse_args(argv)


def config_from(args):
    """The `workloads.Config` of the command line."""
    return workloads.Config(
        hidden=args.hidden,
        layers=args.layers,
        batch=args.batch,
        seq=args.seq,
        heads=args.heads,
        vocab=args.vocab,
        optimizer=args.optimizer,
    )


def machine_info():
    """The machine, for the report."""
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "keras": keras.__version__,
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "cuda": (
            torch.cuda.get_device_name() if torch.cuda.is_available() else None
        ),
        "backend": dist.get_backend() if dist.is_initialized() else None,
    }
    info["load_average"] = list(os.getloadavg())
    return info


def code_state():
    """The commit measured and the library files changed on top of it.

    Returns:
        A dict with `commit` (None outside a git checkout) and `modified`,
        the uncommitted paths under `keras/` and `keras_dtensor/`.
    """
    root = os.path.dirname(HERE)

    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=30
        ).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip() or None
        status = git("status", "--porcelain", "--", "keras", "keras_dtensor")
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "modified": []}
    modified = sorted(line[3:] for line in status.splitlines() if line)
    return {"commit": commit, "modified": modified}


def _cpu_model():
    try:
        output = subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor()
    for line in output.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def single_command(disable_mount, workload_list, config, args, jit):
    """The command line of one `single.py` step server."""
    boot = _SINGLE_BOOT.format(
        disable=bool(disable_mount),
        here=HERE,
        script=os.path.join(HERE, "single.py"),
    )
    command = [
        sys.executable,
        "-c",
        boot,
        "--workload",
        ",".join(workload_list),
        "--config",
        json.dumps(dataclasses.asdict(config)),
        "--warmup",
        str(args.warmup),
        "--seed",
        str(args.seed),
    ]
    if jit:
        command.append("--jit")
    return command


class ServerError(RuntimeError):
    """A step server failed, exited or ran out of time."""


class StepServer:
    """A `single.py` subprocess that runs training steps on request.

    Args:
        disable_mount: whether the keras-dtensor mount is removed before
            keras is imported in the subprocess.
        workload_list: the workloads it serves, in order.
        config: a `workloads.Config`.
        args: the command-line flags (warm-up, seed, timeout).
        jit: whether it also builds the `jit_compile=True` model.
    """

    def __init__(self, disable_mount, workload_list, config, args, jit):
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
        env["KERAS_BACKEND"] = "torch"
        self.timeout = args.single_timeout
        self.deadline = time.monotonic() + self.timeout
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            single_command(disable_mount, workload_list, config, args, jit),
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            start_new_session=True,
        )
        self.messages = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            if line.startswith(single.MARKER):
                self.messages.put(json.loads(line[len(single.MARKER) :]))
        self.messages.put(None)

    def receive(self):
        """The next protocol message; raises `ServerError` on failure."""
        remaining = max(self.deadline - time.monotonic(), 0.0)
        try:
            message = self.messages.get(timeout=remaining)
        except queue.Empty:
            raise ServerError(f"timed out after {self.timeout}s") from None
        if message is None:
            code = self.process.wait()
            self.stderr.seek(0)
            lines = self.stderr.read().strip().splitlines() or [""]
            raise ServerError(f"exit {code}: {lines[-1][:200]}")
        return message

    def command(self, line):
        """Sends one line to the server."""
        try:
            self.process.stdin.write(line + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as error:
            raise ServerError(f"the step server is gone: {error}") from None

    def step(self, name):
        """Runs one step named `name`; returns its time in seconds."""
        self.command(name)
        message = self.receive()
        if "error" in message:
            raise ServerError(message["error"])
        return message["time"]

    def close(self):
        """Ends the subprocess (killing it if it does not exit)."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.stderr.close()


def single_phase(workload_list, config, args, with_single):
    """Single-process cells and the mount overhead (rank 0 only).

    Two step servers run side by side, the mount enabled (`on`) and
    disabled (`off`). Their steps are timed in alternation (off then on,
    then on then off, ...), so that the overhead is a paired comparison.

    Returns:
        `(single_cells, overhead_rows)`.
    """
    servers = {"on": StepServer(False, workload_list, config, args, args.jit)}
    if args.overhead:
        servers["off"] = StepServer(True, workload_list, config, args, False)
    single_cells, overhead = [], []
    try:
        for workload in workload_list:
            cells, times = _serve_workload(servers, workload, args.steps)
            if with_single:
                single_cells.append(cells["on"])
            if args.overhead:
                overhead.append(_overhead_row(workload, cells, times))
    finally:
        for server in servers.values():
            server.close()
    return single_cells, overhead


def _serve_workload(servers, workload, count):
    """Times `count` alternating steps of one workload on every server."""
    cells, names = {}, {}
    for key, server in servers.items():
        try:
            message = server.receive()
            cells[key], names[key] = message["ready"], message["steps"]
        except ServerError as error:
            cells[key] = cell.new_cell(workload, "single")
            cells[key].update({"world": 1, "error": str(error)})
    times = {key: {name: [] for name in names.get(key, ())} for key in servers}
    keys = list(names)
    try:
        for i in range(count):
            order = keys if i % 2 == 0 else keys[::-1]
            for name in ("keras", "native", "keras_jit"):
                for key in order:
                    if name in names[key] and "error" not in cells[key]:
                        times[key][name].append(servers[key].step(name))
    except ServerError as error:
        cells[key].setdefault("error", str(error))
    for key in keys:
        try:
            servers[key].command("next")
        except ServerError as error:
            cells[key].setdefault("error", str(error))
        if "error" not in cells[key]:
            try:
                cell.finish(cells[key], times[key])
            except ValueError as error:
                cells[key]["error"] = str(error)
    return cells, times


def _quartiles(values):
    if len(values) < 2:
        return [values[0]] * 3 if values else [math.nan] * 3
    return statistics.quantiles(values, n=4, method="inclusive")


def _overhead_row(workload, cells, times):
    """Keras with the package mounted vs plain keras, paired step by step."""
    row = {"workload": workload}
    errors = [c["error"] for c in cells.values() if "error" in c]
    if errors:
        row["error"] = errors[0]
        return row
    on, off = times["on"], times["off"]
    keras = [a / b for a, b in zip(on["keras"], off["keras"])]
    native = [a / b for a, b in zip(on["native"], off["native"])]
    # Dividing by the native ratio of the same pair removes what makes one
    # process faster than the other for any work (scheduling, placement).
    corrected = [k / n for k, n in zip(keras, native)]
    keras_q, native_q = _quartiles(keras), _quartiles(native)
    corrected_q = _quartiles(corrected)
    row.update(
        {
            "keras_off_ms": 1000.0 * statistics.median(off["keras"]),
            "keras_on_ms": 1000.0 * statistics.median(on["keras"]),
            "ratio": keras_q[1],
            "ratio_quartiles": [keras_q[0], keras_q[2]],
            "native_ratio": native_q[1],
            "native_quartiles": [native_q[0], native_q[2]],
            "corrected_ratio": corrected_q[1],
            "corrected_quartiles": [corrected_q[0], corrected_q[2]],
            "within_noise": corrected_q[0] <= 1.0 <= corrected_q[2],
            "python_calls": {
                key: cells[key]["python_calls"]["keras"] for key in cells
            },
            "pairs": len(keras),
            "mount": {key: cells[key].get("mount") for key in cells},
        }
    )
    return row


def local_batch_config(config, world, modes):
    """The config of the local-batch cells, or None where none run.

    Under data parallelism each process computes on `batch / world`
    examples. A local-batch cell runs the single-process Keras model and
    its plain torch twin on that many examples, in every process at once
    and without communication: what a data-parallel step would cost if
    distributing added nothing but DDP's communication, under the same
    sharing of the machine's cores.
    """
    if world == 1 or "dp" not in modes or config.batch % world:
        return None
    return dataclasses.replace(config, batch=config.batch // world)


def _wait_group(args):
    """A gloo group whose timeout covers the single-process phase."""
    seconds = args.single_timeout + 120
    return dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=seconds)
    )


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    keras.distribution.initialize()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    config = config_from(args)
    workload_list = [w for w in args.workload.split(",") if w]
    modes = [m for m in args.modes.split(",") if m]
    for name in modes:
        if name not in workloads.MODES:
            raise SystemExit(f"Unknown mode {name!r}.")
    options = {
        "steps": args.steps,
        "warmup": args.warmup,
        "jit": args.jit,
        "seed": args.seed,
    }
    results = {
        "command": " ".join(
            ["torchrun", f"--nproc_per_node={world}"] + sys.argv
        ),
        "world": world,
        "config": dataclasses.asdict(config),
        "options": options,
        "machine": machine_info(),
        "code": code_state(),
        "cells": [],
        "overhead": [],
    }

    wait_group = _wait_group(args) if world > 1 else None
    if "single" in modes or args.overhead:
        if rank == 0:
            single_cells, overhead = single_phase(
                workload_list, config, args, "single" in modes
            )
            results["cells"] += single_cells
            results["overhead"] = overhead
        if wait_group is not None:
            dist.barrier(group=wait_group)

    local_config = local_batch_config(config, world, modes)
    results["local_cells"] = []
    for workload in workload_list:
        if local_config is not None:
            entry = cell.run_cell(workload, "single", local_config, options)
            entry["local_batch"] = local_config.batch
            results["local_cells"].append(entry)
        for mode in modes:
            if mode == "single":
                continue
            entry = cell.run_cell(workload, mode, config, options)
            results["cells"].append(entry)
            if rank == 0:
                report.print_progress(entry)

    results["wall_s"] = time.perf_counter() - start
    results["machine"]["load_average_end"] = list(os.getloadavg())
    if rank == 0:
        tag = args.tag or f"n{world}"
        paths = report.write_all(results, args.out, tag)
        print(report.markdown(results))
        for path in paths:
            print(f"wrote {path}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
