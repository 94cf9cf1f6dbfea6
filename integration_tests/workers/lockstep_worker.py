"""Collectives in lockstep: a hidden collective, a skipped one, a dead rank.

Usage: lockstep_worker.py SCENARIO [SCENARIO ...]; values are reported
under `<SCENARIO>/`.

- `hidden`: the process group is created with `dist.init_process_group`
  (not `initialize`) and no seed is set. Rank 0 alone logs its mesh's
  `backend_mesh` while rank 1 is late (a sleep); then both all-reduce a
  tensor of their own, set a `DataParallel` distribution and build a
  model. A seed broadcast fired by the mesh conversion on rank 0 alone
  would pair with rank 1's all-reduce. Reports the all-reduced value and
  the initial weights. It makes the process group, so it comes first in
  a launch.
- `skip`: after one `fit`, rank 0 alone calls `model.evaluate`; then both
  call `model.predict`. Expected to fail on every rank.
- `die`: rank 1 kills itself (SIGKILL) inside the forward pass of the
  third training step. Expected to fail on every rank.
- `buckets`: DataParallel training with one gradient per bucket, rank 1
  slowed down in backward (a sleeping gradient hook between the layers),
  with a progress bar (printed by rank 0 only). Reports,
  for every bucket sent, the paths of its gradients and whether it was
  sent from the main thread.
- `async_logs`: `evaluate` and `predict` (130 rows, a short last batch)
  with batch-end logs converted after random delays on rank 1 (converting
  gathers the predictions) and an `async_safe` callback noting the
  thread of each batch end and the outputs `predict` logs. Reports the
  loss, the predictions, the threads and the logged outputs under
  `distributed/`, and the same for a model with the same weights built
  and run without a distribution under `single/`.

Before the faulty part, each rank writes the time to `rank<r>.start` in
the result folder, so that the test can measure how long the others took
to end.
"""

import os
import signal
import sys
import threading
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
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
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
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)


class SlowBackwardOnRankOne(keras.layers.Layer):
    """Identity whose gradient waits 50 ms on rank 1."""

    def call(self, inputs, training=False):
        if training and worker_utils.rank() == 1 and inputs.requires_grad:
            inputs.register_hook(lambda grad: time.sleep(0.05))
        return inputs


def buckets():
    from keras.src.backend.torch import gradient_bucket

    keras.distribution.initialize()
    keras.distribution.set_distribution(data_parallel())
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu", name="first")(inputs)
    x = SlowBackwardOnRankOne()(x)
    x = keras.layers.Dense(16, activation="relu", name="second")(x)
    x = SlowBackwardOnRankOne()(x)
    outputs = keras.layers.Dense(1, name="out")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    paths = {id(v.value): v.path for v in model.trainable_variables}
    sent = []
    upstream_launch = gradient_bucket.Bucket.launch

    def launch(bucket):
        sent.append(
            {
                "paths": [paths[id(entry[0])] for entry in bucket.entries],
                "main_thread": threading.current_thread()
                is threading.main_thread(),
            }
        )
        upstream_launch(bucket)

    gradient_bucket.Bucket.launch = launch
    x, y = data()
    try:
        model.fit(x, y, batch_size=8, epochs=2, verbose=1)
    finally:
        gradient_bucket.Bucket.launch = upstream_launch
    worker_utils.record("buckets", sent)


class RaiseInFirstBackward(keras.layers.Layer):
    """Identity whose gradient raises the first time backward reaches it,
    after the gradients of the layers above it have joined their buckets."""

    raised = False

    def call(self, inputs, training=False):
        if training and inputs.requires_grad:
            inputs.register_hook(self.raise_once)
        return inputs

    @classmethod
    def raise_once(cls, grad):
        if not cls.raised:
            cls.raised = True
            raise RuntimeError("backward failed on purpose")
        return grad


