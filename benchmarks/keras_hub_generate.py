"""`generate()` time per token under a distribution, against none.

Builds keras-hub causal LMs (`preprocessor=None`, a preset of
`keras_hub_step.py`, random weights, the greedy sampler) once without a
distribution and once under each mode asked for (`dp`, `mp`: see
`keras_hub_step.set_distribution`), and times greedy `generate()` on
token ids, alternating the models: the median of 3 calls after one
warm-up call, per new token, over `--rounds` rounds. Each call's process
(CPU) time is measured too: on a machine that other work loads, the wall
time of a collective includes waiting for the other process to be
scheduled, which the CPU time leaves out. Prints each mode's times, their
ratios to no distribution, whether its tokens are the same, and the
local tensor moves of one call (collectives among them) with its torch
calls under the step's mode and its collectives; and the median time of
one all-reduce of a token's hidden states (of the 4 prompts) on these
processes, which, times the collectives of a token, bounds the time per
token from below, with the median and mean of one after 3 ms of busy
work (between computations, as in `generate()`). Run it under torchrun:

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 \\
        benchmarks/keras_hub_generate.py --new-tokens 16

`--lora 0,4` times each model without LoRA factors, then with factors
of rank 4 (as after LoRA tuning). Defaults: Gemma, the `mid` preset,
`mp`, no LoRA. `--out` writes the report
(`<tag>.md`, `<tag>.json`) there; the exit status is 1 when tokens differ.
"""

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras_hub  # noqa: E402
import measure  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from keras_hub_step import BACKBONES  # noqa: E402
from keras_hub_step import PRESETS  # noqa: E402
from keras_hub_step import set_distribution  # noqa: E402
from torch.distributed.tensor import _redistribute  # noqa: E402

import keras  # noqa: E402
from keras.src.backend.torch import created_tensors  # noqa: E402

CAUSAL_LMS = {
    "gemma": keras_hub.models.GemmaCausalLM,
    "llama": keras_hub.models.LlamaCausalLM,
}
MODE_CALLS = "torch calls in the step's mode"
COLLECTIVES = "collectives"


def build(name, mode, preset, lora_rank=0):
    """The causal LM `name` of `preset` under `mode`, greedy; with LoRA
    factors of `lora_rank` where it is not 0 (as after LoRA tuning, here
    untrained)."""
    set_distribution(mode, BACKBONES[name])
    keras.utils.set_random_seed(1)
    config = PRESETS[preset]
    backbone = BACKBONES[name](**config["backbone"], **config.get(name, {}))
    if lora_rank:
        backbone.enable_lora(rank=lora_rank)
    model = CAUSAL_LMS[name](backbone=backbone, preprocessor=None)
    model.compile(sampler="greedy")
    return model


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_model(name, mode, model, inputs, new_tokens):
    """Wall and CPU milliseconds per new token (medians of 3 calls), and
    the tokens."""
    set_distribution(mode, BACKBONES[name])
    model.generate(inputs, stop_token_ids=None)
    times, cpu_times = [], []
    for _ in range(3):
        synchronize()
        cpu = time.process_time()
        start = time.perf_counter()
        out = model.generate(inputs, stop_token_ids=None)
        synchronize()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
    wall = 1000 * statistics.median(times) / new_tokens
    cpu = 1000 * statistics.median(cpu_times) / new_tokens
    return wall, cpu, out["token_ids"]


def counted_moves(model, inputs):
    """The local tensor moves of one `generate()` call, by kind: each
    DTensor redistribution that reached torch's (after the project's
    unit-axis shortcut), keyed by its placements; and under `MODE_CALLS`,
    the torch calls that ran under the step's torch function mode (not
    those of local calls)."""
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
        with measure.CollectiveCounter() as collectives:
            model.generate(inputs, stop_token_ids=None)
    finally:
        _redistribute.redistribute_local_tensor = moved
        mode_class.__torch_function__ = dispatch
    counts[COLLECTIVES] = collectives.counts()["total"]
    return dict(counts.most_common())


def all_reduce_ms(hidden_dim, work_ms=0.0):
    """The median and mean milliseconds of one all-reduce of a token's
    hidden states (4 prompts), over every process, each after `work_ms`
    of busy work (200 after 20 warm-up): between computations, as in
    `generate()`, a process waiting at a collective may be woken late on
    a machine whose idle cores halt, and the mean lies above the
    median."""
    states = torch.ones(4, 1, hidden_dim)
    times = []
    for index in range(220):
        start = time.perf_counter()
        while (time.perf_counter() - start) * 1000 < work_ms:
            pass
        start = time.perf_counter()
        dist.all_reduce(states)
        if index >= 20:
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times), 1000 * statistics.mean(times)


