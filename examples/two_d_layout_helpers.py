"""Trains a small transformer on an (fsdp x model) mesh built by helpers.

Run on CPU with gloo processes (4 gives a 2x2 mesh, 2 a 1x2 mesh):

    KERAS_BACKEND=torch torchrun --nproc_per_node=4 \
        examples/two_d_layout_helpers.py

No layout is written by hand: a tensor-parallel plan splits attention and
feed-forward layers over `model` (Megatron's column/row split), and
`fully_sharded_layouts` adds `fsdp` to every large variable. The model is
built abstractly first, so every layout is checked before any variable
memory exists; leaving the scope creates each variable already sharded.
Process 0 prints each variable's layout and this process's parameter
bytes; every process prints the same losses.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402

import keras  # noqa: E402
import keras_dtensor as kd  # noqa: E402

VOCAB, SEQ, HIDDEN, HEADS, BLOCKS = 256, 16, 64, 4, 2


class TransformerBlock(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(
            HEADS, HIDDEN // HEADS, name="attention"
        )
        self.ln_1 = keras.layers.LayerNormalization(name="ln_1")
        self.ffn_in = keras.layers.Dense(
            4 * HIDDEN, activation="gelu", name="ffn_in"
        )
        self.ffn_out = keras.layers.Dense(HIDDEN, name="ffn_out")
        self.ln_2 = keras.layers.LayerNormalization(name="ln_2")

    def call(self, x):
        # Asking for the scores selects the einsum path: on CPU, DTensor has
        # no sharding rule for the backward of fused flash attention.
        attended, _ = self.attention(x, x, return_attention_scores=True)
        x = self.ln_1(x + attended)
        return self.ln_2(x + self.ffn_out(self.ffn_in(x)))


def build_model():
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, HIDDEN, name="embed")(tokens)
    for i in range(BLOCKS):
        x = TransformerBlock(name=f"block_{i}")(x)
    logits = keras.layers.Dense(VOCAB, name="head")(x)
    return keras.Model(tokens, logits, name="lm")


PLAN = {
    r"block_\d+/attention/(query|key|value)": kd.column_parallel("model"),
    r"block_\d+/attention/attention_output": kd.row_parallel("model"),
    r"block_\d+/ffn_in": kd.column_parallel("model"),
    r"block_\d+/ffn_out": kd.row_parallel("model"),
}


def main():
    keras.distribution.initialize()
    keras.utils.set_random_seed(1234)
    count = keras.distribution.get_device_count()
    mesh = kd.make_device_mesh({"fsdp": -1, "model": 2 if count > 1 else 1})
    rank = int(os.environ.get("RANK", "0"))

    with keras.StatelessScope():  # variables get shapes, not memory
        model = build_model()
        tensor_parallel = kd.tensor_parallel_layouts(model, mesh, PLAN)
        fully_sharded = kd.fully_sharded_layouts(
            model, mesh, "fsdp", min_size=4096, layout_map=tensor_parallel
        )
        layout_map = kd.merge_layouts(model, tensor_parallel, fully_sharded)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map)
        )
    # Leaving the scope created every variable, already sharded.

    local_bytes = total_bytes = 0
    for variable in model.weights:
        local = variable.value.to_local()
        local_bytes += local.numel() * local.element_size()
        total_bytes += local.element_size() * int(np.prod(variable.shape))
        if rank == 0:
            axes = layout_map[variable.path]
            print(
                f"{variable.path:42s} {str(variable.shape):14s} "
                f"axes={axes.axes if axes else 'replicated'} "
                f"local={tuple(local.shape)}",
                flush=True,
            )
    print(
        f"[rank {rank}] mesh {dict(zip(mesh.axis_names, mesh.shape))}: "
        f"parameters {local_bytes} of {total_bytes} bytes "
        f"({local_bytes / total_bytes:.1%})",
        flush=True,
    )

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(64, SEQ)).astype("int32")
    targets = np.roll(tokens, -1, axis=1)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(
        tokens, targets, batch_size=16, epochs=3, shuffle=False, verbose=0
    )
    print(f"[rank {rank}] losses: {history.history['loss']}", flush=True)


if __name__ == "__main__":
    main()
