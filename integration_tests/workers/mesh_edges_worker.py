"""Edges of the API that a single-mesh test does not reach.

Usage: mesh_edges_worker.py CASE [CASE ...]; the values of each CASE are
reported under `<CASE>/`.
  `single`: the reference, without a distribution.
  `mesh:B,M`: `ModelParallel` on a (B, M) ("batch", "model") mesh whose
    layout map shards kernels and outputs on "model", also where an axis
    has size 1 (JAX treats it as absent): fit, evaluate (with
    `TruePositives` and `BinaryAccuracy`) and predict.
  `parts`: `DataParallel(auto_shard_dataset=False)` where the processes
    pass parts of different sizes (16 and 12 rows on 2 processes), then
    parts whose feature shapes differ.
  `misuse`: numpy in `distribute_tensor`, a model built before its
    distribution, and an unavailable device type.
"""

import os
import sys

import numpy as np
import worker_utils
from worker_utils import record
from worker_utils import record_error

import keras

FEATURES = 4
ROWS = 32
# The rows that each process passes in the `parts` case, by rank.
PARTS = {0: slice(0, 16), 1: slice(16, 28)}


def data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    return x, y


def build_model():
    keras.utils.set_random_seed(11)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="relu", name="a"),
            keras.layers.Dense(1, activation="sigmoid", name="b1"),
        ],
        name="edges",
    )
    model.compile(
        keras.optimizers.SGD(0.1, momentum=0.9),
        "binary_crossentropy",
        metrics=[
            keras.metrics.TruePositives(name="tp"),
            keras.metrics.BinaryAccuracy(name="accuracy"),
        ],
    )
    return model


def set_mesh(shape):
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*a/kernel"] = (None, "model")
    layout_map[".*a/bias"] = ("model",)
    layout_map["edges/a/output"] = ("batch", "model")
    # The kernel of `Dense(1)` splits its one column where "model" has
    # size 1 (there it splits nothing), else its rows.
    kernel_axes = (None, "model") if shape[1] == 1 else ("model", None)
    layout_map[".*b1/kernel"] = kernel_axes
    layout_map["edges/b1/output"] = ("batch", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )


def train_and_report(model, x, y):
    """The numbers every case compares with the reference."""
    losses = worker_utils.BatchLosses()
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[losses],
    )
    record("batch_losses", losses.losses)
    record(
        "history",
        {k: [float(v) for v in vs] for k, vs in history.history.items()},
    )
    record(
        "evaluate",
        [float(v) for v in model.evaluate(x, y, batch_size=16, verbose=0)],
    )
    record("predict", model.predict(x, batch_size=16, verbose=0))
    record("weights", [w.tolist() for w in model.get_weights()])


def run_single():
    x, y = data()
    train_and_report(build_model(), x, y)
    # The `parts` case's numbers, on the whole 28-row batch.
    rows = slice(0, PARTS[1].stop)
    model = build_model()
    record("parts/test", model.test_on_batch(x[rows], y[rows]))
    record("parts/predict", model.predict(x[rows], verbose=0))
    record("parts/train", model.train_on_batch(x[rows], y[rows]))
    record("parts/weights", [w.tolist() for w in model.get_weights()])
    record("parts/evaluate", model.evaluate(x[rows], y[rows], verbose=0))


def run_mesh(shape):
    set_mesh(shape)
    x, y = data()
    model = build_model()
    kernel = model.get_layer("b1").kernel.value
    record("b1_kernel_placements", [str(p) for p in kernel.placements])
    record(
        "a_kernel_local_shape",
        list(model.get_layer("a").kernel.value.to_local().shape),
    )
    train_and_report(model, x, y)
    from keras.src.backend.torch import batch_local

    plans = batch_local.plans_of(model).values()
    record(
        "model_ran_locally",
        any(plan is not None for plan in plans),
    )


def run_parts():
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(auto_shard_dataset=False)
    )
    x, y = data()
    rows = PARTS[worker_utils.rank()]
    model = build_model()
    record("test", model.test_on_batch(x[rows], y[rows]))
    record("predict", model.predict(x[rows], verbose=0))
    record("train", model.train_on_batch(x[rows], y[rows]))
    record("weights", [w.tolist() for w in model.get_weights()])
    # `evaluate` batches each process's part in 8 rows: parts of 8 and 8,
    # then 8 and 4.
    record(
        "evaluate", model.evaluate(x[rows], y[rows], batch_size=8, verbose=0)
    )
    features = FEATURES - worker_utils.rank()
    record_error(
        "feature_shape_error",
        lambda: model.test_on_batch(
            np.ones((4, features), "float32"), np.ones((4, 1), "float32")
        ),
    )


def run_misuse():
    early = build_model()
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    mesh = keras.distribution.distribution().device_mesh
    layout = keras.distribution.TensorLayout(("batch", None), mesh)
    value = np.arange(12, dtype="float32").reshape(4, 3)
    distributed = keras.distribution.distribute_tensor(value, layout)
    record("numpy/type", type(distributed).__name__)
    record("numpy/placements", [str(p) for p in distributed.placements])
    record("numpy/local", distributed.to_local().numpy())
    x, _ = data()
    record_error("built_before/predict", lambda: early.predict(x, verbose=0))
    record_error("built_before/call", lambda: early(x))
    record_error("gpu_devices", lambda: keras.distribution.list_devices("gpu"))


def run(case):
    with worker_utils.prefixed(case):
        if case == "single":
            run_single()
        elif case.startswith("mesh:"):
            run_mesh(tuple(int(s) for s in case[5:].split(",")))
        elif case == "parts":
            run_parts()
        else:
            run_misuse()


if __name__ == "__main__":
    os.environ.setdefault("KERAS_BACKEND", "torch")
    worker_utils.run_all(run, sys.argv[1:])
