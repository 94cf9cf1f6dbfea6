"""Trains a small MLP with a LayoutMap under `keras.distribution`.

Run on CPU with two gloo processes:

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 \
        examples/mlp_model_parallel.py

Every process prints the placements and local shape of each variable, then
trains a few steps; the logged losses are the same on every process and
equal to a single-process run's.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402

import keras  # noqa: E402


def build_model():
    inputs = keras.Input((16,), name="features")
    x = keras.layers.Dense(32, activation="relu", name="dense_1")(inputs)
    x = keras.layers.Dense(32, activation="relu", name="dense_2")(x)
    outputs = keras.layers.Dense(4, name="head")(x)
    return keras.Model(inputs, outputs, name="mlp")


def main():
    keras.distribution.initialize()
    keras.utils.set_random_seed(1234)
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((len(devices),), ("model",), devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense_1/kernel"] = (None, "model")
    layout_map["dense_1/bias"] = ("model",)
    layout_map["dense_2/kernel"] = ("model", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )

    model = build_model()
    rank = int(os.environ.get("RANK", "0"))
    for variable in model.variables:
        value = variable.value
        print(
            f"[rank {rank}] {variable.path:24s} shape={variable.shape} "
            f"placements={tuple(value.placements)} "
            f"local_shape={tuple(value.to_local().shape)}",
            flush=True,
        )

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.integers(0, 4, size=(64,))
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    print(f"[rank {rank}] losses: {history.history['loss']}", flush=True)


if __name__ == "__main__":
    main()
