"""Single-process cells: Keras without a distribution vs plain PyTorch.

`run.py` starts this script in a subprocess on rank 0, once or several
times, with the keras-dtensor mount enabled or disabled (see
`run.py:single_command`). It prints nothing but errors and writes its
results as JSON to `--json`.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import cell  # noqa: E402
import workloads  # noqa: E402


def mount_state():
    """Whether keras-dtensor's mount is active in this process."""
    from keras.src import backend

    finder_armed = any(
        type(f).__name__ == "KerasOverlayFinder" for f in sys.meta_path
    )
    return {
        "finder_armed": finder_armed,
        "distribution_lib_bound": backend.distribution_lib is not None,
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--config", required=True, help="Config as JSON.")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jit", action="store_true")
    parser.add_argument("--json", required=True, help="Output file.")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    config = workloads.Config(**json.loads(args.config))
    options = {
        "steps": args.steps,
        "warmup": args.warmup,
        "jit": args.jit,
        "seed": args.seed,
    }
    result = {"mount": mount_state(), "cells": []}
    for workload in args.workload.split(","):
        result["cells"].append(
            cell.run_cell(workload, "single", config, options)
        )
    with open(args.json + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
