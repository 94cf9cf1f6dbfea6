"""Model, data, distributions and state capture for the checkpoint workers.

The model is a Sequential of unnamed Dense layers, so that two instances
have different auto-generated names (`sequential_1/dense_3/...`) and only
structural keys match. Every output size divides by 4, so every kernel and
bias can be sharded on a `model` axis of size 2 or 4.
"""

import numpy as np

import keras

SEED = 11
FEATURES = 8
BATCH_SIZE = 4
STEPS_PER_EPOCH = 4

# Distribution name -> (mesh shape, mesh axes); "dp" is DataParallel.
MESHES = {
    "mp": ((2,), ("model",)),
    "mp2d": ((1, 2), ("batch", "model")),
    "mp2x2": ((2, 2), ("batch", "model")),
    "mp4": ((4,), ("model",)),
}


def make_distribution(name):
    """Returns the named distribution (`None` for "single")."""
    if name == "single":
        return None
    devices = keras.distribution.list_devices()
    if name == "dp":
        return keras.distribution.DataParallel(devices=devices)
    shape, axes = MESHES[name]
    mesh = keras.distribution.DeviceMesh(shape, axes, devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = (None, "model")
    layout_map[".*bias"] = ("model",)
    return keras.distribution.ModelParallel(layout_map=layout_map)


def use_distribution(name):
    keras.distribution.set_distribution(make_distribution(name))


def build_model(learning_rate=0.01):
    """A compiled model with the same initial values on every call."""
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(4),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss="mse",
        jit_compile=False,
    )
    return model


def data(epoch_steps=STEPS_PER_EPOCH):
    """Deterministic inputs and targets, `epoch_steps` batches of 4."""
    n = epoch_steps * BATCH_SIZE
    x = np.linspace(-1.0, 1.0, n * FEATURES, dtype="float32")
    x = x.reshape(n, FEATURES)
    y = np.stack(
        [x.sum(1), x[:, 0] * x[:, 1], np.sin(x[:, 2]), x[:, 3] ** 2], axis=1
    ).astype("float32")
    return x, y


def fit(model, epochs=1, **kwargs):
    """Trains on `data()`; returns the per-step loss values."""
    losses = []

    class StepLosses(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            losses.append(float(logs["loss"]))

    x, y = data()
    callbacks = kwargs.pop("callbacks", []) + [StepLosses()]
    model.fit(
        x,
        y,
        batch_size=BATCH_SIZE,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
        **kwargs,
    )
    return losses


def build_optimizer(model):
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def state(model):
    """Full values of the weights and optimizer variables, as lists."""
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "optimizer": [
            np.asarray(v.numpy()).tolist() for v in model.optimizer.variables
        ],
    }


def keyed_state(model, include_optimizer=True):
    """Full values by sharded-checkpoint key."""
    import keras_dtensor

    variables = keras_dtensor.checkpoint_variables(model, include_optimizer)
    return {
        key: np.asarray(variable.numpy()).tolist()
        for key, variable in variables.items()
    }


def placements(variable):
    value = variable.value
    if not hasattr(value, "placements"):
        return None
    return [str(p) for p in value.placements]
