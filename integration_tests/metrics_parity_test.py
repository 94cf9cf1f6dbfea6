"""Metrics and logs under a distribution equal the single-process ones.

`workers/metrics_worker.py` trains, evaluates and predicts with a model
that logs many built-in metric kinds: `Mean` and `Sum` (owned by a layer
and by the model), binary and categorical accuracies, AUC (ROC and PR),
confusion counts (`TruePositives`, `FalseNegatives`), `Precision`,
`Recall`, F1 and F-beta, the at-recall/precision/sensitivity/specificity
family, the regression, probabilistic and hinge metrics, the IoU family
and `R2Score`. It runs in three launches: one
process without a distribution (the reference), 2 processes
(DataParallel on (2,) and ModelParallel on (1, 2) with sharded kernels
and heads) and 4 processes (ModelParallel on a (2, 2) `batch` x `model`
mesh).

Every logged value must be a Python float, identical on all ranks, and
equal to the reference: counts exactly, the rest within 1e-5 relative.
Counts are also checked against numpy: the positives seen per epoch, and
the confusion counts of `evaluate` from the predictions of `predict`. A
count that was already global and is reduced again over the processes
comes out doubled, as keras-nightly's did (72 true positives for 36).

Keras 3.15.1's torch `fit` keeps an epoch's results as tensors until
`on_epoch_end`; a `Sum` or confusion-count result shares its metric
variable's storage, which validation resets and refills, so such epoch
logs show validation's values. That is upstream behaviour, on one process
as on many; the history is compared with the reference as it is.
"""

import harness
import numpy as np
import pytest

RTOL = 1e-5
EPOCHS = 2
STEPS_PER_EPOCH = 3  # 19 samples in batches of 8.

# Configurations (worker MODEs) by number of processes.
RUNS = {2: ["dp", "mp"], 4: ["2d"]}

# Logs that count samples: they must match exactly.
COUNTS = ("positives", "binary_true_positives", "binary_false_negatives")


class Launches:
    """The three launches, each run on first use and then kept.

    A launch that failed fails every test that needs it, and only those:
    the reference's own checks still run when a distributed launch fails.
    """

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.results = {}

    def reports(self, nprocs):
        """Per-rank reports of the launch on `nprocs` processes."""
        if nprocs not in self.results:
            try:
                self.results[nprocs] = harness.launch(
                    "metrics_worker.py",
                    nprocs,
                    self.tmp_path_factory.mktemp(f"p{nprocs}"),
                    args=RUNS.get(nprocs, ["single"]),
                    timeout=240,
                )
            except harness.WorkerFailure as failure:
                self.results[nprocs] = failure
        result = self.results[nprocs]
        if isinstance(result, harness.WorkerFailure):
            # A new exception each time: re-raising one would grow its
            # traceback with every test.
            raise harness.WorkerFailure(str(result))
        return result

    def reference(self):
        """The single-process run without a distribution."""
        return harness.run_values(self.reports(1)[0], "single")

    def ranks(self, nprocs, mode):
        """The values of `mode` reported by every rank."""
        return [harness.run_values(r, mode) for r in self.reports(nprocs)]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """The launches of this module, shared by all its tests."""
    return Launches(tmp_path_factory)


@pytest.fixture(
    params=[(n, mode) for n, modes in RUNS.items() for mode in modes],
    ids=lambda p: f"{p[0]}p-{p[1]}",
)
def case(request, launches):
    """(reports of every rank, reference report) of one configuration."""
    nprocs, mode = request.param
    return launches.ranks(nprocs, mode), launches.reference()


@pytest.fixture(
    params=[(1, "single")]
    + [(n, mode) for n, modes in RUNS.items() for mode in modes],
    ids=lambda p: f"{p[0]}p-{p[1]}",
)
def any_run(request, launches):
    """Reports of every rank of one run, the reference included."""
    nprocs, mode = request.param
    return launches.ranks(nprocs, mode)


