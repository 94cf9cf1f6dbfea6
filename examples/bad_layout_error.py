"""Shows the error of a layout that does not fit a variable.

Run on CPU with two gloo processes:

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 \
        examples/bad_layout_error.py

The layout map splits the kernel of `Dense(3)`, shape (8, 3), along its
3 columns over a mesh axis of 2 processes. Building the model raises a
`ValueError` naming the variable, its shape, the layout, the mesh and
the dimension that does not divide; every process prints it and the
script exits with status 0.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402


def main():
    keras.distribution.initialize()
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((len(devices),), ("model",), devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["head/kernel"] = (None, "model")  # 3 columns over 2
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )
    rank = int(os.environ.get("RANK", "0"))
    try:
        inputs = keras.Input((8,))
        outputs = keras.layers.Dense(3, name="head")(inputs)
        keras.Model(inputs, outputs)
    except ValueError as error:
        print(f"[rank {rank}] ValueError: {error}", flush=True)
    else:
        raise SystemExit("expected a ValueError")


if __name__ == "__main__":
    main()