def raised():
    """A `fit` whose first backward pass raises, caught, then `fit`
    again; and the same model trained without a distribution."""

    def train(failing):
        keras.utils.set_random_seed(7)
        inputs = keras.Input((8,))
        x = keras.layers.Dense(16, activation="relu", name="first")(inputs)
        if failing:
            x = RaiseInFirstBackward()(x)
        x = keras.layers.Dense(16, activation="relu", name="second")(x)
        outputs = keras.layers.Dense(1, name="out")(x)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer="sgd", loss="mse")
        x, y = data()
        if failing:
            try:
                model.fit(
                    x, y, batch_size=8, epochs=1, verbose=0, shuffle=False
                )
            except RuntimeError as error:
                worker_utils.record("error", str(error).splitlines()[0])
        losses = worker_utils.BatchLosses()
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=2,
            verbose=0,
            shuffle=False,
            callbacks=[losses],
        )
        return losses.losses, [w.tolist() for w in model.get_weights()]

    keras.distribution.set_distribution(None)
    worker_utils.record("reference", train(failing=False))
    keras.distribution.set_distribution(data_parallel())
    worker_utils.record("retried", train(failing=True))


class BatchEndLogs(keras.callbacks.Callback):
    """Notes, at each batch end of `evaluate` and `predict`, whether it
    runs on the main thread, and keeps the outputs `predict` logs.

    It declares itself `async_safe`, so upstream Keras dispatches it (and
    the conversion of its logs) to a worker thread when it is the only
    callback."""

    async_safe = True

    def __init__(self):
        super().__init__()
        self.on_main_thread = {"test": [], "predict": []}
        self.outputs = []

    def note(self, kind):
        main = threading.current_thread() is threading.main_thread()
        self.on_main_thread[kind].append(main)

    def on_test_batch_end(self, batch, logs=None):
        self.note("test")

    def on_predict_batch_end(self, batch, logs=None):
        self.note("predict")
        self.outputs.append(np.asarray(logs["outputs"]).tolist())


def evaluate_and_predict(model, x, y):
    """`evaluate` and `predict` in batches of 4 with a `BatchEndLogs`;
    returns their results and what it noted."""
    logs = BatchEndLogs()
    loss = model.evaluate(x, y, batch_size=4, verbose=0, callbacks=[logs])
    predictions = model.predict(x, batch_size=4, verbose=0, callbacks=[logs])
    return {
        "loss": loss,
        "predictions": predictions.tolist(),
        "on_main_thread": logs.on_main_thread,
        "logged_outputs": logs.outputs,
    }


def async_logs():
    from keras.src.utils import python_utils

    keras.distribution.initialize()
    keras.distribution.set_distribution(data_parallel())
    model = build_model()
    weights = model.get_weights()
    pythonify_logs = python_utils.pythonify_logs

    delays = np.random.default_rng(worker_utils.rank()).uniform(0, 0.03, 99)
    calls = iter(range(10**6))

    def slow_pythonify_logs(logs):
        if worker_utils.rank() == 1:
            time.sleep(delays[next(calls) % len(delays)])
        return pythonify_logs(logs)

    python_utils.pythonify_logs = slow_pythonify_logs
    x, y = data()
    # 130 rows: the last batch of 4 is short.
    x = np.concatenate([np.tile(x, (4, 1)), x[:2]])
    y = np.concatenate([np.tile(y, (4, 1)), y[:2]])
    worker_utils.record("distributed", evaluate_and_predict(model, x, y))
    python_utils.pythonify_logs = pythonify_logs
    # The reference: the same weights in a model built without a
    # distribution, run by this process alone.
    keras.distribution.set_distribution(None)
    single = build_model()
    single.set_weights(weights)
    worker_utils.record("single", evaluate_and_predict(single, x, y))


@record
def main():
    scenarios = {"hidden": hidden, "skip": skip, "die": die}
    scenarios["buckets"] = buckets
    scenarios["async_logs"] = async_logs
    scenarios["raised"] = raised
    for name in sys.argv[1:]:
        with worker_utils.prefixed(name):
            scenarios[name]()
    worker_utils.report()


if __name__ == "__main__":
    main()
