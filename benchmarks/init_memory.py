"""Measures the memory and time of creating a large sharded variable.

Run from the repository root (it starts its own torchrun launches):

    KERAS_BACKEND=torch python benchmarks/init_memory.py

For each number of processes in `--processes`, and for each path, one
launch creates `Embedding(--rows, --cols)` (float32, Keras's default
uniform initializer) sharded `("model", None)` over a (1, N) mesh, and
reports per process:

- the rise of peak resident memory (`ru_maxrss`) during creation, on CPU,
  or of `torch.cuda.max_memory_allocated` on a GPU;
- the creation time;
- whether the local shard equals the single-process value's slice;
- the log line of a variable that took the full path (on CUDA, the
  shard-by-shard creation declines: see `sharded_initialization`).

Paths: `shard` (this project's default: the variable created shard by
shard, `keras/src/backend/torch/sharded_initialization.py`) and `full`
(the full value computed on every process, then sliced: the path the
shard-by-shard creation replaces, forced by making it decline). A
single-process run without a distribution gives the reference value and
the baseline memory. Results: a markdown table on stdout and
`--out/init_memory.json`.
"""

import argparse
import json
import logging
import os
import resource
import tempfile
import time

import rank_processes


def create(args):
    """Creates the embedding in this process; writes what it measured."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import numpy as np
    import torch

    import keras

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        keras.distribution.initialize()
        count = int(os.environ["WORLD_SIZE"])
        mesh = keras.distribution.DeviceMesh(
            (1, count), ("batch", "model"), keras.distribution.list_devices()
        )
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["table/embeddings"] = ("model", None)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map)
        )
        if args.path == "full":
            from keras.src.backend.torch import sharded_initialization

            sharded_initialization.initialize_variable_shard = lambda *args: (
                None
            )
    logged = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("keras.src.backend.torch.sharded_initialization")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    keras.utils.set_random_seed(7)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    layer = keras.layers.Embedding(args.rows, args.cols, name="table")
    layer.build((None,))
    seconds = time.perf_counter() - start
    if cuda:
        rise = torch.cuda.max_memory_allocated() - before
    else:
        rise = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        rise -= before
    value = layer.embeddings.value
    local = value.to_local() if hasattr(value, "to_local") else value
    rank = int(os.environ.get("RANK", "0"))
    np.save(
        os.path.join(args.work, f"local{rank}.npy"),
        local.detach().cpu().numpy(),
    )
    with open(os.path.join(args.work, f"result{rank}.json"), "w") as f:
        json.dump({"rise_bytes": rise, "seconds": seconds, "logged": logged}, f)


def launch(args, processes, path):
    """Runs `create` in `processes` processes; returns their results."""
    import numpy as np

    work = tempfile.mkdtemp(prefix="init_memory_")
    script = [
        os.path.abspath(__file__),
        "--child",
        f"--rows={args.rows}",
        f"--cols={args.cols}",
        f"--path={path}",
        f"--work={work}",
    ]
    single = processes == 1 and path == "single"
    rank_processes.run_ranks(script, processes, single, args.timeout)
    results = rank_processes.read_results(work, processes)
    for rank, result in enumerate(results):
        result["local"] = np.load(os.path.join(work, f"local{rank}.npy"))
    return results


def measure_all(args):
    """The single-process reference, then every process count and path."""
    import numpy as np

    reference = launch(args, 1, "single")[0]
    rows = [
        {
            "processes": 1,
            "path": "single",
            "rise_mib": reference["rise_bytes"] / 2**20,
            "seconds": reference["seconds"],
            "exact": True,
        }
    ]
    for processes in args.processes:
        for path in ("shard", "full"):
            results = launch(args, processes, path)
            exact = np.array_equal(
                np.concatenate([r["local"] for r in results]),
                reference["local"],
            )
            rows.append(
                {
                    "processes": processes,
                    "path": path,
                    "rise_mib": max(r["rise_bytes"] for r in results) / 2**20,
                    "seconds": max(r["seconds"] for r in results),
                    "exact": bool(exact),
                    "logged": results[0]["logged"],
                }
            )
    return rows


def table(args, rows):
    size = args.rows * args.cols * 4 / 2**20
    lines = [
        f"`Embedding({args.rows}, {args.cols})`, {size:.0f} MiB float32, "
        'sharded `("model", None)`:',
        "",
        "| processes | path | peak memory rise per process (MiB) | shard "
        "(MiB) | creation s | equal to one process |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        shard = size / row["processes"]
        lines.append(
            f"| {row['processes']} | {row['path']} | {row['rise_mib']:.0f} "
            f"| {shard:.0f} | {row['seconds']:.2f} | "
            f"{'yes' if row['exact'] else 'NO'} |"
        )
    logged = {line for row in rows for line in row.get("logged", [])}
    lines.extend(["", *(f"Logged: {line}" for line in sorted(logged))])
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=131072)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--path", default="shard", help=argparse.SUPPRESS)
    rank_processes.add_launch_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        create(args)
        return
    rows = measure_all(args)
    print(table(args, rows))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "init_memory.json"), "w") as f:
        json.dump({"rows": args.rows, "cols": args.cols, "runs": rows}, f)


if __name__ == "__main__":
    main()
