"""Trains a model with many built-in metric kinds and reports their logs.

Usage: metrics_worker.py MODE [MODE ...]; one launch runs every MODE in
turn and reports its values under `<MODE>/<name>`.
  MODE: `single` (no distribution), `dp` (DataParallel on all processes),
    `mp` (ModelParallel on a (1, N) mesh), `2d` (ModelParallel on a
    (2, N/2) mesh).

The model has two heads: `binary` (sigmoid, with accuracy, AUC, confusion
counts, precision and recall, F1 and F-beta, the "at recall / precision /
sensitivity / specificity" family, and every regression, probabilistic
and hinge metric) and `classes` (softmax, with categorical accuracy
metrics and crossentropy). A layer owns a `Mean` and a `Sum` of the
activations it sees, and the model's `compute_metrics` adds a `Sum` of the
positive labels (an exact count) and a `Mean` of the predicted
probability. A second, short fit reports the metrics whose results index
or broadcast tensors made from Python values (`iou_and_r2_metrics`: the
IoU family, `R2Score`).
"""

import sys

import numpy as np
import worker_utils
from worker_utils import record

import keras

# The last batch (3 samples) splits unevenly over the batch axis: 2 and 1
# rows on 2 processes, 1, 1, 1 and 0 on 4.
NUM_SAMPLES = 19
BATCH_SIZE = 8
FEATURES, HIDDEN, CLASSES = 12, 16, 4
EPOCHS = 2


class ActivationStats(keras.layers.Layer):
    """Passes its input through; tracks its mean and its per-sample sum."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.activation_mean = keras.metrics.Mean(name="activation_mean")
        self.activation_sum = keras.metrics.Sum(name="activation_sum")

    def call(self, x):
        self.activation_mean.update_state(x)
        self.activation_sum.update_state(keras.ops.sum(x, axis=-1))
        return x


class MetricsModel(keras.Model):
    """A functional model whose `compute_metrics` updates metrics it owns."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.positives = keras.metrics.Sum(name="positives")
        self.mean_score = keras.metrics.Mean(name="mean_score")

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        """Updates the labels' and predictions' metrics, then the compiled."""
        self.positives.update_state(y["binary"])
        self.mean_score.update_state(y_pred["binary"])
        return super().compute_metrics(x, y, y_pred, sample_weight)


def build_model():
    """An MLP with an `ActivationStats` layer and two heads."""
    inputs = keras.Input((FEATURES,), name="features")
    x = keras.layers.Dense(HIDDEN, activation="relu", name="up")(inputs)
    x = keras.layers.Dense(HIDDEN, activation="relu", name="down")(x)
    x = ActivationStats(name="stats")(x)
    outputs = {
        "binary": keras.layers.Dense(1, activation="sigmoid", name="binary")(x),
        "classes": keras.layers.Dense(
            CLASSES, activation="softmax", name="classes"
        )(x),
    }
    return MetricsModel(inputs, outputs)


# Layouts under `mp` and `2d`: column- then row-parallel hidden layers;
# both heads sharded.
MODEL_LAYOUTS = {
    "up/kernel": (None, "model"),
    "up/bias": ("model",),
    "down/kernel": ("model", None),
    "binary/kernel": ("model", None),
    "classes/kernel": (None, "model"),
    "classes/bias": ("model",),
}


