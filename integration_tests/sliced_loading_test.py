"""Keras files load under distributions with each process reading its part.

One launch of `workers/sliced_loading_worker.py` on 4 gloo processes:
files saved by plain keras (`.weights.h5`, `.keras`, and Keras's sharded
weights format in several files) load under a (4,) mesh (one axis), a
(2, 2) mesh (several axes, a dimension over two axes in both orders) and
`DataParallel` (replicated). Each process must read from the files
exactly the elements of its local tensors, and every process must hold
the file's values. Uneven shapes, files saved under a distribution read
by plain keras (bfloat16 too), `load_model` and `from_preset` running no
initializer of what they load, and keras-hub's `from_preset` from a local
preset folder are checked in the same launch.
"""

import harness
import numpy as np
import pytest

NPROCS = 4
LAYOUTS = ("one_axis", "several_axes", "dp")
FILE_KINDS = ("h5", "sharded", "keras_weights", "keras")
EXPECTED_PLACEMENTS = {
    "one_axis": {
        "embedding/embeddings": ["S(0)"],
        "hidden/kernel": ["S(1)"],
        "hidden/bias": ["S(0)"],
        "norm/gamma": ["R"],
        "norm/beta": ["R"],
        "output/kernel": ["S(1)"],
        "output/bias": ["S(0)"],
    },
    "several_axes": {
        "embedding/embeddings": ["S(0)", "S(0)"],
        "hidden/kernel": ["S(0)", "S(1)"],
        "hidden/bias": ["R", "S(0)"],
        "norm/gamma": ["R", "R"],
        "norm/beta": ["R", "R"],
        # The input dimension over ("model", "batch"): the minor mesh axis
        # first, a strided split.
        "output/kernel": ["_S(0, 2)", "S(0)"],
        "output/bias": ["R", "S(0)"],
    },
}
# The rows DTensor gives each process of a dimension of 5 on 4 processes,
# and of 3 on 2.
UNEVEN_ROWS = {"rows": [2, 2, 1, 0], "grid": [2, 2, 1, 1]}


def assert_same_arrays(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    work = tmp_path_factory.mktemp("sliced_loading")
    return harness.launch(
        "sliced_loading_worker.py", NPROCS, work, args=[str(work)]
    )


@pytest.mark.parametrize("kind", FILE_KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_process_reads_its_local_tensors_only(reports, layout, kind):
    for report in reports:
        local = report[f"{layout}/{kind}/local"]
        assert report[f"{layout}/{kind}/read"] == local
    total = reports[0]["dp/h5/local"]
    if layout == "dp":
        assert all(r[f"dp/{kind}/local"] == total for r in reports)
    else:
        # Sharded variables: together the processes read each of their
        # elements once, and less than the whole on each process.
        assert all(r[f"{layout}/{kind}/local"] < total / 2 for r in reports)


@pytest.mark.parametrize("kind", FILE_KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_loaded_values_are_the_files(reports, layout, kind):
    reference = reports[0]["reference"]
    for report in reports:
        assert_same_arrays(report["reference"], reference)
        assert_same_arrays(report[f"{layout}/{kind}/values"], reference)


@pytest.mark.parametrize("layout", ("one_axis", "several_axes"))
def test_loaded_layouts(reports, layout):
    for report in reports:
        assert report[f"{layout}/placements"] == EXPECTED_PLACEMENTS[layout]


def test_keras_archive_is_read_in_place(reports):
    # Replicated, each process reads the archive's weights file about
    # once; sharded on 4 processes, well under half of it.
    for report in reports:
        whole = report["dp/keras/read_bytes"]
        assert whole > 0
        for layout in ("one_axis", "several_axes"):
            assert report[f"{layout}/keras/read_bytes"] < whole / 2


@pytest.mark.parametrize("name", sorted(UNEVEN_ROWS))
def test_uneven_shapes_read_dtensors_split(reports, name):
    for rank, report in enumerate(reports):
        local = report[f"uneven/{name}/local"]
        assert local == report[f"uneven/{name}/expected"]
        assert len(local) == UNEVEN_ROWS[name][rank]


def test_sharded_format_has_several_files(reports):
    for report in reports:
        assert len(report["reference/shard_files"]) > 1


def test_files_saved_under_distribution_load_in_plain_keras(reports):
    saved = reports[0]["saved/values"]
    for report in reports:
        assert report["saved/listing"][:2] == [
            "model.keras",
            "model.weights.json",
        ]
        assert len(report["saved/listing"]) > 3
        # `.keras` and the sharded format: every sharded variable (weights
        # and optimizer slots) written as gathered, by chunks.
        sharded = report["saved/sharded_variables"]
        assert report["saved/by_chunks"] == 2 * sharded
        assert_same_arrays(report["saved/values"], saved)
        assert_same_arrays(report["saved/plain_keras"], saved)
        assert_same_arrays(report["saved/plain_sharded"], saved)


def test_load_model_runs_no_initializer_of_what_it_loads(reports):
    # The model loaded by `load_model` is created with empty shards, which
    # the file fills; outside a load, the same model runs its
    # initializers shard by shard.
    for report in reports:
        for layout in ("one_axis", "several_axes"):
            assert report[f"{layout}/keras/created_initialized"] > 0
            assert report[f"{layout}/keras/initialized"] == 0


def test_bfloat16_saved_under_distribution_by_chunks(reports):
    saved = reports[0]["bfloat16/values"]
    for report in reports:
        # The embedding, the kernel and the bias are sharded.
        assert report["bfloat16/by_chunks"] == ["torch.bfloat16"] * 3
        assert report["bfloat16/values"] == saved
        assert report["bfloat16/plain"] == saved


def test_keras_hub_from_preset_reads_local_tensors(reports):
    harness.require("keras_hub")
    reference = reports[0]["keras_hub/reference"]
    total = sum(np.asarray(w).size for w in reference)
    for report in reports:
        assert report["keras_hub/read"] == report["keras_hub/local"]
        assert report["keras_hub/initialized"] == 0
        assert report["keras_hub/local"] < total / 2
        assert report["keras_hub/embedding_placements"] == ["S(1)", "S(0)"]
        assert_same_arrays(report["keras_hub/values"], reference)
