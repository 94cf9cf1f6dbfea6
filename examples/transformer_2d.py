"""Trains a small transformer under 2-D (`batch` x `model`) parallelism.

Run on CPU with four gloo processes (a 2 x 2 mesh), or two (1 x 2):

    KERAS_BACKEND=torch torchrun --nproc_per_node=4 \
        examples/transformer_2d.py

The batch is split over the `batch` axis; attention heads and the MLP's
hidden units are split over the `model` axis (Megatron layout: column-
then row-parallel kernels), and the blocks' outputs are kept replicated on
`model`, which makes each block cost one all-reduce forward and one
backward. Process 0 prints the layout of a few variables; every process
prints its losses, which are the same on every process and equal a
single-process run's. `--steps N` trains N steps (one loss each) instead of
three epochs.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402

import keras  # noqa: E402

SEQ, VOCAB, HIDDEN, HEADS, BLOCKS = 16, 64, 32, 4, 2


def transformer_block(x, name):
    attention = keras.layers.MultiHeadAttention(
        num_heads=HEADS, key_dim=HIDDEN // HEADS, name=f"{name}_attention"
    )(x, x)
    x = keras.layers.LayerNormalization(name=f"{name}_norm1")(x + attention)
    hidden = keras.layers.Dense(
        4 * HIDDEN, activation="gelu", name=f"{name}_mlp_up"
    )(x)
    hidden = keras.layers.Dense(HIDDEN, name=f"{name}_mlp_down")(hidden)
    return keras.layers.LayerNormalization(name=f"{name}_norm2")(x + hidden)


def build_model():
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, HIDDEN, name="embed")(tokens)
    for i in range(BLOCKS):
        x = transformer_block(x, f"block{i}")
    logits = keras.layers.Dense(VOCAB, name="logits")(x)
    return keras.Model(tokens, logits, name="transformer")


def layout_map_for(mesh):
    """Megatron tensor parallelism on `model`, data parallelism on `batch`."""
    layout_map = keras.distribution.LayoutMap(mesh)
    # Heads split over `model`: query/key/value kernels are column-parallel
    # (hidden, heads, head_dim), the output projection row-parallel.
    layout_map[".*attention/(query|key|value)/kernel"] = (None, "model", None)
    layout_map[".*attention/(query|key|value)/bias"] = ("model", None)
    layout_map[".*attention/attention_output/kernel"] = ("model", None, None)
    layout_map[".*mlp_up/kernel"] = (None, "model")
    layout_map[".*mlp_up/bias"] = ("model",)
    layout_map[".*mlp_down/kernel"] = ("model", None)
    # Activations between blocks: split by batch, replicated on `model`.
    layout_map[".*attention/output"] = ("batch", None, None)
    layout_map[".*mlp_down/output"] = ("batch", None, None)
    return layout_map


def parse_args():
    """Reads `--steps`: 0 (the default) trains three epochs of 4 steps."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="train this many steps (one loss each) instead of 3 epochs",
    )
    return parser.parse_args()


def fit_arguments(steps):
    """`model.fit` arguments: 3 epochs, or `steps` epochs of one step."""
    if steps > 0:
        return {"epochs": steps, "steps_per_epoch": 1}
    return {"epochs": 3}


def main():
    args = parse_args()
    keras.distribution.initialize()
    keras.utils.set_random_seed(1234)
    devices = keras.distribution.list_devices()
    rows = 2 if len(devices) % 4 == 0 else 1
    mesh = keras.distribution.DeviceMesh(
        (rows, len(devices) // rows), ("batch", "model"), devices
    )
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map_for(mesh))
    )

    model = build_model()
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"mesh: {dict(zip(mesh.axis_names, mesh.shape))}")
        for variable in model.variables[:8]:
            value = variable.value
            print(
                f"{variable.path:36s} shape={tuple(variable.shape)} "
                f"placements={tuple(value.placements)} "
                f"local_shape={tuple(value.to_local().shape)}"
            )

    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(64, SEQ)).astype("int32")
    y = np.roll(x, -1, axis=1)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(
        x,
        y,
        batch_size=16,
        shuffle=True,
        verbose=0,
        **fit_arguments(args.steps),
    )
    print(f"[rank {rank}] losses: {history.history['loss']}", flush=True)
    if rank == 0:
        print(f"accuracy: {history.history['accuracy']}", flush=True)


if __name__ == "__main__":
    main()
