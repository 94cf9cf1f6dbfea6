"""Callbacks act identically on every rank and as on one process.

`workers/callbacks_worker.py` trains with `EarlyStopping`,
`ReduceLROnPlateau` and `TerminateOnNaN` (and the `History` that `fit`
returns) without a distribution (each of the launch's 2 gloo processes
by itself, first), and on the 2 processes under `DataParallel` and
`ModelParallel` (1, 2). Every rank must stop at the
same epoch, use the same learning rates and stop on the same NaN batch as
the single-process run, with the same history; and batch-end callbacks
run on the main thread.
"""

import harness
import numpy as np
import pytest

MODES = ("dp", "mp")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    reports = harness.launch_references_first(
        "callbacks_worker.py",
        2,
        tmp_path_factory.mktemp("callbacks_worker"),
        ["single"],
        list(MODES),
    )
    return reports[0], reports


def assert_histories_match(history, expected):
    assert sorted(history) == sorted(expected)
    for key, values in expected.items():
        np.testing.assert_allclose(history[key], values, rtol=1e-5)


def test_single_process_callbacks_act(reports):
    single, _ = reports
    # The runs are set up so that every callback changes the run.
    assert 1 < single["single/early_stopping/epochs"] < 30
    rates = single["single/plateau/rates"]
    assert rates[0] == pytest.approx(0.05)
    assert min(rates) < rates[0]
    assert single["single/nan/batches"] == 4
    assert single["single/nan/stop_training"] is True


@pytest.mark.parametrize("mode", MODES)
def test_early_stopping_stops_at_the_same_epoch(reports, mode):
    single, distributed = reports
    for report in distributed:
        assert (
            report[f"{mode}/early_stopping/epochs"]
            == single["single/early_stopping/epochs"]
        )
        assert_histories_match(
            report[f"{mode}/early_stopping/history"],
            single["single/early_stopping/history"],
        )


@pytest.mark.parametrize("mode", MODES)
def test_reduce_lr_on_plateau_uses_the_same_rates(reports, mode):
    single, distributed = reports
    for report in distributed:
        np.testing.assert_allclose(
            report[f"{mode}/plateau/rates"],
            single["single/plateau/rates"],
            rtol=1e-6,
        )
        assert_histories_match(
            report[f"{mode}/plateau/history"],
            single["single/plateau/history"],
        )


@pytest.mark.parametrize("mode", MODES)
def test_terminate_on_nan_stops_on_the_same_batch(reports, mode):
    single, distributed = reports
    for report in distributed:
        assert report[f"{mode}/nan/batches"] == single["single/nan/batches"]
        assert report[f"{mode}/nan/stop_training"] is True


def test_async_safe_callbacks_leave_the_main_thread_without_distribution(
    reports,
):
    # Upstream's dispatch, which the next test must see undone: without a
    # distribution, an `async_safe` batch-end callback runs on a worker
    # thread (so the next test can fail).
    single, _ = reports
    on_main = single["single/early_stopping/batch_end_on_main_thread"]
    assert len(on_main) > 0
    assert not any(on_main)


@pytest.mark.parametrize("mode", MODES)
def test_batch_end_callbacks_run_on_the_main_thread(reports, mode):
    single, distributed = reports
    batches = len(single["single/early_stopping/batch_end_on_main_thread"])
    for report in distributed:
        on_main = report[f"{mode}/early_stopping/batch_end_on_main_thread"]
        assert on_main == [True] * batches
