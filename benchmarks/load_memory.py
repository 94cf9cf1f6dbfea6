"""Measures what loading (and saving) a Keras file costs each process.

Run from the repository root (it starts its own torchrun launches):

    KERAS_BACKEND=torch python benchmarks/load_memory.py

The model (`build_model`) is a token embedding and `--blocks` MLP blocks
whose variables total `--vocab` x `--hidden` + 2 x `--blocks` x
`--hidden` x 4 `--hidden` floats (1 GiB by default), laid out as a
tensor-parallel model on a (N,) `model` mesh: the embedding on its rows,
the up-projections on their columns, the down-projections on their rows,
norms and the down-projections' biases replicated. A single-process run
without a distribution saves it as `.weights.h5` and `.keras`, and loads
both back (the baseline). Then for each number of processes in
`--processes` and each path, one launch builds the model under the
distribution and loads each file, and reports per process:

- the peak resident memory rise during the load: the kernel's high-water
  mark (`VmHWM`, reset through `/proc/self/clear_refs` before the load)
  less the resident memory before it;
- the bytes read during the load (`rchar` of `/proc/self/io`: every
  byte read through a system call, from the disk or the page cache);
- the process's shards' size (the bytes of its local tensors), the limit
  the figures are compared with, and its sharded variables' part of it;
- whether the loaded values equal the file's (a checksum of every
  gathered variable against the baseline's).

Paths: `slices` (this project's default: each process reads its local
tensors' blocks, `keras/src/saving/dataset_views.py`) and `full` (the
loading before it: every process reads every full array and keeps its
part, forced by switching the saving edits off while loading). With
`--save`, the `slices` launches also save the model (`.weights.h5` and
`.keras`) under the distribution and report process 0's peak memory rise
during each save against the largest variable's size. `--dtype` gives
the layers another dtype (`bfloat16`).

`--model gemma`: keras-hub's Gemma backbone of about the same size
(`build_gemma`: `--blocks` decoder blocks, 8 heads of 256, an MLP of
4 x `--hidden` split in two) under its own layout map on a (1, N) mesh;
the single process saves it with `save_to_preset`, and each launch
measures `GemmaBackbone.from_preset` of that folder (`slices` only: the
path this project takes).

`load_model` and `from_preset` create the model inside the load: its
shards are created empty and filled by the load
(`keras/src/backend/torch/deferred_initialization.py`). Each launch also
measures creating the model alone, outside a load, for comparison.
Results: a markdown table on stdout and `--out/load_memory.json`
(`load_memory_gemma.json`, `load_memory_bfloat16.json`, ... for the
other models and dtypes).
"""

import argparse
import json
import os
import re
import shutil
import tempfile
import time

import rank_processes

FILES = {"weights": "model.weights.h5", "keras": "model.keras"}


def build_model(args):
    import keras

    dtype = args.dtype
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(
        args.vocab, args.hidden, name="embed", dtype=dtype
    )(tokens)
    for i in range(args.blocks):
        h = keras.layers.LayerNormalization(name=f"norm{i}", dtype=dtype)(x)
        h = keras.layers.Dense(4 * args.hidden, name=f"up{i}", dtype=dtype)(h)
        x = x + keras.layers.Dense(args.hidden, name=f"down{i}", dtype=dtype)(h)
    return keras.Model(tokens, x)


def build_gemma(args):
    """keras-hub's Gemma backbone of about the same size: `--blocks`
    decoder blocks of 8 heads of 256, an MLP of 2 x `--hidden`."""
    import keras_hub

    return keras_hub.models.GemmaBackbone(
        vocabulary_size=args.vocab,
        num_layers=args.blocks,
        num_query_heads=8,
        num_key_value_heads=8,
        hidden_dim=args.hidden,
        intermediate_dim=4 * args.hidden,
        head_dim=256,
        dtype=args.dtype,
    )


def set_distribution(count, model="mlp"):
    import keras

    if model == "gemma":
        import keras_hub

        mesh = keras.distribution.DeviceMesh(
            (1, count), ("batch", "model"), keras.distribution.list_devices()
        )
        layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map)
        )
        return
    mesh = keras.distribution.DeviceMesh(
        (count,), ("model",), keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*embed/embeddings"] = ("model", None)
    layout_map[r".*up\d+/kernel"] = (None, "model")
    layout_map[r".*up\d+/bias"] = ("model",)
    layout_map[r".*down\d+/kernel"] = ("model", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )


def _status(key):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1)) * 1024


def _read_chars():
    with open("/proc/self/io") as f:
        return int(re.search(r"rchar:\s+(\d+)", f.read()).group(1))


