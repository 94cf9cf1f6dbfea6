"""Random layers under a distribution, compared with one process.

Usage: randomness_worker.py MODE [MODE ...] (under torchrun, or alone for
`single`), MODE being `single`, `dp` (`DataParallel`) or `mp`
(`ModelParallel` on a (1, N) mesh with the hidden layer sharded on
"model"). For each MODE, a model applies random layers in training mode to
a batch whose rows are all equal, and reports, under `<MODE>/<layer>`,
the full output (`predict` returns the global batch) for two calls with
the same seed and one call after it.
"""

import sys

import numpy as np
import worker_utils
from worker_utils import record

import keras

BATCH, FEATURES = 8, 16
SEED = 2024


def random_layers():
    """Random layers by name, applied in training mode."""
    return {
        "dropout": keras.layers.Dropout(0.5),
        "seeded_dropout": keras.layers.Dropout(0.5, seed=7),
        "gaussian_noise": keras.layers.GaussianNoise(1.0, seed=11),
        "gaussian_dropout": keras.layers.GaussianDropout(0.3, seed=13),
    }


class InTraining(keras.layers.Layer):
    """Calls a layer with `training=True`, also from `predict`."""

    def __init__(self, layer, **kwargs):
        super().__init__(**kwargs)
        self.layer = layer

    def call(self, x):
        return self.layer(x, training=True)


# Layouts under `mp`: the hidden layer's kernel and output sharded.
MP_LAYOUTS = {
    "hidden/kernel": (None, "model"),
    "hidden/output": ("batch", "model"),
}


def build(layer):
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(
        FEATURES, kernel_initializer="identity", name="hidden"
    )(inputs)
    return keras.Model(inputs, InTraining(layer)(hidden))


def run(mode):
    worker_utils.set_distribution(mode, MP_LAYOUTS)
    x = np.ones((BATCH, FEATURES), dtype="float32")
    for name in random_layers():
        outputs = []
        for _ in range(2):
            keras.utils.set_random_seed(SEED)
            model = build(random_layers()[name])
            outputs.append(model.predict(x, batch_size=BATCH, verbose=0))
        outputs.append(model.predict(x, batch_size=BATCH, verbose=0))
        record(f"{mode}/{name}/outputs", np.stack(outputs))


def main():
    worker_utils.run_all(run, sys.argv[1:])


if __name__ == "__main__":
    main()