def make_data():
    """Features, and labels that the features partly predict."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_SAMPLES, FEATURES)).astype("float32")
    noise = rng.normal(scale=0.5, size=NUM_SAMPLES)
    y_binary = (x[:, 0] + 0.5 * x[:, 1] + noise > 0).astype("float32")
    y_classes = (np.argmax(x[:, :CLASSES], axis=1)).astype("int32")
    return x, {"binary": y_binary[:, None], "classes": y_classes}


def regression_metrics():
    """Every built-in regression metric, for the sigmoid head."""
    m = keras.metrics
    return [
        m.MeanSquaredError(name="mse"),
        m.RootMeanSquaredError(name="rmse"),
        m.MeanAbsoluteError(name="mae"),
        m.MeanAbsolutePercentageError(name="mape"),
        m.MeanSquaredLogarithmicError(name="msle"),
        m.CosineSimilarity(name="cosine"),
        m.LogCoshError(name="logcosh"),
    ]


def probabilistic_metrics():
    """The probabilistic and hinge metrics, for the sigmoid head."""
    m = keras.metrics
    return [
        m.BinaryCrossentropy(name="xent"),
        m.KLDivergence(name="kld"),
        m.Poisson(name="poisson"),
        m.Hinge(name="hinge"),
        m.SquaredHinge(name="squared_hinge"),
    ]


def iou_and_r2_metrics():
    """The IoU family and `R2Score`, by head: their updates and results
    broadcast and index tensors made from Python values."""
    m = keras.metrics
    return {
        "binary": [m.BinaryIoU(name="binary_iou"), m.R2Score(name="r2")],
        "classes": [
            m.MeanIoU(CLASSES, sparse_y_pred=False, name="mean_iou"),
            m.IoU(CLASSES, [0, 2], sparse_y_pred=False, name="iou"),
        ],
    }


def check_iou_and_r2(prefix):
    """Fits and evaluates with `iou_and_r2_metrics`; records the
    `evaluate` results, or the error."""
    keras.utils.set_random_seed(1337)
    model = build_model()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss={
            "binary": keras.losses.BinaryCrossentropy(),
            "classes": keras.losses.SparseCategoricalCrossentropy(),
        },
        metrics=iou_and_r2_metrics(),
    )
    x, y = make_data()

    def fit_and_evaluate():
        model.fit(x, y, batch_size=BATCH_SIZE, shuffle=False, verbose=0)
        evaluation = model.evaluate(
            x, y, batch_size=BATCH_SIZE, verbose=0, return_dict=True
        )
        record(
            prefix + "iou_r2/evaluate",
            {k: float(v) for k, v in evaluation.items()},
        )

    worker_utils.record_error(prefix + "iou_r2/error", fit_and_evaluate)


def compile_model(model):
    """Compiles with a loss per head and every metric kind."""
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss={
            "binary": keras.losses.BinaryCrossentropy(),
            "classes": keras.losses.SparseCategoricalCrossentropy(),
        },
        metrics={
            "binary": [
                keras.metrics.BinaryAccuracy(name="accuracy"),
                keras.metrics.AUC(name="auc"),
                keras.metrics.AUC(curve="PR", name="pr_auc"),
                keras.metrics.TruePositives(name="true_positives"),
                keras.metrics.FalseNegatives(name="false_negatives"),
                keras.metrics.Precision(name="precision"),
                keras.metrics.Recall(name="recall"),
                keras.metrics.F1Score("micro", threshold=0.5, name="f1"),
                keras.metrics.FBetaScore(
                    "micro", beta=2.0, threshold=0.5, name="f2"
                ),
                keras.metrics.PrecisionAtRecall(0.5, name="p_at_r"),
                keras.metrics.RecallAtPrecision(0.5, name="r_at_p"),
                keras.metrics.SensitivityAtSpecificity(0.5, name="s_at_s"),
                keras.metrics.SpecificityAtSensitivity(0.5, name="sp_at_s"),
                *regression_metrics(),
                *probabilistic_metrics(),
            ],
            "classes": [
                keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
                keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2"),
                keras.metrics.SparseCategoricalCrossentropy(name="xent"),
            ],
        },
    )


def types_of(logs):
    """Maps each log name to the name of its value's Python type."""
    return {k: type(v).__name__ for k, v in logs.items()}


class BatchLogs(keras.callbacks.Callback):
    """Keeps the logs of every training batch, and their value types."""

    def __init__(self):
        super().__init__()
        self.logs = []
        self.types = []

    def on_train_batch_end(self, batch, logs=None):
        self.types.append(types_of(logs))
        self.logs.append({k: float(v) for k, v in logs.items()})


def run(mode):
    """Fits (with validation), evaluates and predicts; records the logs.

    Nothing here works around the distribution: `predict` runs with no
    callbacks of its own, as a user would call it, and the layer's metrics
    update in every forward pass, `predict` included.
    """
    prefix = f"{mode}/"
    worker_utils.set_distribution(mode, MODEL_LAYOUTS)
    keras.utils.set_random_seed(1337)
    model = build_model()
    compile_model(model)
    record(
        prefix + "initial_weights", [w.tolist() for w in model.get_weights()]
    )
    x, y = make_data()
    batches = BatchLogs()
    history = model.fit(
        x,
        y,
        batch_size=BATCH_SIZE,
        epochs=EPOCHS,
        shuffle=False,
        validation_data=(x, y),
        verbose=0,
        callbacks=[batches],
    )
    record(prefix + "batch_logs", batches.logs)
    record(prefix + "batch_log_types", batches.types)
    record(
        prefix + "history_types",
        {
            k: [type(v).__name__ for v in vs]
            for k, vs in history.history.items()
        },
    )
    record(
        prefix + "history",
        {k: [float(v) for v in vs] for k, vs in history.history.items()},
    )
    evaluation = model.evaluate(
        x, y, batch_size=BATCH_SIZE, verbose=0, return_dict=True
    )
    record(prefix + "evaluate_types", types_of(evaluation))
    record(prefix + "evaluate", {k: float(v) for k, v in evaluation.items()})
    predictions = model.predict(x, batch_size=BATCH_SIZE, verbose=0)
    record(
        prefix + "predict_types",
        {k: type(v).__name__ for k, v in predictions.items()},
    )
    record(
        prefix + "predict",
        {k: np.asarray(v).tolist() for k, v in predictions.items()},
    )
    record(prefix + "labels", y["binary"][:, 0])
    check_iou_and_r2(prefix)


def main():
    """Runs every MODE given on the command line, then reports."""
    worker_utils.run_all(run, sys.argv[1:])


if __name__ == "__main__":
    main()
