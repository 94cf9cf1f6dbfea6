"""`generate()` time per token under a distribution, against none.

Builds keras-hub causal LMs (`preprocessor=None`, a preset of
`keras_hub_step.py`, random weights, the greedy sampler) once without a
distribution and once under each mode asked for (`dp`, `mp`: see
`keras_hub_step.set_distribution`), and times greedy `generate()` on
token ids, alternating the models: the median of 3 calls after one
warm-up call, per new token. Prints each mode's time, its ratio to no
distribution and whether its tokens are the same. Run it under torchrun:

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 \\
        benchmarks/keras_hub_generate.py --new-tokens 16

Defaults: Gemma, the `mid` preset, `mp`. `--out` writes the report
(`<tag>.md`, `<tag>.json`) there; the exit status is 1 when tokens differ.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from keras_hub_step import BACKBONES  # noqa: E402
from keras_hub_step import PRESETS  # noqa: E402
from keras_hub_step import set_distribution  # noqa: E402

import keras  # noqa: E402

CAUSAL_LMS = {
    "gemma": keras_hub.models.GemmaCausalLM,
    "llama": keras_hub.models.LlamaCausalLM,
}


def build(name, mode, preset):
    """The causal LM `name` of `preset` under `mode`, greedy."""
    set_distribution(mode, BACKBONES[name])
    keras.utils.set_random_seed(1)
    config = PRESETS[preset]
    backbone = BACKBONES[name](**config["backbone"], **config.get(name, {}))
    model = CAUSAL_LMS[name](backbone=backbone, preprocessor=None)
    model.compile(sampler="greedy")
    return model


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_model(name, mode, model, inputs, new_tokens):
    """Milliseconds per new token (median of 3 calls) and the tokens."""
    set_distribution(mode, BACKBONES[name])
    model.generate(inputs, stop_token_ids=None)
    times = []
    for _ in range(3):
        synchronize()
        start = time.perf_counter()
        out = model.generate(inputs, stop_token_ids=None)
        synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times) / new_tokens, out["token_ids"]


def run_model(name, args, inputs):
    """A row per mode: ms per token, ratio, whether the tokens match."""
    modes = ["none"] + [m for m in args.modes.split(",") if m != "none"]
    models = {mode: build(name, mode, args.preset) for mode in modes}
    per_token = {mode: [] for mode in modes}
    tokens = {}
    for _ in range(args.rounds):
        for mode, model in models.items():
            ms, out = time_model(name, mode, model, inputs, args.new_tokens)
            per_token[mode].append(ms)
            tokens[mode] = np.asarray(out)
    keras.distribution.set_distribution(None)
    none = statistics.median(per_token["none"])
    return [
        {
            "model": name,
            "mode": mode,
            "ms_per_token": per_token[mode],
            "ratio": statistics.median(per_token[mode]) / none,
            "same_tokens": bool(np.array_equal(tokens[mode], tokens["none"])),
        }
        for mode in modes
    ]


def report(rows, args):
    device = (
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    )
    lines = [
        f"{device}, {dist.get_world_size()} process(es); torch "
        f"{torch.__version__}, keras {keras.__version__}, keras-hub "
        f"{keras_hub.__version__}; preset {args.preset}, {args.precision}, "
        f"batch 4, prompt {args.prompt}, {args.new_tokens} new tokens, "
        f"greedy; median of 3 calls per round, {args.rounds} rounds",
        "",
        "| model | mode | ms per token (rounds) | × none | same tokens |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        times = ", ".join(f"{t:.1f}" for t in row["ms_per_token"])
        lines.append(
            f"| {row['model']} | {row['mode']} | {times} "
            f"| {row['ratio']:.2f} | {row['same_tokens']} |"
        )
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--out", default=None)
    parser.add_argument("--tag", default="keras_hub_generate")
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
        rows.extend(run_model(name, args, inputs))
    text = report(rows, args)
    if dist.get_rank() == 0:
        print(text, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
                f.write(text)
            with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
                json.dump({"header": text.splitlines()[0], "rows": rows}, f)
    dist.destroy_process_group()
    sys.exit(0 if all(row["same_tokens"] for row in rows) else 1)


if __name__ == "__main__":
    main()
