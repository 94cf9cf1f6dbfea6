"""Size-1 mesh axes, per-process parts of different sizes, misuse.

One launch of `workers/mesh_edges_worker.py` on 2 gloo processes runs
meshes (2, 1) and (1, 2), uneven per-process batches and the misuse
checks; one launch on 1 process gives the reference without a
distribution, and runs the (1, 1) mesh. Every distributed number is
compared with the reference.
"""

import harness
import numpy as np
import pytest

RTOL = 1e-5
ATOL = 1e-6
MESHES = {"mesh:2,1": 2, "mesh:1,2": 2, "mesh:1,1": 1}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    reference, runs = harness.launch_reference_and_runs(
        "mesh_edges_worker.py",
        tmp_path_factory,
        ["single", "mesh:1,1"],
        {2: ["mesh:2,1", "mesh:1,2", "parts", "misuse"]},
        timeout=300,
    )
    return reference, [reference], runs[2]


def assert_close_lists(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(e), rtol=RTOL, atol=ATOL
        )


@pytest.mark.parametrize("case", sorted(MESHES))
def test_size_one_axes_train_as_one_process(reports, case):
    """A mesh axis of size 1 splits nothing (its shard is the whole
    dimension), and fit, evaluate (with confusion-matrix metrics, which
    view the sharded output) and predict give the single-process
    numbers; the model runs on local tensors where the "model" axis has
    one process."""
    reference, one, two = reports
    ranks = one if MESHES[case] == 1 else two
    expected = harness.run_values(reference, "single")
    shape = tuple(int(s) for s in case[5:].split(","))
    for report in ranks:
        values = harness.run_values(report, case)
        # `b1`'s kernel splits its rows over "model". Where "model" has
        # one process, it is replicated on a mesh of two (the one column,
        # whole), and keeps its layout's split of that column on a mesh
        # of one process, where no placement moves anything.
        if shape[1] > 1:
            placements = ["R", "S(0)"]
        else:
            placements = ["R", "S(1)" if shape == (1, 1) else "R"]
        assert values["b1_kernel_placements"] == placements
        assert values["a_kernel_local_shape"] == [4, 8 // shape[1]]
        assert_close_lists(values["batch_losses"], expected["batch_losses"])
        assert values["history"].keys() == expected["history"].keys()
        for key, series in expected["history"].items():
            assert_close_lists(values["history"][key], series)
        assert_close_lists(values["evaluate"], expected["evaluate"])
        np.testing.assert_allclose(
            values["predict"], expected["predict"], rtol=RTOL, atol=ATOL
        )
        assert_close_lists(values["weights"], expected["weights"])
        # Where "model" has one process, every layout of the model moves
        # nothing, and the model runs on local tensors as under
        # DataParallel; over two, its split kernels keep DTensors.
        assert values["model_ran_locally"] == (shape[1] == 1)


def test_per_process_parts_of_different_sizes(reports):
    """Parts of 16 and 12 rows make the 28-row global batch: losses,
    metrics, the update and `predict` equal one process on that batch."""
    reference, _, two = reports
    expected = harness.run_values(reference, "single")
    for report in two:
        values = harness.run_values(report, "parts")
        for name in ("test", "train", "evaluate"):
            assert_close_lists(values[name], expected[f"parts/{name}"])
        predict = np.asarray(values["predict"])
        assert predict.shape == (28, 1)
        np.testing.assert_allclose(
            predict, expected["parts/predict"], rtol=RTOL, atol=ATOL
        )
        assert_close_lists(values["weights"], expected["parts/weights"])


def test_parts_with_other_feature_shapes_fail_on_every_process(reports):
    _, _, two = reports
    messages = [
        harness.run_values(r, "parts")["feature_shape_error"] for r in two
    ]
    assert messages[0] == messages[1]
    assert messages[0].startswith("ValueError")
    assert "process 0: [(4, 4), (4, 1)]" in messages[0]
    assert "process 1: [(4, 3), (4, 1)]" in messages[0]


def test_misuse_gets_clear_errors_and_numpy_is_distributed(reports):
    _, _, two = reports
    value = np.arange(12, dtype="float32").reshape(4, 3)
    for rank, report in enumerate(two):
        values = harness.run_values(report, "misuse")
        assert values["numpy/type"] == "DTensor"
        assert values["numpy/placements"] == ["S(0)"]
        np.testing.assert_array_equal(
            values["numpy/local"], value[2 * rank : 2 * rank + 2]
        )
        for call in ("predict", "call"):
            message = values[f"built_before/{call}"]
            assert message.startswith("ValueError")
            assert "'edges/a/kernel' with shape (4, 8)" in message
            assert "created before the distribution DataParallel" in message
        assert values["gpu_devices"].startswith("ValueError")
        assert "'gpu' is not available" in values["gpu_devices"]
