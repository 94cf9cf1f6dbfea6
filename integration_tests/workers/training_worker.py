"""Trains a model under a distribution and reports every number it logs.

Usage: training_worker.py MODE MODEL OPTIMIZER [EXTRA]
  MODE: `single` (no distribution), `dp` (DataParallel), `mp` (ModelParallel
    on a (1, N) mesh), `2d` (ModelParallel on a (2, N/2) mesh).
  MODEL: `mlp` or `transformer`.
  OPTIMIZER: `sgd` (with momentum) or `adamw`.
  EXTRA: comma-separated options: `shuffle`, `jit`, `uneven`, `dict`,
    `pydataset`, `dataloader`, `dropout`.
"""

import sys

import numpy as np
import worker_utils
from worker_utils import record

import keras

MODE, MODEL, OPTIMIZER = sys.argv[1:4]
EXTRA = set(sys.argv[4].split(",")) if len(sys.argv) > 4 else set()
NUM_SAMPLES = 35 if "uneven" in EXTRA else 32
BATCH_SIZE = 8
SEQ, VOCAB, HIDDEN = 6, 16, 16


def transformer_block(x, name):
    attention = keras.layers.MultiHeadAttention(
        num_heads=2, key_dim=HIDDEN // 2, name=f"{name}_attention"
    )(x, x)
    x = keras.layers.LayerNormalization(name=f"{name}_norm1")(x + attention)
    hidden = keras.layers.Dense(
        2 * HIDDEN, activation="gelu", name=f"{name}_mlp_up"
    )(x)
    hidden = keras.layers.Dense(HIDDEN, name=f"{name}_mlp_down")(hidden)
    return keras.layers.LayerNormalization(name=f"{name}_norm2")(x + hidden)


def build_model():
    if MODEL == "mlp":
        inputs = keras.Input((12,), name="features")
        x = keras.layers.Dense(16, activation="relu", name="up")(inputs)
        if "dropout" in EXTRA:
            x = keras.layers.Dropout(0.5, name="dropout")(x)
        x = keras.layers.Dense(16, activation="relu", name="down")(x)
        outputs = keras.layers.Dense(4, name="head")(x)
        return keras.Model(inputs, outputs)
    inputs = keras.Input((SEQ,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, HIDDEN, name="embed")(inputs)
    for i in range(2):
        x = transformer_block(x, f"block{i}")
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(4, name="head")(x)
    return keras.Model(inputs, outputs)


def layout_map_for(mesh):
    layout_map = keras.distribution.LayoutMap(mesh)
    if MODEL == "mlp":
        layout_map["up/kernel"] = (None, "model")
        layout_map["up/bias"] = ("model",)
        layout_map["down/kernel"] = ("model", None)
        return layout_map
    layout_map["embed/embeddings"] = (None, "model")
    layout_map[".*attention/(query|key|value)/kernel"] = (None, "model", None)
    layout_map[".*attention/(query|key|value)/bias"] = ("model", None)
    layout_map[".*attention/attention_output/kernel"] = ("model", None, None)
    layout_map[".*mlp_up/kernel"] = (None, "model")
    layout_map[".*mlp_up/bias"] = ("model",)
    layout_map[".*mlp_down/kernel"] = ("model", None)
    return layout_map


def set_distribution():
    if MODE == "single":
        return
    keras.distribution.initialize()
    devices = keras.distribution.list_devices()
    n = len(devices)
    if MODE == "dp":
        distribution = keras.distribution.DataParallel(devices=devices)
    else:
        shape = (1, n) if MODE == "mp" else (2, n // 2)
        mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map_for(mesh)
        )
    keras.distribution.set_distribution(distribution)


def make_data():
    rng = np.random.default_rng(0)
    if MODEL == "mlp":
        x = rng.normal(size=(NUM_SAMPLES, 12)).astype("float32")
    else:
        x = rng.integers(0, VOCAB, size=(NUM_SAMPLES, SEQ)).astype("int32")
    y = rng.integers(0, 4, size=(NUM_SAMPLES,)).astype("int32")
    return x, y


class BatchLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def make_inputs(x, y):
    """Returns `fit` keyword arguments in the requested input form."""
    if "dict" in EXTRA:
        name = "features" if MODEL == "mlp" else "tokens"
        return {"x": {name: x}, "y": y, "batch_size": BATCH_SIZE}
    if "pydataset" in EXTRA:

        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return int(np.ceil(len(x) / BATCH_SIZE))

            def __getitem__(self, i):
                s = slice(i * BATCH_SIZE, (i + 1) * BATCH_SIZE)
                return x[s], y[s]

        return {"x": Batches()}
    if "dataloader" in EXTRA:
        import torch

        dataset = torch.utils.data.TensorDataset(
            torch.as_tensor(x), torch.as_tensor(y)
        )
        return {
            "x": torch.utils.data.DataLoader(dataset, batch_size=BATCH_SIZE)
        }
    return {"x": x, "y": y, "batch_size": BATCH_SIZE}


def main():
    set_distribution()
    keras.utils.set_random_seed(1337)
    model = build_model()
    record("initial_weights", [w.tolist() for w in model.get_weights()])
    optimizer = (
        keras.optimizers.SGD(0.05, momentum=0.9)
        if OPTIMIZER == "sgd"
        else keras.optimizers.AdamW(0.01, weight_decay=0.01)
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[
            keras.metrics.SparseCategoricalAccuracy(name="acc"),
            keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2"),
        ],
        jit_compile="jit" in EXTRA,
    )
    x, y = make_data()
    losses = BatchLosses()
    history = model.fit(
        **make_inputs(x, y),
        epochs=2,
        shuffle="shuffle" in EXTRA,
        verbose=0,
        callbacks=[losses],
    )
    record("batch_losses", losses.losses)
    record(
        "history",
        {k: [float(v) for v in vs] for k, vs in history.history.items()},
    )
    record("final_weights", [w.tolist() for w in model.get_weights()])
    record("iterations", int(model.optimizer.iterations.numpy()))
    evaluation = model.evaluate(
        x, y, batch_size=BATCH_SIZE, verbose=0, return_dict=True
    )
    record("evaluate", {k: float(v) for k, v in evaluation.items()})
    predictions = model.predict(x, batch_size=BATCH_SIZE, verbose=0)
    record("predict", predictions)
    worker_utils.report()


if __name__ == "__main__":
    main()
