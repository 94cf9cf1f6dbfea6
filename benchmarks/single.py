"""Single-process cells, served one step at a time to `run.py`.

`run.py` starts this script on rank 0 in two subprocesses at once: one with
the keras-dtensor mount enabled, one with it removed before keras is
imported (see `run.py:single_command`). Both build the same models; then
`run.py` asks them for training steps in alternation, so that the two
variants are timed side by side and a shared machine's drifts hit both.

Protocol (one line each way, on stdin and stdout):

- for each workload, this script prints `@@bench {"ready": cell, "steps":
  [...]}` once the cell is built, checked and warmed up (see
  `cell.prepare`);
- it then answers each line naming a step (`keras`, `native`,
  `keras_jit`) with `@@bench {"time": seconds}` (or `{"error": ...}`);
- the line `next` moves on to the next workload.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import cell  # noqa: E402
import measure  # noqa: E402
import workloads  # noqa: E402

MARKER = "@@bench "


def mount_state():
    """Whether keras-dtensor's mount is active in this process.

    `distribution_lib_bound`: the backend's `distribution_lib` is this
    project's, not one of the installed keras's own (keras 3.15.1's torch
    backend has none, a later keras's has its own).
    """
    import keras
    from keras.src import backend

    finder_armed = any(
        type(f).__name__ == "KerasOverlayFinder" for f in sys.meta_path
    )
    library = getattr(backend.distribution_lib, "__file__", None)
    installed = os.path.dirname(os.path.realpath(keras.__file__)) + os.sep
    return {
        "finder_armed": finder_armed,
        "distribution_lib_bound": library is not None
        and not os.path.realpath(library).startswith(installed),
    }


def send(message):
    """Writes one protocol line."""
    sys.stdout.write(MARKER + json.dumps(message) + "\n")
    sys.stdout.flush()


def serve(steps):
    """Runs the requested steps until `next` (or end of input)."""
    for line in sys.stdin:
        name = line.strip()
        if name == "next" or not name:
            return
        try:
            start = time.perf_counter()
            steps[name]()
            measure.synchronize()
            send({"time": time.perf_counter() - start})
        except Exception as error:  # noqa: BLE001 - sent to the driver
            send({"error": cell.error_text(error)})


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--config", required=True, help="Config as JSON.")
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jit", action="store_true")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    config = workloads.Config(**json.loads(args.config))
    options = {
        "steps": 0,
        "warmup": args.warmup,
        "jit": args.jit,
        "seed": args.seed,
    }
    mount = mount_state()
    for workload in args.workload.split(","):
        result = cell.new_cell(workload, "single")
        result["mount"] = mount
        try:
            steps = cell.prepare(result, config, options)
        except Exception as error:  # noqa: BLE001 - sent to the driver
            result["error"] = cell.error_text(error)
            steps = {}
        send({"ready": result, "steps": sorted(steps)})
        serve(steps)


if __name__ == "__main__":
    main()
