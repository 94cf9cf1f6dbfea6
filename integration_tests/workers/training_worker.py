"""Trains models under distributions and reports every number they log.

Usage: training_worker.py RUN [RUN ...], each RUN is `MODE:MODEL:OPTIMIZER`
or `MODE:MODEL:OPTIMIZER:EXTRA`, and its values are reported under
`<RUN>/<name>`. One launch runs every RUN in turn. A single run may also be
given as `MODE MODEL OPTIMIZER [EXTRA]`; its values are then unprefixed.
  MODE: `single` (no distribution), `dp` (DataParallel), `mp` (ModelParallel
    on a (1, N) mesh), `2d` (ModelParallel on a (2, N/2) mesh).
  MODEL: `mlp`, `lookup` (token ids through an embedding, averaged, then
    the MLP's layers), `transformer`, `recurrent` (masked tokens through
    `LSTM`, `SimpleRNN` and `GRU`, which run Keras's generic RNN loop),
    `cnn` (images through an adapted `Normalization`, `RandomRotation`,
    `Conv2D`, `AveragePooling2D` with uneven "same" padding,
    `BatchNormalization` and `MaxPooling2D`) or `audio` (signals through
    `MelSpectrogram` and `ops.extract_sequences`).
  OPTIMIZER: `sgd` (with momentum) or `adamw`.
  EXTRA: comma-separated options: `shuffle`, `jit`, `uneven`, `dict`,
    `pydataset`, `dataloader`, `dropout`, `custom` (the model's own
    `train_step`, written as the Keras guide for torch writes one),
    `local` (DataParallel with
    `auto_shard_dataset=False`: each process passes only its own part of
    every global batch, to `fit`, `evaluate`, `predict` and a direct call;
    without a distribution the data is passed whole), `reversed` (`fit`
    sees the rows of every batch in reverse order: the same training in
    exact arithmetic, summed in another order), `rolled` (the two halves
    of every batch's rows swapped: a third order).
"""

import os
import sys

import numpy as np
import worker_utils
from worker_utils import record

import keras

BATCH_SIZE = 8
SEQ, VOCAB, HIDDEN = 6, 16, 16
IMAGE_SHAPE = (8, 8, 3)
SIGNAL = 64


class Run:
    """One training configuration, parsed from `MODE:MODEL:OPTIMIZER[:X]`."""

    def __init__(self, spec, prefix=None):
        parts = spec.split(":")
        self.prefix = spec + "/" if prefix is None else prefix
        self.mode, self.model, self.optimizer = parts[:3]
        self.extra = set(parts[3].split(",")) if len(parts) > 3 else set()
        self.num_samples = 35 if "uneven" in self.extra else 32

    def record(self, name, value):
        record(f"{self.prefix}{name}", value)


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


class OwnTrainStepModel(keras.Model):
    """A functional model with its own `train_step`, as a user writes it
    with the torch backend: backward from the loss, then the metrics read
    the predictions."""

    def train_step(self, data):
        import torch

        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        loss.backward()
        weights = self.trainable_weights
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in weights], weights)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return self.get_metrics_result()


