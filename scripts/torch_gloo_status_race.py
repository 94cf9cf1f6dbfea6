"""Reproduces, with torch alone, a data race in gloo's worker threads.

Usage: python scripts/torch_gloo_status_race.py [--threads N]
           [--in-flight K] [--seconds S]

Each gloo process group runs its collectives on worker threads (two by
default). After running a work, each worker thread writes the group's
status (`ProcessGroupGloo::runLoop`: `pgStatus_->lastCompletedWorkName =
opTypeToString(...)`) after releasing the group's lock: two works that
finish together assign the same `std::string` from two threads at once.
Where the name is longer than the string's inline buffer
("ALLGATHER_COALESCED", which DTensor's all-gathers run as on gloo), both
threads may free the same heap buffer: glibc then aborts ("free():
double free detected in tcache 2", "malloc(): unaligned tcache chunk
detected"), or later allocations of that size find its cache corrupted.

The script spawns 2 processes, each with its own gloo group of `--threads`
worker threads (2 is torch's default), and issues rounds of `--in-flight`
asynchronous coalesced all-gathers (8 by default) on it for `--seconds`,
the way a step overlaps them. It prints one line per process, or the
process that crashed, and exits 1 where one did. More threads make the
race likelier: on this project's 2-core machine (torch 2.13.0), `--threads
8 --in-flight 16 --seconds 60` aborted with "malloc(): unaligned tcache
chunk detected" in 2 runs of 2, and `--threads 1` ran the same minute
clean. With one worker thread a group runs one work at a time, and the
race cannot happen (`keras/src/backend/torch/gloo_groups.py`).
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def gloo_group(rank, world, threads):
    """A gloo group of `world` processes with `threads` worker threads."""
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["RACE_PORT"]), world, rank == 0
    )
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    options._threads = threads
    options._timeout = datetime.timedelta(seconds=60)
    return dist.ProcessGroupGloo(store, rank, world, options)


def run(rank, world, threads, seconds, in_flight):
    group = gloo_group(rank, world, threads)
    inputs = [torch.full((4,), float(rank)) for _ in range(in_flight)]
    # Per work: one list per process, of one tensor per input.
    outputs = [
        [[torch.empty(4)] for _ in range(world)] for _ in range(in_flight)
    ]
    deadline = time.monotonic() + seconds
    rounds = 0
    while True:
        # Every process stops at the same pair: the decision is shared.
        done = torch.tensor([float(time.monotonic() > deadline)])
        group.allreduce([done]).wait()
        if done.item() > 0:
            break
        works = [
            group.allgather_coalesced(outputs[i], [inputs[i]])
            for i in range(in_flight)
        ]
        for work in works:
            work.wait()
        rounds += 1
    print(
        f"rank {rank}: {rounds} rounds of {in_flight} all-gathers, "
        f"{threads} threads"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--in-flight", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("RACE_PORT", "29633")
    context = mp.spawn(
        run,
        args=(2, args.threads, args.seconds, args.in_flight),
        nprocs=2,
        join=False,
    )
    try:
        while not context.join():
            pass
    except mp.ProcessExitedException as error:
        print(f"a process crashed: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
