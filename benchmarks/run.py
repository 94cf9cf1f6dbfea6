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
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import cell  # noqa: E402
import report  # noqa: E402
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
# keras is imported. Both variants start Python the same way.
_SINGLE_BOOT = (
    "import runpy, sys\n"
    "if {disable}:\n"
    "    sys.meta_path[:] = [f for f in sys.meta_path\n"
    "        if type(f).__name__ != 'KerasOverlayFinder']\n"
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
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--jit",
        action="store_true",
        help="Also time the Keras model with jit_compile=True (slow to "
        "compile on CPU).",
    )
    parser.add_argument(
        "--overhead-repeats",
        type=int,
        default=2,
        help="Pairs of single-process runs with the mount disabled and "
        "enabled for the overhead figure; 0 skips it.",
    )
    parser.add_argument(
        "--single-timeout",
        type=int,
        default=1800,
        help="Hard limit in seconds for each single-process subprocess.",
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


def single_command(disable_mount, workload_list, config, args, json_path, jit):
    """The subprocess command line of one single-process run."""
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
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--seed",
        str(args.seed),
        "--json",
        json_path,
    ]
    if jit:
        command.append("--jit")
    return command


def run_single(disable_mount, workload_list, config, args, jit):
    """Runs `single.py` in a subprocess; returns its JSON result.

    A failed or timed-out run returns `{"error": ...}`.
    """
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env["KERAS_BACKEND"] = "torch"
    with tempfile.TemporaryDirectory() as folder:
        json_path = os.path.join(folder, "single.json")
        command = single_command(
            disable_mount, workload_list, config, args, json_path, jit
        )
        try:
            completed = subprocess.run(
                command,
                env=env,
                capture_output=True,
                text=True,
                timeout=args.single_timeout,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.single_timeout}s"}
        if completed.returncode != 0 or not os.path.exists(json_path):
            tail = completed.stderr.strip().splitlines()[-1:] or [""]
            return {
                "error": f"exit {completed.returncode}: {tail[0][:200]}",
            }
        with open(json_path) as f:
            return json.load(f)


def single_phase(workload_list, config, args, with_single):
    """Single-process cells and the mount overhead (rank 0 only).

    The overhead runs alternate between mount disabled and enabled (off,
    on, on, off, ...), so that drifts of a shared machine cancel out. With
    `--jit`, one more run (mount enabled) times `jit_compile=True`.

    Returns:
        `(single_cells, overhead_rows)`.
    """
    order = []
    for i in range(max(args.overhead_repeats, 0)):
        order += [True, False] if i % 2 == 0 else [False, True]
    if not order and with_single:
        order = [False]
    runs = {True: [], False: []}
    for disable in order:
        runs[disable].append(
            run_single(disable, workload_list, config, args, jit=False)
        )
    jit_runs = []
    if args.jit and with_single:
        jit_runs.append(
            run_single(False, workload_list, config, args, jit=True)
        )
    single_cells = []
    if with_single:
        single_cells = _merge_single(runs[False], jit_runs, workload_list)
    overhead = []
    if args.overhead_repeats > 0:
        overhead = _overhead_rows(runs[True], runs[False], workload_list)
    return single_cells, overhead


def _cells_of(runs, workload):
    cells = []
    for run in runs:
        for entry in run.get("cells", []):
            if entry["workload"] == workload and "error" not in entry:
                cells.append(entry)
    return cells


def _run_errors(runs):
    return [run["error"] for run in runs if "error" in run]


def _merge_single(runs, jit_runs, workload_list):
    """One single-process cell per workload, step times pooled over runs.

    Eager step times pool the runs without jit; the `keras_jit` time (or
    `jit_error`) comes from the jit run.
    """
    merged = []
    for workload in workload_list:
        cells = _cells_of(runs, workload)
        if not cells:
            errors = _run_errors(runs) + [
                e["error"]
                for run in runs
                for e in run.get("cells", [])
                if e["workload"] == workload and "error" in e
            ]
            merged.append(
                {
                    "workload": workload,
                    "mode": "single",
                    "world": 1,
                    "error": errors[0] if errors else "no result",
                }
            )
            continue
        first = dict(cells[0])
        pooled = _pool(cells)
        for jit_cell in _cells_of(jit_runs, workload):
            if "keras_jit" in jit_cell["step_ms_all"]:
                pooled["keras_jit"] = jit_cell["step_ms_all"]["keras_jit"]
            if "jit_error" in jit_cell:
                first["jit_error"] = jit_cell["jit_error"]
        for run in jit_runs:
            if "error" in run:
                first["jit_error"] = run["error"]
        first["step_ms"] = {k: statistics.median(v) for k, v in pooled.items()}
        first["ratio"] = first["step_ms"]["keras"] / first["step_ms"]["native"]
        if "keras_jit" in first["step_ms"]:
            first["jit_speedup"] = (
                first["step_ms"]["keras"] / first["step_ms"]["keras_jit"]
            )
        first["runs"] = len(cells)
        merged.append(first)
    return merged


def _pool(cells):
    pooled = {}
    for entry in cells:
        for name, values in entry["step_ms_all"].items():
            pooled.setdefault(name, []).extend(values)
    return pooled


def _overhead_rows(off_runs, on_runs, workload_list):
    """Keras step time with the package mounted vs plain keras."""
    rows = []
    for workload in workload_list:
        off, on = _cells_of(off_runs, workload), _cells_of(on_runs, workload)
        mounts = {
            "off": [r.get("mount") for r in off_runs],
            "on": [r.get("mount") for r in on_runs],
        }
        if not off or not on:
            errors = _run_errors(off_runs + on_runs)
            rows.append(
                {
                    "workload": workload,
                    "error": errors[0] if errors else "no result",
                }
            )
            continue
        pooled_off, pooled_on = _pool(off), _pool(on)
        keras_off = statistics.median(pooled_off["keras"])
        keras_on = statistics.median(pooled_on["keras"])
        native_off = statistics.median(pooled_off["native"])
        native_on = statistics.median(pooled_on["native"])
        run_medians = [
            statistics.median(c["step_ms_all"]["keras"]) for c in off + on
        ]
        rows.append(
            {
                "workload": workload,
                "keras_off_ms": keras_off,
                "keras_on_ms": keras_on,
                "ratio": keras_on / keras_off,
                "native_ratio": native_on / native_off,
                "run_spread": (max(run_medians) - min(run_medians))
                / statistics.median(run_medians),
                "runs": [len(off), len(on)],
                "mount": mounts,
            }
        )
    return rows


def _wait_group(args):
    """A gloo group whose timeout covers the single-process phase."""
    seconds = args.single_timeout * (2 * max(args.overhead_repeats, 1) + 1)
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
        "cells": [],
        "overhead": [],
    }

    wait_group = _wait_group(args) if world > 1 else None
    if "single" in modes or args.overhead_repeats > 0:
        if rank == 0:
            single_cells, overhead = single_phase(
                workload_list, config, args, "single" in modes
            )
            results["cells"] += single_cells
            results["overhead"] = overhead
        if wait_group is not None:
            dist.barrier(group=wait_group)

    for workload in workload_list:
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