def run_model(name, lora_rank, args, inputs):
    """A row per mode: times per token, ratios, whether the tokens match
    and, under a distribution, one call's moves."""
    modes = ["none"] + [m for m in args.modes.split(",") if m != "none"]
    models = {mode: build(name, mode, args.preset, lora_rank) for mode in modes}
    wall = {mode: [] for mode in modes}
    cpu = {mode: [] for mode in modes}
    tokens = {}
    for _ in range(args.rounds):
        for mode, model in models.items():
            ms, cpu_ms, out = time_model(
                name, mode, model, inputs, args.new_tokens
            )
            wall[mode].append(ms)
            cpu[mode].append(cpu_ms)
            tokens[mode] = np.asarray(out)
    rows = []
    for mode in modes:
        moves = {}
        if mode != "none":
            set_distribution(mode, BACKBONES[name])
            moves = counted_moves(models[mode], inputs)
            hidden = PRESETS[args.preset]["backbone"]["hidden_dim"]
            median, _ = all_reduce_ms(hidden)
            moves["all-reduce ms"] = round(median, 3)
            median, mean = all_reduce_ms(hidden, work_ms=3.0)
            moves["all-reduce ms after 3 ms of work, median"] = round(median, 3)
            moves["all-reduce ms after 3 ms of work, mean"] = round(mean, 3)
        rows.append(
            {
                "model": f"{name}, LoRA {lora_rank}" if lora_rank else name,
                "mode": mode,
                "ms_per_token": wall[mode],
                "cpu_ms_per_token": cpu[mode],
                "ratio": _ratio(wall, mode),
                "cpu_ratio": _ratio(cpu, mode),
                "same_tokens": bool(
                    np.array_equal(tokens[mode], tokens["none"])
                ),
                "moves_per_call": moves,
            }
        )
    keras.distribution.set_distribution(None)
    return rows


def _ratio(times, mode):
    return statistics.median(times[mode]) / statistics.median(times["none"])


def header(args):
    """The run's machine, versions, commit, load and settings."""
    device = (
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    ).stdout.strip()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{device}, {dist.get_world_size()} process(es); torch "
        f"{torch.__version__}, keras {keras.__version__}, keras-hub "
        f"{keras_hub.__version__}; preset {args.preset}, {args.precision}, "
        f"4 prompts of {args.prompt} tokens, {args.new_tokens} new tokens, "
        f"greedy; median of 3 calls per round, {args.rounds} rounds; "
        f"commit {commit}; load average at the end {load}"
    )


def report(rows, args):
    """The results as Markdown."""
    lines = [
        header(args),
        "",
        "| model | mode | ms per token (rounds) | × none | CPU ms per token "
        "(rounds) | × none | same tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        wall = ", ".join(f"{t:.1f}" for t in row["ms_per_token"])
        cpu = ", ".join(f"{t:.1f}" for t in row["cpu_ms_per_token"])
        lines.append(
            f"| {row['model']} | {row['mode']} | {wall} "
            f"| {row['ratio']:.2f} | {cpu} | {row['cpu_ratio']:.2f} "
            f"| {row['same_tokens']} |"
        )
    for row in rows:
        if row["moves_per_call"]:
            lines.extend(
                [
                    "",
                    f"{row['model']} {row['mode']}: local tensor moves of "
                    "one call (prompt and tokens), and its torch calls "
                    "under the step's mode:",
                ]
            )
            lines.extend(
                f"- {count}: {kind}"
                for kind, count in row["moves_per_call"].items()
            )
            lines.append(_collective_floor(row, rows, args))
    return "\n".join(lines) + "\n"


def _collective_floor(row, rows, args):
    """A line: the collectives' time per token at the measured latency,
    beside the time per token without a distribution."""
    moves = row["moves_per_call"]
    tokens = args.new_tokens + 1  # The prompt's call, then each token's.
    per_token = moves[COLLECTIVES] / tokens
    floor = per_token * moves["all-reduce ms"]
    none = next(
        r for r in rows if r["model"] == row["model"] and r["mode"] == "none"
    )
    none_ms = statistics.median(none["ms_per_token"])
    return (
        f"\n{row['model']} {row['mode']}: {per_token:.1f} collectives per "
        "call of the model (the prompt's, then each token's); at the "
        f"latency of one all-reduce alone ({moves['all-reduce ms']:.2f} ms "
        f"here) they take at least {floor:.1f} ms per token, "
        f"{floor / none_ms:.2f} times the {none_ms:.1f} ms per token without "
        "a distribution; the rest is each process's own work and its waits "
        "for the other."
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="mid", choices=sorted(PRESETS))
    parser.add_argument("--models", default="gemma")
    parser.add_argument("--modes", default="mp")
    parser.add_argument(
        "--precision", default="float32", choices=("float32", "mixed_bfloat16")
    )
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--lora",
        default="0",
        help="LoRA ranks, comma-separated; 0: no LoRA factors.",
    )
    parser.add_argument("--out", default=None, help="Results folder.")
    parser.add_argument("--tag", default="n2_keras_hub_generate")
    args = parser.parse_args()
    keras.distribution.initialize()
    keras.mixed_precision.set_global_policy(args.precision)
    vocab = PRESETS[args.preset]["backbone"]["vocabulary_size"]
    ids = np.zeros((4, args.prompt + args.new_tokens), "int32")
    ids[:, : args.prompt] = np.random.default_rng(0).integers(
        1, vocab, (4, args.prompt)
    )
    inputs = {"token_ids": ids, "padding_mask": (ids > 0).astype("int32")}
    rows = []
    for name in args.models.split(","):
        for lora_rank in (int(rank) for rank in args.lora.split(",")):
            rows.extend(run_model(name, lora_rank, args, inputs))
    if dist.get_rank() == 0:
        text = report(rows, args)
        print(text, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, args.tag)
            with open(f"{path}.json", "w") as f:
                json.dump({"header": header(args), "rows": rows}, f, indent=1)
            with open(f"{path}.md", "w") as f:
                f.write(text)
    dist.destroy_process_group()
    sys.exit(0 if all(row["same_tokens"] for row in rows) else 1)


if __name__ == "__main__":
    main()
