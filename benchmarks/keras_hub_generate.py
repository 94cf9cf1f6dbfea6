"""`generate()` time per token under a distribution, against none.

Builds a keras-hub `GemmaCausalLM` (`preprocessor=None`, the `mid` preset
of `keras_hub_step.py`, random weights) once without a distribution and
once under `ModelParallel` on a (1, N) mesh laid out by
`GemmaBackbone.get_layout_map`, and times greedy `generate()` on token
ids, alternating the two models: the median of 3 calls after one warm-up
call, per new token, over `--rounds` rounds. Each call's process (CPU)
time is measured too: on a machine that other work loads, the wall
time of a collective includes waiting for the other process to be
scheduled, which the CPU time leaves out. Prints both times, their
ratios, the local tensor moves of one call (collectives among them) and
whether the tokens are the same; with `--out`, writes `<tag>.json` and
`<tag>.md` there. Run it under torchrun:

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 \\
        benchmarks/keras_hub_generate.py --new-tokens 16
"""

import argparse
import collections
import json
import os
import statistics
import subprocess
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from keras_hub_step import PRESETS  # noqa: E402
from keras_hub_step import set_distribution  # noqa: E402
from torch.distributed.tensor import _redistribute  # noqa: E402

import keras  # noqa: E402
from keras.src.backend.torch import created_tensors  # noqa: E402


def build(mode):
    set_distribution(mode, keras_hub.models.GemmaBackbone)
    keras.utils.set_random_seed(1)
    config = PRESETS["mid"]
    backbone = keras_hub.models.GemmaBackbone(
        **config["backbone"], **config["gemma"]
    )
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="Results folder.")
    parser.add_argument("--tag", default="n2_keras_hub_generate")
    args = parser.parse_args()
    keras.distribution.initialize()
    vocab = PRESETS["mid"]["backbone"]["vocabulary_size"]
    ids = np.zeros((4, args.prompt + args.new_tokens), "int32")
    ids[:, : args.prompt] = np.random.default_rng(0).integers(
        1, vocab, (4, args.prompt)
    )
    inputs = {"token_ids": ids, "padding_mask": (ids > 0).astype("int32")}
    models = {mode: build(mode) for mode in ("none", "mp")}
    per_token = {"none": [], "mp": []}
    cpu_per_token = {"none": [], "mp": []}
    tokens = {}
    for _ in range(args.rounds):
        for mode, model in models.items():
            set_distribution(mode, keras_hub.models.GemmaBackbone)
            model.generate(inputs, stop_token_ids=None)
            times, cpu_times = [], []
            for _ in range(3):
                cpu = time.process_time()
                start = time.perf_counter()
                out = model.generate(inputs, stop_token_ids=None)
                times.append(time.perf_counter() - start)
                cpu_times.append(time.process_time() - cpu)
            per_token[mode].append(
                1000 * statistics.median(times) / args.new_tokens
            )
            cpu_per_token[mode].append(
                1000 * statistics.median(cpu_times) / args.new_tokens
            )
            tokens[mode] = np.asarray(out["token_ids"])
    set_distribution("mp", keras_hub.models.GemmaBackbone)
    moves = counted_moves(models["mp"], inputs)
    results = {
        "header": header(args),
        "ms_per_token": per_token,
        "cpu_ms_per_token": cpu_per_token,
        "ratio": ratio(per_token),
        "cpu_ratio": ratio(cpu_per_token),
        "moves_per_call": moves,
        "same_tokens": bool(np.array_equal(tokens["none"], tokens["mp"])),
    }
    if dist.get_rank() == 0:
        text = report(results)
        print(text)
        if args.out:
            path = os.path.join(args.out, args.tag)
            with open(f"{path}.json", "w") as f:
                json.dump(results, f, indent=1)
            with open(f"{path}.md", "w") as f:
                f.write(text)
    dist.destroy_process_group()


def ratio(times):
    """mp's median over none's."""
    return statistics.median(times["mp"]) / statistics.median(times["none"])


def counted_moves(model, inputs):
    """The local tensor moves of one `generate()` call, by kind: each
    DTensor redistribution that reached torch's (after the project's
    unit-axis shortcut), keyed by its placements; and under
    "torch calls in the step's mode", the torch calls that ran under
    the step's torch function mode (not those of local calls)."""
    counts = collections.Counter()
    moved = _redistribute.redistribute_local_tensor
    mode_class = created_tensors._ReplicateCreatedTensors
    dispatch = mode_class.__torch_function__

    def counting(local, current, target, *rest, **kwargs):
        counts[f"{current.placements} -> {target.placements}"] += 1
        return moved(local, current, target, *rest, **kwargs)

    def counting_calls(mode, func, types, args=(), kwargs=None):
        counts[MODE_CALLS] += 1
        return dispatch(mode, func, types, args, kwargs)

    _redistribute.redistribute_local_tensor = counting
    mode_class.__torch_function__ = counting_calls
    try:
        model.generate(inputs, stop_token_ids=None)
    finally:
        _redistribute.redistribute_local_tensor = moved
        mode_class.__torch_function__ = dispatch
    return dict(counts.most_common())


MODE_CALLS = "torch calls in the step's mode"


def header(args):
    """The run's machine, load, commit and settings."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    ).stdout.strip()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"CPU, {dist.get_world_size()} processes; torch {torch.__version__}, "
        f"keras {keras.__version__}, keras-hub {keras_hub.__version__}; "
        f"Gemma mid, 4 prompts of {args.prompt} tokens, {args.new_tokens} "
        f"new tokens, greedy; median of 3 calls per round, {args.rounds} "
        f"rounds; commit {commit}; load average at the end {load}"
    )


def report(results):
    """The results as Markdown."""
    lines = [results["header"], ""]
    lines.append("| mode | ms per token (rounds) | CPU ms per token |")
    lines.append("|---|---|---|")
    for mode in ("none", "mp"):
        wall = ", ".join(f"{t:.1f}" for t in results["ms_per_token"][mode])
        cpu = ", ".join(f"{t:.1f}" for t in results["cpu_ms_per_token"][mode])
        lines.append(f"| {mode} | {wall} | {cpu} |")
    lines.append("")
    lines.append(
        f"mp / none: {results['ratio']:.2f} (wall), "
        f"{results['cpu_ratio']:.2f} (CPU); same tokens: "
        f"{results['same_tokens']}"
    )
    lines.append("")
    lines.append(
        "Local tensor moves of one mp call (prompt and tokens), and its "
        "torch calls under the step's mode:"
    )
    for kind, count in results["moves_per_call"].items():
        lines.append(f"- {count}: {kind}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
