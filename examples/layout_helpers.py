"""Lays out a small model with the layout helpers, then trains it.

Run on CPU with gloo processes (2 give a 1 x 2 mesh, 4 a 2 x 2 mesh):

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 examples/layout_helpers.py

Process 0 prints each variable's layout axes and local shape; every
process prints the same losses.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402

import keras  # noqa: E402
import keras_dtensor as kd  # noqa: E402

PLAN = {
    r"ffn_\d_in": kd.column_parallel("model"),
    r"ffn_\d_out": kd.row_parallel("model"),
}


def build_model():
    x = inputs = keras.Input((8, 64))
    for i in range(2):
        h = keras.layers.Dense(256, activation="relu", name=f"ffn_{i}_in")(x)
        h = keras.layers.Dense(64, name=f"ffn_{i}_out")(h)
        x = keras.layers.LayerNormalization(name=f"norm_{i}")(x + h)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(x))


def main():
    keras.distribution.initialize()
    keras.utils.set_random_seed(0)  # the same initial values everywhere
    mesh = kd.make_device_mesh({"fsdp": -1, "model": 2})
    with keras.StatelessScope():  # variables get shapes, not memory
        model = build_model()
        tensor_parallel = kd.tensor_parallel_layouts(model, mesh, PLAN)
        layout_map = kd.fully_sharded_layouts(
            model, mesh, "fsdp", min_size=1024, layout_map=tensor_parallel
        )
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map)
        )
    # Leaving the scope created every variable, already sharded.
    kd.remat_layers(model, r"ffn_\d_in")  # recompute these in backward

    rank = int(os.environ.get("RANK", "0"))
    axes = kd.layout_map_axes(layout_map)
    for variable in model.weights if rank == 0 else []:
        local_shape = tuple(variable.value.to_local().shape)
        print(
            f"{variable.path:18s} {str(variable.shape):10s} "
            f"axes={axes.get(variable.path)} local={local_shape}",
            flush=True,
        )

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 64)).astype("float32")
    y = rng.normal(size=(32, 8, 10)).astype("float32")
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    print(f"[rank {rank}] losses: {history.history['loss']}", flush=True)


if __name__ == "__main__":
    main()
