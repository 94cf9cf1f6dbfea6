"""The peak memory of one training step, Keras against its native twin.

Builds each benchmark cell exactly as `run.py` does, then runs one
training step of each model under `torch.profiler` with memory profiling
and reads the CPU allocator's bytes in use that the profiler records with
every allocation of the step: forward, backward (its C++ autograd
included) and optimizer. The peak is the largest number of bytes in use
at any point of the step above those in use when it starts
(parameters, gradients and optimizer state held across steps are not
counted; gradients and states created in the step are). On a GPU the same
script reads `torch.cuda.max_memory_allocated` instead.

Each rank measures its own steps; a step's peak is the largest over the
ranks. The two models' steps alternate, `--repeats` each (5 by default),
and the report gives, per cell, the median and range of Keras's and the
native twin's, and the ratio of the medians.

Run it like the harness, e.g.:

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 \\
        benchmarks/peak_memory.py --modes fsdp --out benchmarks/results
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import cell  # noqa: E402
import measure  # noqa: E402
import run  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import workloads  # noqa: E402
from torch.profiler import ProfilerActivity  # noqa: E402
from torch.profiler import profile  # noqa: E402

import keras  # noqa: E402


def cpu_step_peak_bytes(step):
    """Bytes in use at the step's peak, above its start, on the CPU (see
    `measure.cpu_peak_bytes`)."""
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True
    ) as profiler:
        step()
    return measure.cpu_peak_bytes(profiler)


def step_peak_bytes(step):
    if torch.cuda.is_available():
        return measure.cuda_step_peak_bytes(step)
    return cpu_step_peak_bytes(step)


def measure_cell(workload, mode, config, warmup, repeats):
    """Peak bytes of Keras and native steps of a cell, `repeats` each.

    The two models' steps alternate; each step's peak is the largest over
    the ranks. Allocations of gloo's threads count too, and when they
    happen moves from step to step, so the report gives the median.
    """
    result = cell.new_cell(workload, mode)
    options = {"steps": 0, "warmup": warmup, "jit": False, "seed": 0}
    steps = cell.prepare(result, config, options)
    peaks = {"keras": [], "native": []}
    for _ in range(repeats):
        for name in ("keras", "native"):
            measure.barrier()
            peaks[name].append(
                measure.largest_over_ranks(step_peak_bytes(steps[name]))
            )
    return {
        "workload": workload,
        "mode": mode,
        "world": result["world"],
        "twin": result["twin"],
        "peak_bytes": {
            name: statistics.median(values) for name, values in peaks.items()
        },
        "peak_bytes_per_step": peaks,
    }


def table(rows):
    lines = [
        "| workload | mode | processes | steps | Keras peak MiB, median "
        "(range) | native peak MiB, median (range) | Keras / native |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        keras_bytes = row["peak_bytes"]["keras"]
        native_bytes = row["peak_bytes"]["native"]
        per_step = row["peak_bytes_per_step"]
        lines.append(
            f"| {row['workload']} | {row['mode']} | {row['world']} "
            f"| {len(per_step['keras'])} "
            f"| {_mib(keras_bytes)} ({_mib_range(per_step['keras'])}) "
            f"| {_mib(native_bytes)} ({_mib_range(per_step['native'])}) "
            f"| {keras_bytes / max(native_bytes, 1):.2f} |"
        )
    return "\n".join(lines)


def _mib(nbytes):
    return f"{nbytes / 2**20:.2f}"


def _mib_range(values):
    return f"{_mib(min(values))}–{_mib(max(values))}"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", default=",".join(workloads.WORKLOADS))
    parser.add_argument("--modes", default="fsdp")
    defaults = workloads.Config()
    for field in ("hidden", "layers", "batch", "seq", "heads", "vocab"):
        parser.add_argument(
            f"--{field}", type=int, default=getattr(defaults, field)
        )
    parser.add_argument(
        "--optimizer", default=defaults.optimizer, choices=("sgd", "adamw")
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="Measured steps of each model (the report gives the median).",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--tag", default=None)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    modes = args.modes.split(",")
    if modes != ["single"]:
        keras.distribution.initialize()
    config = run.config_from(args)
    rows = [
        measure_cell(workload, mode, config, args.warmup, args.repeats)
        for mode in modes
        for workload in args.workload.split(",")
    ]
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        return
    text = table(rows)
    print(text)
    if args.out:
        world = rows[0]["world"] if rows else 1
        tag = args.tag or f"n{world}_peak_memory"
        os.makedirs(args.out, exist_ok=True)
        record = {
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load_average": list(os.getloadavg()),
            "config": vars(args),
            "environment": {
                name: value
                for name, value in os.environ.items()
                if name.startswith("KERAS_DTENSOR_")
            },
            "rows": rows,
        }
        with open(os.path.join(args.out, f"{tag}.json"), "w") as file:
            json.dump(record, file, indent=1)
        with open(os.path.join(args.out, f"{tag}.md"), "w") as file:
            file.write(text + "\n")


if __name__ == "__main__":
    main()
