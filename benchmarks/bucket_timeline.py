"""When a Keras DataParallel step sends its gradient buckets.

Builds one benchmark cell as `run.py` does and runs `--steps` Keras
training steps, noting (wall time, rank 0) when `loss.backward()` starts
and returns, when each gradient bucket is sent (`_Bucket.launch`, with
its size and number of gradients) and how long the end of backward waits
for each bucket's all-reduce. A bucket sent while backward still computes
overlaps its all-reduce with the rest of backward, as DDP's do; one sent
when backward's operators are done leaves the all-reduce to be waited
for.

Run it like the harness, e.g.:

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 \\
        benchmarks/bucket_timeline.py --workload transformer,llama \\
        --steps 10

Rank 0 prints one line per step (ms from the step's start) and the median
position of the first bucket's send in backward (0%: its start, 100%: its
return, which includes the waits).
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import cell  # noqa: E402
import measure  # noqa: E402
import run  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import keras  # noqa: E402


class Timeline:
    """Events of one step: `(name, ms since the step started)`."""

    def __init__(self):
        self.events = []
        self.start = time.perf_counter()

    def restart(self):
        self.events = []
        self.start = time.perf_counter()

    def note(self, name):
        self.events.append((name, (time.perf_counter() - self.start) * 1e3))

    def first(self, prefix):
        return next(t for name, t in self.events if name.startswith(prefix))


def watch(timeline):
    """Patches backward and the gradient buckets to note their events."""
    from keras.src.backend.torch import gradient_bucket

    bucket_class = gradient_bucket.Bucket
    launch, finish = bucket_class.launch, bucket_class.finish
    backward = torch.Tensor.backward

    def noted_launch(bucket):
        timeline.note(
            f"send {bucket.nbytes / 2**20:.2f} MiB "
            f"({len(bucket.entries)} gradients)"
        )
        launch(bucket)

    def noted_finish(bucket, assigned):
        timeline.note("wait")
        bucket.work.wait()
        timeline.note("waited")
        finish(bucket, assigned)

    def noted_backward(tensor, *args, **kwargs):
        timeline.note("backward")
        try:
            return backward(tensor, *args, **kwargs)
        finally:
            timeline.note("backward returned")

    bucket_class.launch = noted_launch
    bucket_class.finish = noted_finish
    torch.Tensor.backward = noted_backward


def parse_args(argv=None):
    """This script's flags, and `run.py`'s (workloads, sizes, steps)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--no-gradient-leaves",
        action="store_true",
        help="Local calls read variables through views made by an autograd "
        "function, kept from step to step, as before commit 59e7922.",
    )
    own, rest = parser.parse_known_args(argv)
    return own, run.parse_args(rest)


def without_gradient_leaves():
    """Makes local calls read `_LocalView` views, as before 59e7922."""
    from keras.src.backend.torch import local_gradients

    local_gradients.gradient_leaf = lambda parameter, placements, local: None


def timeline_of(workload, config, args, timeline):
    """Runs `args.steps` DataParallel steps of `workload`, printing each
    step's events (`timeline`, watched) on rank 0; returns the first
    bucket's positions in backward (percent)."""
    result = cell.new_cell(workload, "dp")
    options = {"steps": 0, "warmup": args.warmup, "jit": False, "seed": 0}
    step = cell.prepare(result, config, options)["keras"]
    positions = []
    for _ in range(args.steps):
        measure.barrier()
        timeline.restart()
        step()
        timeline.note("step returned")
        start = timeline.first("backward")
        end = timeline.first("backward returned")
        if any(name.startswith("send") for name, _ in timeline.events):
            sent = timeline.first("send")
            positions.append(100 * (sent - start) / (end - start))
        if dist.get_rank() == 0:
            print(" | ".join(f"{name} {t:.1f}" for name, t in timeline.events))
    return positions


def main(argv=None):
    own, args = parse_args(argv)
    keras.distribution.initialize()
    if own.no_gradient_leaves:
        without_gradient_leaves()
    config = run.config_from(args)
    timeline = Timeline()
    watch(timeline)
    for workload in args.workload.split(","):
        positions = timeline_of(workload, config, args, timeline)
        if dist.get_rank() == 0 and positions:
            print(
                f"== {workload}/dp: first bucket sent at "
                f"{statistics.median(positions):.0f}% of backward (median "
                f"of {args.steps} steps)"
            )


if __name__ == "__main__":
    main()
