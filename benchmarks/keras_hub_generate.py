"""`generate()` time per token under a distribution, against none.

Builds a keras-hub `GemmaCausalLM` (`preprocessor=None`, the `mid` preset
of `keras_hub_step.py`, random weights) once without a distribution and
once under `ModelParallel` on a (1, N) mesh laid out by
`GemmaBackbone.get_layout_map`, and times greedy `generate()` on token
ids, alternating the two models: the median of 3 calls after one warm-up
call, per new token. Prints both times, their ratio and whether the
tokens are the same. Run it under torchrun:

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 \\
        benchmarks/keras_hub_generate.py --new-tokens 16
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402
from keras_hub_step import PRESETS  # noqa: E402
from keras_hub_step import set_distribution  # noqa: E402

import keras  # noqa: E402


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
    tokens = {}
    for _ in range(args.rounds):
        for mode, model in models.items():
            set_distribution(mode, keras_hub.models.GemmaBackbone)
            model.generate(inputs, stop_token_ids=None)
            times = []
            for _ in range(3):
                start = time.perf_counter()
                out = model.generate(inputs, stop_token_ids=None)
                times.append(time.perf_counter() - start)
            per_token[mode].append(
                1000 * statistics.median(times) / args.new_tokens
            )
            tokens[mode] = np.asarray(out["token_ids"])
    if dist.get_rank() == 0:
        none, mp = (statistics.median(per_token[m]) for m in ("none", "mp"))
        print(f"ms per token: none {per_token['none']}, mp {per_token['mp']}")
        print(f"mp / none: {mp / none:.2f}")
        print("same tokens:", np.array_equal(tokens["none"], tokens["mp"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
