"""Training under a distribution gives single-device numbers.

Each case trains with `workers/training_worker.py` on 2 or 4 gloo
processes and on one process without any distribution, from the same
initial weights, with `shuffle=False` unless stated. Per-step losses must
agree within 1e-5 relative, final weights within 1e-5 absolute, and every
logged value, `evaluate` result and `predict` output must be identical on
all ranks and equal to the single-process values.
"""

import harness
import numpy as np
import pytest

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5

# Runs `MODE:MODEL:OPTIMIZER[:EXTRA]` by number of processes; every run is
# compared with the same run without a distribution (`single`).
RUNS = {
    2: [
        "dp:mlp:sgd:uneven,dict",
        "dp:mlp:adamw:pydataset",
        "dp:mlp:sgd:dataloader",
        "dp:mlp:adamw:dropout",
        "dp:mlp:sgd:local",
        "mp:transformer:sgd",
        "mp:transformer:adamw",
    ],
    4: ["2d:transformer:sgd"],
}
SHUFFLED = "dp:mlp:sgd:shuffle"


def single(spec):
    return ":".join(["single"] + spec.split(":")[1:])


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Three launches: references, 2 processes and 4 processes."""
    specs = [spec for runs in RUNS.values() for spec in runs]
    return harness.launch_reference_and_runs(
        "training_worker.py",
        tmp_path_factory,
        sorted({single(spec) for spec in specs}),
        {
            nprocs: runs + ([SHUFFLED] if nprocs == 2 else [])
            for nprocs, runs in RUNS.items()
        },
        timeout=400,
    )


@pytest.fixture(
    params=[(n, spec) for n, runs in RUNS.items() for spec in runs],
    ids=lambda p: f"{p[0]}p-{p[1]}",
)
def case(request, launches):
    nprocs, spec = request.param
    references, reports = launches
    ranks = [harness.run_values(report, spec) for report in reports[nprocs]]
    return ranks, harness.run_values(references, single(spec))


def max_abs_diff(first, second, paths=None, skip=()):
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for i, (a, b) in enumerate(zip(first, second))
        if paths is None or not any(s in paths[i] for s in skip)
    )


def ill_conditioned(report):
    """Weights whose gradient is zero in exact arithmetic, under Adam.

    The attention key bias adds the same value to every score of a query,
    which softmax cancels: its gradient is rounding noise (~1e-9), and Adam
    divides that noise by its own magnitude, so any change in summation
    order moves it by up to the learning rate. SGD leaves it in place.
    """
    return ("attention/key/bias",) if "adamw" in report["optimizer"] else ()


def test_same_initial_weights(case):
    reports, ref = case
    for report in reports:
        assert (
            max_abs_diff(report["initial_weights"], ref["initial_weights"]) == 0
        )


def test_losses_match_single_device(case):
    reports, ref = case
    harness.assert_losses_match(reports, ref, rtol=LOSS_RTOL)


def test_final_weights_match_single_device(case):
    reports, ref = case
    for report in reports:
        difference = max_abs_diff(
            report["final_weights"],
            ref["final_weights"],
            paths=report["weight_paths"],
            skip=ill_conditioned(report),
        )
        assert difference < WEIGHT_ATOL


def test_every_rank_logs_the_same_python_floats(case):
    reports, ref = case
    first = reports[0]
    for report in reports[1:]:
        assert report["batch_losses"] == first["batch_losses"]
        assert report["history"] == first["history"]
        assert report["evaluate"] == first["evaluate"]
    assert first["iterations"] == ref["iterations"]
    for name, values in ref["history"].items():
        np.testing.assert_allclose(
            first["history"][name], values, rtol=LOSS_RTOL
        )


def test_evaluate_and_predict_match_single_device(case):
    reports, ref = case
    for report in reports:
        for name, value in ref["evaluate"].items():
            np.testing.assert_allclose(
                report["evaluate"][name], value, rtol=LOSS_RTOL
            )
        predictions = np.asarray(report["predict"])
        # `predict` returns the full global batch on every rank.
        assert predictions.shape == np.asarray(ref["predict"]).shape
        np.testing.assert_allclose(
            predictions, np.asarray(ref["predict"]), atol=1e-5
        )
        # `model(x)` called directly returns the global batch as well.
        np.testing.assert_allclose(
            report["direct_call"], ref["direct_call"], atol=1e-5
        )
        np.testing.assert_allclose(
            report["direct_call"],
            predictions[: len(report["direct_call"])],
            atol=1e-5,
        )


def test_shuffled_training_logs_the_same_losses_on_all_ranks(launches):
    _, reports = launches
    ranks = [harness.run_values(report, SHUFFLED) for report in reports[2]]
    assert len(ranks[0]["batch_losses"]) == 8
    assert ranks[0]["batch_losses"] == ranks[1]["batch_losses"]
    assert ranks[0]["final_weights"] == ranks[1]["final_weights"]
