"""Where the time of one training step goes, Keras vs native PyTorch.

Builds one benchmark cell exactly as `run.py` does, then runs `--steps`
training steps of each model under `torch.profiler` and splits the wall
time of a step by operator self time:

- collectives: c10d and functional-collective operators, including the
  wait for their result (gloo or NCCL);
- DTensor dispatch: DTensor's Python `__torch_dispatch__` and
  redistribution (the `PythonSubclass` and `Redistribute` ranges);
- compute: every other operator (`aten::...`);
- outside operators: the rest of the wall time (Keras layers and
  trainer, optimizer loops, autograd glue, and waits that have no
  profiler range, such as DDP's bucket waits).

Run it like the harness, e.g.:

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 \\
        benchmarks/profile_step.py --workload mlp --mode dp

Rank 0 prints the split in ms per step and the operators with the most
self time.
"""

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import cell  # noqa: E402
import measure  # noqa: E402
import torch.distributed as dist  # noqa: E402
import workloads  # noqa: E402
from torch.profiler import ProfilerActivity  # noqa: E402
from torch.profiler import profile  # noqa: E402

import keras  # noqa: E402

COLLECTIVE_WORDS = (
    "c10d",
    "allreduce",
    "all_reduce",
    "allgather",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "wait_tensor",
    "gloo",
    "nccl",
)
DTENSOR_RANGES = ("PythonSubclass", "Redistribute")


def category(name):
    """The category of a profiler range named `name`."""
    lowered = name.lower()
    if any(word in lowered for word in COLLECTIVE_WORDS):
        return "collectives"
    if name in DTENSOR_RANGES:
        return "DTensor dispatch"
    return "compute"


def breakdown(step, steps):
    """Per-step milliseconds by category, and the profiler's averages."""
    activities = [ProfilerActivity.CPU]
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        measure.synchronize()
        wall = time.perf_counter() - start
    averages = profiler.key_averages()
    parts = {"collectives": 0.0, "DTensor dispatch": 0.0, "compute": 0.0}
    for event in averages:
        parts[category(event.key)] += event.self_cpu_time_total / 1e3
    parts = {name: value / steps for name, value in parts.items()}
    wall_ms = 1000.0 * wall / steps
    parts["outside operators"] = max(wall_ms - sum(parts.values()), 0)
    return wall_ms, parts, averages


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", default="mlp")
    parser.add_argument("--mode", default="dp")
    defaults = workloads.Config()
    for field in ("hidden", "layers", "batch", "seq", "heads", "vocab"):
        parser.add_argument(
            f"--{field}", type=int, default=getattr(defaults, field)
        )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.mode != "single":
        keras.distribution.initialize()
    config = workloads.Config(
        hidden=args.hidden,
        layers=args.layers,
        batch=args.batch,
        seq=args.seq,
        heads=args.heads,
        vocab=args.vocab,
    )
    result = cell.new_cell(args.workload, args.mode)
    options = {"steps": 0, "warmup": args.warmup, "jit": False, "seed": 0}
    steps = cell.prepare(result, config, options)
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name in ("keras", "native"):
        wall, parts, averages = breakdown(steps[name], args.steps)
        if rank != 0:
            continue
        print(f"== {args.workload}/{args.mode} {name}: {wall:.1f} ms/step")
        for part, value in parts.items():
            print(f"   {part:26s} {value:8.2f} ms {100 * value / wall:5.1f}%")
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
