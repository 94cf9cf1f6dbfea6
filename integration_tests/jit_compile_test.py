"""`jit_compile=True` (torch.compile) under a distribution equals eager.

`workers/jit_compile_worker.py` trains as `training_worker.py` does, with
`jit_compile=True`, on 2 gloo processes: DataParallel with SGD, the model
having its own `train_step` (backward from the loss, then metrics on the
predictions, as the Keras guide writes one for torch), and ModelParallel
on a (1, 2) mesh with AdamW and upstream's train step, for the MLP
(column- then row-sharded kernels) after an embedding split along the
vocabulary (`lookup`: its lookup, compiled). The reference is the same
training without a distribution, eager, which each process of the launch
runs by itself before the compiled runs. Per-step losses must agree within 1e-5
relative, final weights within 1e-5 absolute, `evaluate` and `predict` as
in the parity test; and the distributed runs must really have run
compiled: `fit`, `evaluate` and `predict` used the compiled steps, and
torch.compile produced graphs (the eager reference none).
"""

import harness
import numpy as np
import pytest

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5
RUNS = ["dp:mlp:sgd:jit,custom", "mp:lookup:adamw:jit"]


def reference_spec(spec):
    """The eager single-process run to compare `spec` with."""
    return ":".join(["single"] + spec.split(":")[1:3])


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """One launch on 2 processes: first the eager references (every rank
    trains them by itself, without a distribution), then the compiled
    runs."""
    return harness.launch_references_first(
        "jit_compile_worker.py",
        2,
        tmp_path_factory.mktemp("jit_compile"),
        sorted({reference_spec(spec) for spec in RUNS}),
        RUNS,
        timeout=600,
        # torch's DETAIL check runs a real collective on the shapes of each
        # collective, which torch.compile traces with fake tensors and
        # refuses ("Please convert all Tensors to FakeTensors first"): this
        # launch runs without it (its references issue no collective).
        # Every other test file's launches keep it.
        env={"TORCH_DISTRIBUTED_DEBUG": "OFF"},
    )


@pytest.fixture(params=RUNS)
def case(request, reports):
    ranks = [harness.run_values(report, request.param) for report in reports]
    return ranks, harness.run_values(reports[0], reference_spec(request.param))


def test_reference_is_eager(case):
    _, ref = case
    compiled = ref["compiled"]
    assert compiled["frames"] == compiled["graphs"] == 0
    assert not any(
        compiled[name]
        for name in ("train_function", "test_function", "predict_function")
    )


def test_steps_run_compiled(case):
    reports, _ = case
    for report in reports:
        compiled = report["compiled"]
        assert compiled["train_function"]
        assert compiled["test_function"]
        assert compiled["predict_function"]
        assert compiled["frames"] > 0
        assert compiled["graphs"] > 0
        # Forward and backward graphs of the train step, at least.
        assert compiled["aot_graphs"] > 0


def test_same_initial_weights(case):
    reports, ref = case
    for report in reports:
        assert len(report["initial_weights"]) == len(ref["initial_weights"])
        for a, b in zip(report["initial_weights"], ref["initial_weights"]):
            np.testing.assert_array_equal(a, b)


def test_losses_match_eager_single_device(case):
    reports, ref = case
    harness.assert_losses_match(reports, ref, rtol=LOSS_RTOL)
    assert reports[0]["batch_losses"] == reports[1]["batch_losses"]


def test_final_weights_match_eager_single_device(case):
    reports, ref = case
    for report in reports:
        assert len(report["final_weights"]) == len(ref["final_weights"])
        for a, b in zip(report["final_weights"], ref["final_weights"]):
            np.testing.assert_allclose(a, b, atol=WEIGHT_ATOL, rtol=0)
    assert reports[0]["final_weights"] == reports[1]["final_weights"]


def test_history_evaluate_and_predict_match(case):
    reports, ref = case
    for report in reports:
        assert report["history"] == reports[0]["history"]
        assert report["evaluate"] == reports[0]["evaluate"]
        assert report["iterations"] == ref["iterations"]
        for name, values in ref["history"].items():
            np.testing.assert_allclose(
                report["history"][name], values, rtol=LOSS_RTOL
            )
        for name, value in ref["evaluate"].items():
            np.testing.assert_allclose(
                report["evaluate"][name], value, rtol=LOSS_RTOL
            )
        np.testing.assert_allclose(
            np.asarray(report["predict"]),
            np.asarray(ref["predict"]),
            atol=1e-5,
        )