def measured(function):
    """Runs `function()`; returns its result, the peak resident memory
    rise, the bytes read, and the seconds it took."""
    import gc

    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Resets VmHWM to the current resident memory.
    read_before = _read_chars()
    start = time.perf_counter()
    result = function()
    seconds = time.perf_counter() - start
    rise = _status("VmHWM") - before
    return result, rise, _read_chars() - read_before, seconds


def checksums(model):
    import numpy as np

    return [float(np.asarray(w, dtype="float64").sum()) for w in model.weights]


def shard_bytes(model):
    """This process's local tensors' bytes: all, and the sharded ones'."""
    total = sharded = 0
    for variable in model.weights:
        value = variable.value
        local = value.to_local() if hasattr(value, "to_local") else value
        size = local.numel() * local.element_size()
        total += size
        if hasattr(value, "placements") and any(
            p.is_shard() for p in value.placements
        ):
            sharded += size
    return total, sharded


def run(args):
    """One process's part of a launch; writes what it measured."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras

    rank = int(os.environ.get("RANK", "0"))
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        keras.distribution.initialize()
        set_distribution(int(os.environ["WORLD_SIZE"]), args.model)
    if args.model == "gemma":
        result = run_preset(args, distributed)
        with open(os.path.join(args.work, f"result{rank}.json"), "w") as f:
            json.dump(result, f)
        return
    keras.utils.set_random_seed(1)
    model, create_rise, _, _ = measured(lambda: build_model(args))
    result = {"files": {}, "create_rise_bytes": create_rise}
    if not distributed:
        for kind in ("weights", "keras"):
            path = os.path.join(args.files, FILES[kind])
            save = model.save_weights if kind == "weights" else model.save
            save(path)
        result["checksums"] = checksums(model)
    if args.path == "full":
        from keras_dtensor import _saving_edits

        _saving_edits._distribution_is_set = lambda: False
    total, sharded = shard_bytes(model)
    result.update(shard_bytes=total, sharded_bytes=sharded)
    for kind in ("weights", "keras"):
        path = os.path.join(args.files, FILES[kind])
        if kind == "weights":
            loaded, rise, read, seconds = measured(
                lambda: model.load_weights(path)
            )
            loaded = model
        else:
            del model
            loaded, rise, read, seconds = measured(
                lambda: keras.saving.load_model(path)
            )
            model = loaded
        result["files"][kind] = {
            "rise_bytes": rise,
            "read_bytes": read,
            "seconds": seconds,
            "file_bytes": os.path.getsize(path),
            "checksums": checksums(loaded),
        }
    if args.save and distributed and args.path == "slices":
        result["save"] = {
            "largest_variable_bytes": max(_full_bytes(v) for v in model.weights)
        }
        for kind in ("weights", "keras"):
            target = os.path.join(args.work, FILES[kind])
            save = model.save_weights if kind == "weights" else model.save
            _, rise, _, seconds = measured(lambda: save(target))
            result["save"][kind] = {"rise_bytes": rise, "seconds": seconds}
    with open(os.path.join(args.work, f"result{rank}.json"), "w") as f:
        json.dump(result, f)


def run_preset(args, distributed):
    """keras-hub: the single process saves a Gemma preset folder, and every
    launch measures `from_preset` (which creates the model) from it."""
    import keras_hub

    import keras

    preset = os.path.join(args.files, "preset")
    result = {"files": {}}
    if not distributed:
        keras.utils.set_random_seed(1)
        model, result["create_rise_bytes"], _, _ = measured(
            lambda: build_gemma(args)
        )
        model.save_to_preset(preset)
        result["checksums"] = checksums(model)
        del model
    if args.path == "full":
        from keras_dtensor import _saving_edits

        _saving_edits._distribution_is_set = lambda: False
    loaded, rise, read, seconds = measured(
        lambda: keras_hub.models.GemmaBackbone.from_preset(preset)
    )
    total, sharded = shard_bytes(loaded)
    result.update(shard_bytes=total, sharded_bytes=sharded)
    result["files"]["preset"] = {
        "rise_bytes": rise,
        "read_bytes": read,
        "seconds": seconds,
        "file_bytes": os.path.getsize(os.path.join(preset, "model.weights.h5")),
        "checksums": checksums(loaded),
    }
    if distributed:
        # Created alone, outside a load, for comparison.
        del loaded
        keras.utils.set_random_seed(1)
        _, result["create_rise_bytes"], _, _ = measured(
            lambda: build_gemma(args)
        )
    return result


def _full_bytes(variable):
    import math

    return math.prod(variable.shape) * variable.value.element_size()


def launch(args, processes, path, files):
    """Runs `run` in `processes` processes; returns their results."""
    work = tempfile.mkdtemp(prefix="load_memory_")
    script = [
        os.path.abspath(__file__),
        "--child",
        f"--vocab={args.vocab}",
        f"--hidden={args.hidden}",
        f"--blocks={args.blocks}",
        f"--dtype={args.dtype}",
        f"--model={args.model}",
        f"--path={path}",
        f"--files={files}",
        f"--work={work}",
    ] + (["--save"] if args.save else [])
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    rank_processes.run_ranks(
        script, processes, path == "single", args.timeout, env
    )
    results = rank_processes.read_results(work, processes)
    shutil.rmtree(work, ignore_errors=True)
    return results


def measure_all(args):
    files = tempfile.mkdtemp(prefix="load_memory_files_", dir=args.scratch)
    try:
        (reference,) = launch(args, 1, "single", files)
        runs = [{"processes": 1, "path": "single", "ranks": [reference]}]
        for processes in args.processes:
            for path in args.paths:
                results = launch(args, processes, path, files)
                runs.append(
                    {"processes": processes, "path": path, "ranks": results}
                )
    finally:
        shutil.rmtree(files, ignore_errors=True)
    for run_ in runs:
        for result in run_["ranks"]:
            for kind, figures in result["files"].items():
                figures["exact"] = bool(
                    max(
                        abs(a - b)
                        for a, b in zip(
                            figures.pop("checksums"), reference["checksums"]
                        )
                    )
                    <= 1e-6 * max(abs(c) for c in reference["checksums"])
                )
    return runs


def table(runs):
    mib = 2**20
    lines = [
        "| processes | path | file | shards per process (MiB) | peak memory "
        "rise (MiB) | rise / shards | bytes read (MiB) | read / shards | "
        "seconds | equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run_ in runs:
        for kind in run_["ranks"][0]["files"]:
            ranks = run_["ranks"]
            shards = max(r["shard_bytes"] for r in ranks)
            rise = max(r["files"][kind]["rise_bytes"] for r in ranks)
            read = max(r["files"][kind]["read_bytes"] for r in ranks)
            seconds = max(r["files"][kind]["seconds"] for r in ranks)
            exact = all(r["files"][kind]["exact"] for r in ranks)
            lines.append(
                f"| {run_['processes']} | {run_['path']} | "
                f"{FILES.get(kind, kind)} | "
                f"{shards / mib:.0f} | {rise / mib:.0f} | "
                f"{rise / shards:.2f} | {read / mib:.0f} | "
                f"{read / shards:.2f} | {seconds:.1f} | "
                f"{'yes' if exact else 'NO'} |"
            )
    lines += [
        "",
        "`load_model` and `from_preset` create the model; creating it "
        "alone, outside a load, raises peak memory by (largest over the "
        "processes):",
        "",
        "| processes | path | creation rise (MiB) | creation rise / shards |",
        "|---|---|---|---|",
    ]
    for run_ in runs:
        ranks = run_["ranks"]
        shards = max(r["shard_bytes"] for r in ranks)
        rise = max(r["create_rise_bytes"] for r in ranks)
        lines.append(
            f"| {run_['processes']} | {run_['path']} | {rise / mib:.0f} | "
            f"{rise / shards:.2f} |"
        )
    saves = [
        (run_["processes"], run_["ranks"][0]["save"])
        for run_ in runs
        if "save" in run_["ranks"][0]
    ]
    if saves:
        lines += [
            "",
            "| processes | save | process 0's peak memory rise (MiB) | "
            "largest variable (MiB) | rise / largest | seconds |",
            "|---|---|---|---|---|---|",
        ]
        for processes, save in saves:
            largest = save["largest_variable_bytes"]
            for kind in FILES:
                rise = save[kind]["rise_bytes"]
                lines.append(
                    f"| {processes} | {FILES[kind]} | {rise / mib:.0f} | "
                    f"{largest / mib:.0f} | {rise / largest:.2f} | "
                    f"{save[kind]['seconds']:.1f} |"
                )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--model",
        choices=["mlp", "gemma"],
        default="mlp",
        help="mlp: the Keras model, saved as files; gemma: keras-hub's "
        "Gemma backbone, saved as a preset folder, loaded by from_preset",
    )
    parser.add_argument(
        "--paths", type=lambda s: s.split(","), default=["slices", "full"]
    )
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--scratch", default=None, help="folder for files")
    parser.add_argument("--path", default="slices", help=argparse.SUPPRESS)
    parser.add_argument("--files", help=argparse.SUPPRESS)
    rank_processes.add_launch_arguments(parser, timeout=1200)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        run(args)
        return
    runs = measure_all(args)
    print(table(runs))
    os.makedirs(args.out, exist_ok=True)
    name = "_".join(
        ["load_memory"]
        + ([args.model] if args.model != "mlp" else [])
        + ([args.dtype] if args.dtype != "float32" else [])
    )
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
