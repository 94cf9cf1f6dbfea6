"""Benchmark scripts that run a copy of themselves per process.

`init_memory.py` and `load_memory.py` measure a fresh process's memory,
so each launches its own script again, under torchrun where there are
several processes; each rank writes `result<rank>.json` into a work
folder. Imports no torch: the launching process stays small.
"""

import argparse
import json
import os
import socket
import subprocess
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def add_launch_arguments(parser, timeout=600):
    """The flags every such script takes: `--processes` (a comma-separated
    list of process counts), `--timeout` (seconds per launch), `--out`
    (the results folder), and the hidden `--child` and `--work` of the
    copies it launches."""
    parser.add_argument(
        "--processes",
        type=lambda s: [int(n) for n in s.split(",")],
        default=[2, 4],
    )
    parser.add_argument("--timeout", type=int, default=timeout)
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)


def free_port():
    """A free TCP port on this machine, for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script, processes, single, timeout, env=None):
    """Runs `script` (its path and arguments) in one plain process where
    `single`, else in `processes` processes under torchrun; raises if it
    fails or outlives `timeout` seconds."""
    command = [sys.executable]
    if not single:
        command += [
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={processes}",
            f"--master_port={free_port()}",
        ]
    subprocess.run(command + script, check=True, timeout=timeout, env=env)


def read_results(work, processes):
    """The `result<rank>.json` of each rank in `work`, in rank order."""
    results = []
    for rank in range(processes):
        with open(os.path.join(work, f"result{rank}.json")) as f:
            results.append(json.load(f))
    return results
