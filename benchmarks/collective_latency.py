"""How long one small all-reduce takes between computations.

Times `dist.all_reduce` of a token's hidden states (4 prompts, hidden
256: 4 KiB) on every process, back to back and with some busy work
before each (as in `generate()`, where each process computes a layer's
share between two all-reduces), 300 times per setting after 50 warm-up
calls. Prints, per setting, the median, the 90th percentile and the
mean in milliseconds. On a machine whose idle cores are parked, a
process that waits at a collective may be woken late: the mean then
lies far above the median. Run it under torchrun:

    torchrun --nproc_per_node=2 benchmarks/collective_latency.py

`--out` writes the table (`<tag>.md`) and its values (`<tag>.json`)
there.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

WORK_MS = (0.0, 0.5, 3.0)
CALLS = 300
WARMUP = 50


def timed_all_reduces(work_ms):
    """Milliseconds of each all-reduce, each after `work_ms` of busy
    work."""
    states = torch.ones(4, 1, 256)
    times = []
    for index in range(WARMUP + CALLS):
        start = time.perf_counter()
        while (time.perf_counter() - start) * 1000 < work_ms:
            pass
        start = time.perf_counter()
        dist.all_reduce(states)
        if index >= WARMUP:
            times.append(1000 * (time.perf_counter() - start))
    return times


def summary(times):
    ordered = sorted(times)
    return {
        "median_ms": statistics.median(ordered),
        "p90_ms": ordered[int(0.9 * len(ordered))],
        "mean_ms": statistics.mean(ordered),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None, help="Results folder.")
    parser.add_argument("--tag", default="collective_latency")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rows = [
        {"work_ms": work, **summary(timed_all_reduces(work))}
        for work in WORK_MS
    ]
    lines = [
        f"{dist.get_world_size()} gloo processes, {os.cpu_count()} cores; "
        f"torch {torch.__version__}; all-reduce of 4 x 256 float32",
        "",
        "| busy work before each (ms) | median ms | p90 ms | mean ms |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['work_ms']} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} "
        f"| {r['mean_ms']:.3f} |"
        for r in rows
    ]
    if dist.get_rank() == 0:
        print("\n".join(lines))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
                f.write("\n".join(lines) + "\n")
            with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
                json.dump({"header": lines[0], "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
