"""Helpers imported by worker scripts (they run under torchrun)."""

import contextlib
import json
import os

import numpy as np

import keras

_REPORT = {}
# The prefix of the keys recorded now (see `prefixed`).
_PREFIX = [""]


def rank():
    return int(os.environ.get("RANK", "0"))


def record(key, value):
    """Records a JSON-able value (numpy arrays become nested lists)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, (np.floating, np.integer)):
        value = value.item()
    _REPORT[_PREFIX[-1] + key] = value


def record_error(key, fn):
    """Records the message of the exception `fn()` raises (or None)."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the message is the result
        record(key, f"{type(error).__name__}: {error}")
        return
    record(key, None)


class BatchLosses(keras.callbacks.Callback):
    """Keeps the loss that `fit` logs after every batch, as a float, and
    the name of the type it was logged as (`types`)."""

    def __init__(self):
        super().__init__()
        self.losses = []
        self.types = []

    def on_train_batch_end(self, batch, logs=None):
        self.types.append(type(logs["loss"]).__name__)
        self.losses.append(float(logs["loss"]))


@contextlib.contextmanager
def prefixed(prefix):
    """Values recorded inside are reported as `<prefix>/<key>`."""
    _PREFIX.append(f"{_PREFIX[-1]}{prefix}/")
    try:
        yield
    finally:
        _PREFIX.pop()


def report():
    """Writes this rank's recorded values for the test process.

    The worker then ends as a user's script does: `main` returns, and the
    process group `keras.distribution.initialize` made is torn down at
    exit (`process_group.destroy_at_exit`). An abort at exit fails the
    launch.
    """
    result_dir = os.environ["KERAS_DTENSOR_TEST_RESULT_DIR"]
    path = os.path.join(result_dir, f"rank{rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(_REPORT, f)
    os.replace(path + ".tmp", path)


def set_distribution(mode, layouts=None, auto_shard_dataset=True):
    """Sets the distribution that a run's MODE names.

    Args:
        mode: `"single"` (no distribution), `"dp"` (`DataParallel` on every
            device), `"mp"` (`ModelParallel` on a (1, N) ("batch", "model")
            mesh) or `"2d"` (`ModelParallel` on a (2, N / 2) mesh).
        layouts: for `"mp"` and `"2d"`, the `LayoutMap` entries, a dict of
            variable or output paths to layouts.
        auto_shard_dataset: passed to the distribution.
    """
    if mode == "single":
        keras.distribution.set_distribution(None)
        return
    devices = keras.distribution.list_devices()
    if mode == "dp":
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(
                devices=devices, auto_shard_dataset=auto_shard_dataset
            )
        )
        return
    shape = {"mp": (1, len(devices)), "2d": (2, len(devices) // 2)}[mode]
    mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    for path, layout in (layouts or {}).items():
        layout_map[path] = layout
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, auto_shard_dataset=auto_shard_dataset
        )
    )


def run_all(run, items, mode_of=lambda item: item):
    """Calls `run(item)` for every item, then writes this rank's report.

    `keras.distribution.initialize()` runs first when any item's mode (as
    `mode_of` gives it) is not `"single"`; the distribution is unset after
    each item.
    """
    if any(mode_of(item) != "single" for item in items):
        keras.distribution.initialize()
    for item in items:
        run(item)
        keras.distribution.set_distribution(None)
    report()