def build_model(run):
    model_class = OwnTrainStepModel if "custom" in run.extra else keras.Model
    if run.model == "mlp":
        inputs = keras.Input((12,), name="features")
        return model_class(inputs, mlp_head(inputs, run))
    if run.model == "lookup":
        inputs = keras.Input((SEQ,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(VOCAB, 12, name="embed")(inputs)
        x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
        return model_class(inputs, mlp_head(x, run))
    if run.model == "cnn":
        inputs = keras.Input(IMAGE_SHAPE, name="images")
        normalization = keras.layers.Normalization(name="normalize")
        normalization.adapt(make_data(run)[0])
        outputs = convolutional_head(normalization(inputs))
        return model_class(inputs, outputs, name="cnn")
    if run.model == "audio":
        inputs = keras.Input((SIGNAL,), name="signals")
        return model_class(inputs, audio_head(inputs), name="audio")
    inputs = keras.Input((SEQ,), dtype="int32", name="tokens")
    if run.model == "recurrent":
        return model_class(inputs, recurrent_head(inputs), name="recurrent")
    x = keras.layers.Embedding(VOCAB, HIDDEN, name="embed")(inputs)
    for i in range(2):
        x = transformer_block(x, f"block{i}")
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(4, name="head")(x)
    return model_class(inputs, outputs)


def mlp_head(x, run):
    """The MLP's layers: up, down (with dropout before it under
    `dropout`) and a 4-class head."""
    x = keras.layers.Dense(16, activation="relu", name="up")(x)
    if "dropout" in run.extra:
        x = keras.layers.Dropout(0.5, name="dropout")(x)
    x = keras.layers.Dense(16, activation="relu", name="down")(x)
    return keras.layers.Dense(4, name="head")(x)


def recurrent_head(tokens):
    """Masked embeddings through three recurrent layers, then a head.

    With a mask, `LSTM` and `GRU` run Keras's generic RNN loop, as
    `SimpleRNN` always does; the loop iterates over the batch dimension
    of its first step's output.
    """
    x = keras.layers.Embedding(VOCAB, HIDDEN, mask_zero=True, name="embed")(
        tokens
    )
    x = keras.layers.LSTM(HIDDEN, return_sequences=True, name="lstm")(x)
    x = keras.layers.SimpleRNN(
        HIDDEN, return_sequences=True, go_backwards=True, name="rnn"
    )(x)
    x = keras.layers.GRU(HIDDEN, name="gru")(x)
    return keras.layers.Dense(4, name="head")(x)


def convolutional_head(images):
    """Images through convolution and pooling layers, with a randomly
    rotated copy added.

    `AveragePooling2D` with "same" padding pads its input unevenly with
    `replicate` padding; the rotation fills with a tensor value. The
    rotation returns the batch replicated (Keras's torch affine transform
    loops over the images), so it sits on a branch: the sum with the
    convolution of the images keeps the batch split.
    """
    rotated = keras.layers.RandomRotation(0.1, seed=3, name="rotate")(images)
    # No biases before the batch normalization, which cancels them: their
    # gradients would be rounding noise, which AdamW scales up.
    rotated = keras.layers.Conv2D(8, 1, use_bias=False, name="conv_rotated")(
        rotated
    )
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="conv")(
        images
    )
    x = keras.layers.Add(name="add")([x, rotated])
    x = keras.layers.AveragePooling2D(
        3, strides=2, padding="same", name="avgpool"
    )(x)
    x = keras.layers.BatchNormalization(name="norm")(x)
    x = keras.layers.MaxPooling2D(name="maxpool")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    return keras.layers.Dense(4, name="head")(x)


def audio_head(signals):
    """Signals normalized with given statistics and mixed by a dense
    layer, then taken as a mel spectrogram and as frames, then a head.

    DTensor runs neither transform: `MelSpectrogram` takes a short-time
    Fourier transform, which frames its input with `as_strided`, and
    builds its filters with `unfold`; the frames
    (`ops.extract_sequences`) take `unfold`, and its gradient.
    """
    # Statistics given as constants: tensors the layer makes in its build.
    x = keras.layers.Normalization(mean=0.2, variance=2.0, name="scale")(
        signals
    )
    x = keras.layers.Dense(SIGNAL, name="mix")(x)
    mel = keras.layers.MelSpectrogram(
        fft_length=16,
        sequence_stride=8,
        num_mel_bins=4,
        sampling_rate=8000,
        power_to_db=False,
        name="mel",
    )(x)
    frames = keras.layers.Lambda(
        lambda v: keras.ops.extract_sequences(v, 16, 8), name="frames"
    )(x)
    frames = keras.layers.Dense(2, name="frame_proj")(frames)
    # Along the projection, which `mp` splits: torch's rule accumulated
    # each shard alone where the axis is negative.
    frames = keras.layers.Lambda(
        lambda v: keras.ops.cumsum(v, axis=-1), name="accumulate"
    )(frames)
    x = keras.layers.Concatenate(name="concat")(
        [
            keras.layers.Flatten(name="flatten_mel")(mel),
            keras.layers.Flatten(name="flatten_frames")(frames),
        ]
    )
    # Powers, not decibels: the decibel scale, relative to the batch's
    # largest value, made one process's predictions move by 1.4e-5 when
    # it only reordered its batches. Normalized, the outputs are about one.
    x = keras.layers.LayerNormalization(name="norm")(x)
    return keras.layers.Dense(4, name="head")(x)


# Layouts under `mp` and `2d`, by model: Megatron-style column- then
# row-parallel kernels.
MODEL_LAYOUTS = {
    "mlp": {
        "up/kernel": (None, "model"),
        "up/bias": ("model",),
        "down/kernel": ("model", None),
    },
    # The MLP's layouts, after an embedding split along the vocabulary.
    "lookup": {
        "embed/embeddings": ("model", None),
        "up/kernel": (None, "model"),
        "up/bias": ("model",),
        "down/kernel": ("model", None),
    },
    "transformer": {
        "embed/embeddings": (None, "model"),
        ".*attention/(query|key|value)/kernel": (None, "model", None),
        ".*attention/(query|key|value)/bias": ("model", None),
        ".*attention/attention_output/kernel": ("model", None, None),
        ".*mlp_up/kernel": (None, "model"),
        ".*mlp_up/bias": ("model",),
        ".*mlp_down/kernel": ("model", None),
    },
    "recurrent": {
        "embed/embeddings": (None, "model"),
        ".*(lstm|gru)_cell/kernel": (None, "model"),
        ".*recurrent_kernel": ("model", None),
    },
    "cnn": {"conv/kernel": (None, None, None, "model")},
    "audio": {
        "mix/kernel": (None, "model"),
        "mix/bias": ("model",),
        "frame_proj/kernel": (None, "model"),
    },
}


def make_data(run):
    rng = np.random.default_rng(0)
    n = run.num_samples
    if run.model == "mlp":
        x = rng.normal(size=(n, 12)).astype("float32")
    elif run.model == "cnn":
        x = rng.normal(size=(n,) + IMAGE_SHAPE).astype("float32")
    elif run.model == "audio":
        x = rng.normal(size=(n, SIGNAL)).astype("float32")
    elif run.model == "recurrent":
        # Every other sequence ends in padding (token 0, masked).
        x = rng.integers(1, VOCAB, size=(n, SEQ)).astype("int32")
        x[::2, SEQ - 2 :] = 0
    else:
        x = rng.integers(0, VOCAB, size=(n, SEQ)).astype("int32")
    y = rng.integers(0, 4, size=(n,)).astype("int32")
    return x, y


def passes_local_batches(run):
    """Whether each process passes only its part of every global batch."""
    return "local" in run.extra and run.mode != "single"


def local_part(run, array):
    """This process's part of every global batch of `array`.

    With N processes, global batch `b` is the concatenation, in process
    order, of the parts that the processes pass as their batch `b`.
    """
    if not passes_local_batches(run):
        return array
    processes = int(os.environ["WORLD_SIZE"])
    local_size = BATCH_SIZE // processes
    rows = np.arange(len(array))
    mine = (rows % BATCH_SIZE) // local_size == worker_utils.rank()
    return array[mine]


def batch_size(run):
    """The batch size each process passes to `fit`, `evaluate`, `predict`."""
    if passes_local_batches(run):
        return BATCH_SIZE // int(os.environ["WORLD_SIZE"])
    return BATCH_SIZE


def reverse_within_batches(array):
    """`array` with the rows of every batch of `BATCH_SIZE` reversed."""
    return np.concatenate(
        [
            array[start : start + BATCH_SIZE][::-1]
            for start in range(0, len(array), BATCH_SIZE)
        ]
    )


def roll_within_batches(array):
    """`array` with the two halves of every batch of `BATCH_SIZE` rows
    swapped."""
    return np.concatenate(
        [
            np.roll(array[start : start + BATCH_SIZE], BATCH_SIZE // 2, axis=0)
            for start in range(0, len(array), BATCH_SIZE)
        ]
    )


def make_inputs(run, x, y):
    """Returns `fit` keyword arguments in the requested input form."""
    if "reversed" in run.extra:
        x, y = reverse_within_batches(x), reverse_within_batches(y)
    if "rolled" in run.extra:
        x, y = roll_within_batches(x), roll_within_batches(y)
    if "dict" in run.extra:
        name = "features" if run.model == "mlp" else "tokens"
        return {"x": {name: x}, "y": y, "batch_size": BATCH_SIZE}
    if "pydataset" in run.extra:

        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return int(np.ceil(len(x) / BATCH_SIZE))

            def __getitem__(self, i):
                s = slice(i * BATCH_SIZE, (i + 1) * BATCH_SIZE)
                return x[s], y[s]

        return {"x": Batches()}
    if "dataloader" in run.extra:
        import torch

        dataset = torch.utils.data.TensorDataset(
            torch.as_tensor(x), torch.as_tensor(y)
        )
        return {
            "x": torch.utils.data.DataLoader(dataset, batch_size=BATCH_SIZE)
        }
    return {
        "x": local_part(run, x),
        "y": local_part(run, y),
        "batch_size": batch_size(run),
    }


def count_shards_created_alone():
    """Counts the variables created shard by shard from now on.

    Chunks are made a few rows small, so that this test's small variables
    are created shard by shard, across many chunks (see
    `keras/src/backend/torch/sharded_initialization.py`). Returns a
    one-element list holding the count.
    """
    from keras.src.backend.torch import sharded_initialization

    count = [0]
    create = sharded_initialization.initialize_variable_shard

    def counted(*args):
        shard = create(*args)
        count[0] += shard is not None
        return shard

    sharded_initialization.CHUNK_BYTES = 64
    sharded_initialization.initialize_variable_shard = counted
    return count


SHARDS_CREATED_ALONE = count_shards_created_alone()


def train(run):
    worker_utils.set_distribution(
        run.mode,
        MODEL_LAYOUTS[run.model],
        auto_shard_dataset=not passes_local_batches(run),
    )
    keras.utils.set_random_seed(1337)
    shards_before = SHARDS_CREATED_ALONE[0]
    model = build_model(run)
    run.record("optimizer", run.optimizer)
    run.record("initial_weights", [w.tolist() for w in model.get_weights()])
    run.record("shards_created_alone", SHARDS_CREATED_ALONE[0] - shards_before)
    optimizer = (
        keras.optimizers.SGD(0.05, momentum=0.9)
        if run.optimizer == "sgd"
        else keras.optimizers.AdamW(0.01, weight_decay=0.01)
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[
            keras.metrics.SparseCategoricalAccuracy(name="acc"),
            keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2"),
        ],
        jit_compile="jit" in run.extra,
    )
    x, y = make_data(run)
    losses = worker_utils.BatchLosses()
    history = model.fit(
        **make_inputs(run, x, y),
        epochs=2,
        shuffle="shuffle" in run.extra,
        verbose=0,
        callbacks=[losses],
    )
    run.record("batch_losses", losses.losses)
    run.record(
        "history",
        {k: [float(v) for v in vs] for k, vs in history.history.items()},
    )
    # The types of the values as logged, before the `float` above.
    logged_types = {
        "batch": sorted(set(losses.types)),
        "history": sorted(
            {type(v).__name__ for vs in history.history.values() for v in vs}
        ),
    }
    run.record("final_weights", [w.tolist() for w in model.get_weights()])
    run.record("weight_paths", [w.path for w in model.weights])
    run.record("iterations", int(model.optimizer.iterations.numpy()))
    x_local, y_local = local_part(run, x), local_part(run, y)
    evaluation = model.evaluate(
        x_local,
        y_local,
        batch_size=batch_size(run),
        verbose=0,
        return_dict=True,
    )
    logged_types["evaluate"] = sorted(
        {type(v).__name__ for v in evaluation.values()}
    )
    run.record("logged_types", logged_types)
    run.record("evaluate", {k: float(v) for k, v in evaluation.items()})
    run.record(
        "predict",
        model.predict(x_local, batch_size=batch_size(run), verbose=0),
    )
    # A direct call takes the global batch too (or, with `local`, this
    # process's part of it). With `training=False` the call is
    # `predict`'s. Without `training`, a random augmentation layer
    # (`cnn`'s rotation) takes its default, `training=True`, which the
    # layers after it inherit: `cnn`'s batch normalization updates its
    # moving statistics, so that call comes last.
    direct = model(x_local[: batch_size(run)], training=False)
    run.record("direct_inference", keras.ops.convert_to_numpy(direct))
    direct = model(x_local[: batch_size(run)])
    run.record("direct_call", keras.ops.convert_to_numpy(direct))
    run.record("local_layers", local_layer_names(model))
    custom_training_loop(run, model, x_local, y_local)


def custom_loop_rows(run, step):
    """The rows of the arrays this process holds that it passes at `step`
    of `custom_training_loop`.

    Each step's global batch is an uneven 5 rows. Without `local`, every
    process passes them whole: the first 5 rows of global batch `step`.
    With `local`, each process passes its part of them, parts of different
    sizes split as `np.array_split` splits (3 and 2 rows on 2 processes):
    the first rows of its part of global batch `step`; and its reference,
    one process, passes the same rows together.
    """
    rows = BATCH_SIZE - 3
    if "local" not in run.extra:
        return np.arange(rows) + step * BATCH_SIZE
    processes = int(os.environ["WORLD_SIZE"])
    local_size = BATCH_SIZE // processes
    sizes = [len(part) for part in np.array_split(np.arange(rows), processes)]
    if passes_local_batches(run):
        rank = worker_utils.rank()
        return np.arange(sizes[rank]) + step * local_size
    return np.concatenate(
        [
            np.arange(size) + step * BATCH_SIZE + process * local_size
            for process, size in enumerate(sizes)
        ]
    )


def custom_training_loop(run, model, x, y):
    """Two steps of a training loop written by hand, as Keras's guide for
    PyTorch writes one.

    The loss and a metric are called directly on the model's output and
    the targets as this process holds them: the global batch, here of an
    uneven 5 rows (or, with `local`, this process's part of them, see
    `custom_loop_rows`). Records each step's loss, the metric's result,
    what the two steps changed in the weights, and the number of rows
    this process passed at each step.
    """
    import torch

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    optimizer = keras.optimizers.SGD(0.05)
    before = model.get_weights()
    losses = []
    passed_rows = []
    for step in range(2):
        rows = custom_loop_rows(run, step)
        passed_rows.append(len(rows))
        logits = model(x[rows], training=True)
        loss = loss_fn(y[rows], logits)
        model.zero_grad()
        loss.backward()
        weights = model.trainable_weights
        with torch.no_grad():
            optimizer.apply([w.value.grad for w in weights], weights)
        accuracy.update_state(y[rows], logits)
        losses.append(float(keras.ops.convert_to_numpy(loss)))
    run.record("custom_loop_losses", losses)
    run.record("custom_loop_rows", passed_rows)
    run.record(
        "custom_loop_accuracy",
        float(keras.ops.convert_to_numpy(accuracy.result())),
    )
    run.record(
        "custom_loop_updates",
        [(a - b).tolist() for a, b in zip(model.get_weights(), before)],
    )


def local_layer_names(model):
    """Names of the model's layers that ran on local tensors at least once.

    See `keras/src/backend/torch/batch_local.py`: a layer runs locally
    once its first call with a signature proved it local to each batch
    shard.
    """
    from keras.src.backend.torch import batch_local

    layers = [model] + list(model._flatten_layers(include_self=False))
    return sorted(
        layer.name
        for layer in layers
        if any(
            plan is not None for plan in batch_local.plans_of(layer).values()
        )
    )


def main():
    if ":" in sys.argv[1]:
        runs = [Run(spec) for spec in sys.argv[1:]]
    else:  # One run given as `MODE MODEL OPTIMIZER [EXTRA]`, unprefixed.
        runs = [Run(":".join(sys.argv[1:]), prefix="")]
    worker_utils.run_all(train, runs, mode_of=lambda run: run.mode)


if __name__ == "__main__":
    main()
