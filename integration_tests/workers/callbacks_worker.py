"""Training callbacks under a distribution, compared with one process.

Usage: callbacks_worker.py MODE [MODE ...], MODE being `single`, `dp`
(`DataParallel`) or `mp` (`ModelParallel` on a (1, N) mesh with sharded
kernels). For each MODE it reports, under `<MODE>/...`:
- `early_stopping`: the epochs run and the history when `EarlyStopping`
  stops training on a loss that improves too slowly, and whether each
  batch end of an `async_safe` callback ran on the main thread;
- `plateau`: the learning rate at the start of every epoch under
  `ReduceLROnPlateau`, and the history;
- `nan`: the batches run before `TerminateOnNaN` stops training on a loss
  that becomes NaN (one input row is NaN), and `model.stop_training`.
"""

import sys
import threading

import numpy as np
import worker_utils
from worker_utils import record

import keras

SAMPLES, BATCH = 64, 8


# Layouts under `mp`: column- then row-sharded kernels.
MP_LAYOUTS = {"up/kernel": (None, "model"), "down/kernel": ("model", None)}


def build(learning_rate=0.05):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu", name="up")(inputs)
    x = keras.layers.Dense(8, activation="relu", name="down")(x)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(x))
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate, momentum=0.9),
        loss="mse",
    )
    return model


def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(SAMPLES, 8)).astype("float32")
    y = (x[:, :1] * 2.0 + 0.1).astype("float32")
    return x, y


class LearningRates(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rates = []

    def on_epoch_begin(self, epoch, logs=None):
        rate = self.model.optimizer.learning_rate
        self.rates.append(float(keras.ops.convert_to_numpy(rate)))


class BatchCount(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


class BatchEndThreads(keras.callbacks.Callback):
    """Notes whether each `on_train_batch_end` runs on the main thread.

    It declares itself `async_safe`, so upstream Keras may dispatch it to
    a worker thread when no other callback forbids that.
    """

    async_safe = True

    def __init__(self):
        super().__init__()
        self.on_main_thread = []

    def on_train_batch_end(self, batch, logs=None):
        main = threading.current_thread() is threading.main_thread()
        self.on_main_thread.append(main)


def history_of(history):
    return {k: [float(v) for v in vs] for k, vs in history.history.items()}


def fit(callbacks, epochs, x=None):
    """Builds a fresh model and fits it on `data()` (or `x`) in order."""
    model = build()
    data_x, y = data()
    history = model.fit(
        data_x if x is None else x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return model, history


def early_stopping(mode):
    stopping = keras.callbacks.EarlyStopping(
        monitor="loss", min_delta=0.05, patience=1
    )
    threads = BatchEndThreads()
    _, history = fit([stopping, threads], epochs=30)
    record(f"{mode}/early_stopping/epochs", len(history.epoch))
    record(
        f"{mode}/early_stopping/batch_end_on_main_thread",
        threads.on_main_thread,
    )
    record(f"{mode}/early_stopping/history", history_of(history))


def plateau(mode):
    reduce_lr = keras.callbacks.ReduceLROnPlateau(
        monitor="loss", factor=0.5, patience=0, min_delta=0.05
    )
    rates = LearningRates()
    _, history = fit([reduce_lr, rates], epochs=6)
    record(f"{mode}/plateau/rates", rates.rates)
    record(f"{mode}/plateau/history", history_of(history))


def terminate_on_nan(mode):
    x, _ = data()
    x[3 * BATCH + 5, 2] = np.nan  # A row of the fourth batch.
    batches = BatchCount()
    model, _ = fit([keras.callbacks.TerminateOnNaN(), batches], epochs=2, x=x)
    record(f"{mode}/nan/batches", batches.batches)
    record(f"{mode}/nan/stop_training", bool(model.stop_training))


def run(mode):
    """Runs the three callback scenarios under the distribution of `mode`."""
    worker_utils.set_distribution(mode, MP_LAYOUTS)
    early_stopping(mode)
    plateau(mode)
    terminate_on_nan(mode)


def main():
    worker_utils.run_all(run, sys.argv[1:])


if __name__ == "__main__":
    main()
