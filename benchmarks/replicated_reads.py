"""Reads a replicated variable once per process, or once and broadcast.

Run from the repository root (it starts its own torchrun launches):

    KERAS_BACKEND=torch python benchmarks/replicated_reads.py

Loading a Keras file under a distribution reads a replicated variable
whole on every process (`keras/src/backend/torch/shard_reads.py`). The
alternative is to read it on one process per machine and send it to the
others. Every process holds its own copy either way (a variable's local
tensor is its process's), so the two differ only in time and bytes read.
For each number of processes in `--processes`, one launch: process 0
writes an HDF5 file holding one float32 array of `--mib` MiB, every
process reads it once (the page cache is then warm, as it is for the
processes of one machine loading the same file), then, alternating,
`--repeats` times each:

- `each`: every process reads the whole array from the file (h5py);
- `broadcast`: process 0 reads it, and `torch.distributed.broadcast`
  (the job's gloo group) sends it to the others.

Reports the seconds of each (the slowest process's) and the bytes each
process read from the file (`rchar`). Results: a markdown table on
stdout and `--out/replicated_reads.json`.
"""

import argparse
import json
import os
import re
import shutil
import tempfile
import time

import rank_processes


def _read_chars():
    with open("/proc/self/io") as f:
        return int(re.search(r"rchar:\s+(\d+)", f.read()).group(1))


def run(args):
    """One process's part of a launch; writes what it measured."""
    import h5py
    import numpy as np
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    path = os.path.join(args.work, "replicated.h5")
    count = args.mib * 2**20 // 4
    if rank == 0:
        with h5py.File(path, "w") as f:
            f["value"] = np.arange(count, dtype="float32")
    dist.barrier()
    value = torch.empty(count, dtype=torch.float32)

    def each():
        with h5py.File(path, "r") as f:
            f["value"].read_direct(value.numpy())

    def broadcast():
        if rank == 0:
            each()
        dist.broadcast(value, src=0)

    each()  # The page cache is warm from here on.
    timings = {"each": [], "broadcast": [], "read_bytes": {}}
    for _ in range(args.repeats):
        for name, function in (("each", each), ("broadcast", broadcast)):
            dist.barrier()
            read = _read_chars()
            start = time.perf_counter()
            function()
            timings[name].append(time.perf_counter() - start)
            timings["read_bytes"][name] = _read_chars() - read
    # Every process holds the file's array (float32's value of its last
    # index).
    assert float(value[-1]) == float(np.float32(count - 1))
    with open(os.path.join(args.work, f"result{rank}.json"), "w") as f:
        json.dump(timings, f)
    dist.destroy_process_group()


def launch(args, processes):
    work = tempfile.mkdtemp(prefix="replicated_reads_", dir=args.scratch)
    script = [
        os.path.abspath(__file__),
        "--child",
        f"--mib={args.mib}",
        f"--repeats={args.repeats}",
        f"--work={work}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        rank_processes.run_ranks(script, processes, False, args.timeout, env)
        return rank_processes.read_results(work, processes)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(args, runs):
    mib = 2**20
    lines = [
        "| processes | array (MiB) | each: seconds | broadcast: seconds | "
        "broadcast / each | each: MiB read per process | broadcast: MiB "
        "read by process 0, by the others |",
        "|---|---|---|---|---|---|---|",
    ]
    for run_ in runs:
        ranks = run_["ranks"]
        # Per repeat, the slowest process; then the median repeat.
        seconds = {
            name: sorted(
                max(r[name][i] for r in ranks) for i in range(args.repeats)
            )[args.repeats // 2]
            for name in ("each", "broadcast")
        }
        each_read = max(r["read_bytes"]["each"] for r in ranks) / mib
        zero_read = ranks[0]["read_bytes"]["broadcast"] / mib
        other_read = max(r["read_bytes"]["broadcast"] for r in ranks[1:]) / mib
        lines.append(
            f"| {run_['processes']} | {args.mib} | {seconds['each']:.3f} | "
            f"{seconds['broadcast']:.3f} | "
            f"{seconds['broadcast'] / seconds['each']:.1f} | "
            f"{each_read:.0f} | {zero_read:.0f}, {other_read:.0f} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scratch", default=None, help="folder for files")
    rank_processes.add_launch_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        run(args)
        return
    runs = [{"processes": n, "ranks": launch(args, n)} for n in args.processes]
    print(table(args, runs))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "replicated_reads.json"), "w") as f:
        json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
