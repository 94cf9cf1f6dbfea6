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

It also counts the Python calls of one step by the package that holds the
called function (upstream keras, this repository, torch's DTensor, the
rest of torch, C built-ins, other), with their cProfile self time.

Under a distribution it then measures the share of the torch function
mode that wraps every Keras step (`replicate_created_tensors`): the torch
calls it intercepts and the Python calls it adds per step (cProfile), and
the median step time with and without it, timed in alternation (without
it = the mode's class replaced by a no-op for those steps only). It
prints the test loss of the model computed both ways, which must agree for
the comparison to mean anything.

Run it like the harness, e.g.:

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 \\
        benchmarks/profile_step.py --workload mlp --mode dp

Rank 0 prints the split in ms per step and the operators with the most
self time.
"""

import argparse
import contextlib
import os
import statistics
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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Installed packages, wherever the environment lives (a virtual environment
# inside the checkout included): classified by package, not as this
# repository's code.
INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
PACKAGES = (
    "keras (upstream)",
    "this repository",
    "torch DTensor",
    "torch (other)",
    "C built-ins",
    "other",
)


def package(path):
    """The `PACKAGES` entry of a function defined in `path`."""
    if path == "~":
        return "C built-ins"
    installed = any(part in path for part in INSTALLED)
    if path.startswith(ROOT + os.sep) and not installed:
        return "this repository"
    if f"{os.sep}keras{os.sep}" in path:
        return "keras (upstream)"
    if f"{os.sep}torch{os.sep}distributed{os.sep}tensor{os.sep}" in path:
        return "torch DTensor"
    if f"{os.sep}torch{os.sep}" in path:
        return "torch (other)"
    return "other"


def python_by_package(step):
    """Python calls and cProfile self ms of one step, by `package`."""
    parts = {name: [0, 0.0] for name in PACKAGES}
    for (path, _, _), stat in measure.profile_stats(step).stats.items():
        calls, self_seconds = stat[1], stat[2]
        parts[package(path)][0] += calls
        parts[package(path)][1] += 1000.0 * self_seconds
    return parts


class _NoFunctionMode:
    """Stands in for the torch function mode: enters and exits, nothing else."""

    def __init__(self, mesh):
        del mesh

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


@contextlib.contextmanager
def function_mode_disabled():
    """Steps run without the torch function mode of the step context.

    Only the `TorchFunctionMode` is replaced; `replicate_created_tensors`
    itself (and whatever else it keeps track of) runs as usual.
    """
    from keras.src.backend.torch import created_tensors

    upstream = created_tensors._ReplicateCreatedTensors
    created_tensors._ReplicateCreatedTensors = _NoFunctionMode
    try:
        yield
    finally:
        created_tensors._ReplicateCreatedTensors = upstream


def _profile_calls(step):
    """`(Python calls, calls of the mode's __torch_function__)` of a step."""
    stats = measure.profile_stats(step)
    intercepted = sum(
        calls
        for (path, _, name), (_, calls, *_) in stats.stats.items()
        if name == "__torch_function__" and path.endswith("created_tensors.py")
    )
    return int(stats.total_calls), int(intercepted)


def _test_loss(runner):
    with runner.scope():
        return float(runner.model.test_on_batch(runner.x, runner.y))


def function_mode_share(runner, steps):
    """Step time and Python calls with and without the function mode.

    Args:
        runner: a `cell.KerasRunner`.
        steps: number of timed steps each way.

    Returns:
        A dict with `with_ms`, `without_ms` (medians of alternating steps,
        slowest rank), `calls_with`, `calls_without`, `intercepted` (torch
        calls seen by the mode in one step) and the test losses `loss_with`
        and `loss_without` of the same weights.
    """
    step = runner.step
    loss_with = _test_loss(runner)
    with function_mode_disabled():
        loss_without = _test_loss(runner)
    calls_with, intercepted = _profile_calls(step)
    with function_mode_disabled():
        calls_without, _ = _profile_calls(step)
    times = {"with": [], "without": []}
    for i in range(steps):
        order = ("with", "without") if i % 2 == 0 else ("without", "with")
        for name in order:
            context = (
                function_mode_disabled()
                if name == "without"
                else contextlib.nullcontext()
            )
            with context:
                measure.barrier()
                start = time.perf_counter()
                step()
                measure.synchronize()
                times[name].append(time.perf_counter() - start)
    times = {k: measure.slowest_rank(v) for k, v in times.items()}
    return {
        "with_ms": 1000.0 * statistics.median(times["with"]),
        "without_ms": 1000.0 * statistics.median(times["without"]),
        "calls_with": calls_with,
        "calls_without": calls_without,
        "intercepted": intercepted,
        "loss_with": loss_with,
        "loss_without": loss_without,
    }


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
    parser.add_argument(
        "--mode-steps",
        type=int,
        default=20,
        help="Alternating steps with and without the function mode (0: "
        "skip that measurement).",
    )
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
    for name in ("keras", "native"):
        parts = python_by_package(steps[name])
        if rank != 0:
            continue
        calls = sum(c for c, _ in parts.values())
        self_ms = sum(t for _, t in parts.values())
        print(
            f"== {args.workload}/{args.mode} {name}: {calls} Python calls "
            f"per step, {self_ms:.1f} ms of cProfile self time"
        )
        for part, (count, ms) in parts.items():
            print(
                f"   {part:26s} {count:7d} calls {ms:8.1f} ms "
                f"{100 * ms / max(self_ms, 1e-9):5.1f}%"
            )
    if args.mode == "single" or args.mode_steps <= 0:
        return
    share = function_mode_share(steps["keras"].__self__, args.mode_steps)
    if rank == 0:
        extra = share["with_ms"] - share["without_ms"]
        print(
            f"== {args.workload}/{args.mode} keras, torch function mode: "
            f"{share['intercepted']} torch calls intercepted per step; "
            f"Python calls {share['calls_with']} with, "
            f"{share['calls_without']} without; median step "
            f"{share['with_ms']:.1f} ms with, {share['without_ms']:.1f} ms "
            f"without ({extra:+.1f} ms, "
            f"{100 * extra / share['with_ms']:+.1f}% of the step; "
            f"{args.mode_steps} alternating steps); test loss "
            f"{share['loss_with']:.6f} with, {share['loss_without']:.6f} "
            "without"
        )


if __name__ == "__main__":
    main()
