"""Collectives in lockstep: a hidden collective, a skipped one, a dead rank.

Usage: lockstep_worker.py SCENARIO

- `hidden`: the process group is created with `dist.init_process_group`
  (not `initialize`) and no seed is set. Rank 0 alone logs its mesh's
  `backend_mesh` while rank 1 is late (a sleep); then both all-reduce a
  tensor of their own, set a `DataParallel` distribution and build a
  model. A seed broadcast fired by the mesh conversion on rank 0 alone
  would pair with rank 1's all-reduce. Reports the all-reduced value and
  the initial weights.
- `skip`: after one `fit`, rank 0 alone calls `model.evaluate`; then both
  call `model.predict`. Expected to fail on every rank.
- `die`: rank 1 kills itself (SIGKILL) inside the forward pass of the
  third training step. Expected to fail on every rank.

Before the faulty part, each rank writes the time to `rank<r>.start` in
the result folder, so that the test can measure how long the others took
to end.
"""

import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import worker_utils
from torch.distributed.elastic.multiprocessing.errors import record

import keras

RESULT_DIR_ENV = "KERAS_DTENSOR_TEST_RESULT_DIR"


def mark_start():
    """Records when this rank starts the faulty part."""
    path = os.path.join(
        os.environ[RESULT_DIR_ENV], f"rank{worker_utils.rank()}.start"
    )
    with open(path, "w") as f:
        f.write(repr(time.time()))


class DieOnRankOne(keras.layers.Layer):
    """Identity; kills rank 1 during its `die_at`-th training call."""

    def __init__(self, die_at, **kwargs):
        super().__init__(**kwargs)
        self.die_at = die_at
        self.calls = 0

    def call(self, inputs, training=False):
        if training:
            self.calls += 1
            if self.calls == self.die_at and worker_utils.rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        return inputs


def build_model(die_at=None):
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    if die_at is not None:
        x = DieOnRankOne(die_at)(x)
    outputs = keras.layers.Dense(1, name="out")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    return x, y


def data_parallel():
    return keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()
    )


def hidden():
    dist.init_process_group("gloo")
    distribution = data_parallel()
    mark_start()
    if dist.get_rank() == 0:
        print("mesh:", distribution.device_mesh.backend_mesh)
    else:
        time.sleep(1.0)
    value = torch.ones(4) * (dist.get_rank() + 1)
    dist.all_reduce(value)
    worker_utils.record("all_reduced", value.tolist())
    keras.distribution.set_distribution(distribution)
    model = build_model()
    worker_utils.record("weights", [w.tolist() for w in model.get_weights()])


def skip():
    keras.distribution.initialize()
    keras.distribution.set_distribution(data_parallel())
    model = build_model()
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    mark_start()
    if dist.get_rank() == 0:
        model.evaluate(x, y, batch_size=8, verbose=0)
    model.predict(x, batch_size=8, verbose=0)


def die():
    keras.distribution.initialize()
    keras.distribution.set_distribution(data_parallel())
    model = build_model(die_at=3)
    x, y = data()
    mark_start()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)


@record
def main():
    {"hidden": hidden, "skip": skip, "die": die}[sys.argv[1]]()
    worker_utils.report()


if __name__ == "__main__":
    main()