def assert_logs_match(logs, expected):
    """Same names; counts equal, other values within `RTOL` relative."""
    assert sorted(logs) == sorted(expected)
    for name, value in expected.items():
        if name.removeprefix("val_") in COUNTS:
            assert logs[name] == value, name
        else:
            np.testing.assert_allclose(
                logs[name], value, rtol=RTOL, err_msg=name
            )


def test_same_initial_weights(case):
    reports, reference = case
    for report in reports:
        assert len(report["initial_weights"]) == len(
            reference["initial_weights"]
        )
        for weight, expected in zip(
            report["initial_weights"], reference["initial_weights"]
        ):
            np.testing.assert_array_equal(weight, expected)


def test_logged_values_are_python_floats(any_run):
    for report in any_run:
        assert len(report["batch_log_types"]) == EPOCHS * STEPS_PER_EPOCH
        for types in report["batch_log_types"]:
            assert set(types.values()) == {"float"}, types
        for name, types in report["history_types"].items():
            assert types == ["float"] * EPOCHS, name
        assert set(report["evaluate_types"].values()) == {"float"}


def test_every_rank_logs_the_same_values(case):
    reports, _ = case
    first = reports[0]
    for report in reports[1:]:
        assert report["batch_logs"] == first["batch_logs"]
        assert report["history"] == first["history"]
        assert report["evaluate"] == first["evaluate"]


def test_batch_logs_match_single_process(case):
    reports, reference = case
    for report in reports:
        assert len(report["batch_logs"]) == len(reference["batch_logs"])
        for logs, expected in zip(
            report["batch_logs"], reference["batch_logs"]
        ):
            assert_logs_match(logs, expected)


def test_fit_history_matches_single_process(case):
    reports, reference = case
    for report in reports:
        assert sorted(report["history"]) == sorted(reference["history"])
        for epoch in range(EPOCHS):
            assert_logs_match(
                {k: v[epoch] for k, v in report["history"].items()},
                {k: v[epoch] for k, v in reference["history"].items()},
            )


def test_evaluate_matches_single_process(case):
    reports, reference = case
    for report in reports:
        assert_logs_match(report["evaluate"], reference["evaluate"])


def test_counts_match_numpy(any_run):
    """Counts are global and counted once, on every rank."""
    for report in any_run:
        labels = np.asarray(report["labels"])
        scores = np.asarray(report["predict"]["binary"])[:, 0]
        positive = labels == 1
        predicted = scores > 0.5
        evaluation = report["evaluate"]
        assert evaluation["positives"] == positive.sum()
        assert evaluation["binary_true_positives"] == np.sum(
            predicted & positive
        )
        assert evaluation["binary_false_negatives"] == np.sum(
            ~predicted & positive
        )
        np.testing.assert_allclose(
            evaluation["binary_accuracy"],
            np.mean(predicted == positive),
            rtol=RTOL,
        )
        np.testing.assert_allclose(
            evaluation["mean_score"], np.mean(scores), rtol=RTOL
        )
        history = report["history"]
        for name in ("positives", "val_positives"):
            assert history[name] == [float(positive.sum())] * EPOCHS


def test_iou_and_r2_metrics_match_single_process(case):
    """The IoU family and `R2Score` (which broadcast and index tensors
    made from Python values) log the single-process values."""
    reports, reference = case
    assert reference["iou_r2/error"] is None
    for report in reports:
        assert report["iou_r2/error"] is None, report["iou_r2/error"]
        assert_logs_match(
            report["iou_r2/evaluate"], reference["iou_r2/evaluate"]
        )


def test_predict_returns_the_full_global_batch(case):
    reports, reference = case
    for report in reports:
        assert report["predict_types"] == {
            "binary": "ndarray",
            "classes": "ndarray",
        }
        for head, expected in reference["predict"].items():
            predictions = np.asarray(report["predict"][head])
            assert predictions.shape == np.asarray(expected).shape
            np.testing.assert_allclose(predictions, expected, atol=1e-5)
