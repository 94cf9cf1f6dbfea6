"""Single-process tests of the saving edits (`keras_dtensor._saving_edits`).

Without a distribution, saving is upstream's; with one (here on one
process), every save writes into a staging folder and renames. Multi-process
behaviour is tested in `integration_tests/checkpoint_test.py`.
"""

import os
import types

import numpy as np
import pytest

import keras
from keras.src.saving import saving_lib
from keras_dtensor import _edit_support
from keras_dtensor import _saving_edits


def make_model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


@pytest.fixture
def written(monkeypatch):
    """The paths upstream saving writes to."""
    paths = []
    upstream = saving_lib.save_weights_only

    def save_weights_only(model, filepath, *args, **kwargs):
        paths.append(str(filepath))
        return upstream(model, filepath, *args, **kwargs)

    monkeypatch.setattr(saving_lib, "save_weights_only", save_weights_only)
    return paths


@pytest.fixture
def distribution():
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=["cpu:0"])
    )
    yield
    keras.distribution.set_distribution(None)


def test_without_distribution_saving_is_upstream(tmp_path, written):
    path = str(tmp_path / "model.weights.h5")
    make_model().save_weights(path)
    assert written == [path]


def test_with_distribution_saves_are_staged_and_renamed(
    tmp_path, written, distribution
):
    model = make_model()
    path = tmp_path / "model.weights.h5"
    model.save_weights(path)
    staging = os.path.dirname(written[0])
    assert os.path.basename(staging).startswith(".model.weights.h5.staging-")
    assert os.listdir(tmp_path) == ["model.weights.h5"]
    for name in ("model.keras", "legacy.h5"):
        model.save(tmp_path / name)
        # Upstream cannot compile a legacy file with a string loss.
        loaded = keras.saving.load_model(tmp_path / name, compile=False)
        for a, b in zip(loaded.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)
    assert sorted(os.listdir(tmp_path)) == [
        "legacy.h5",
        "model.keras",
        "model.weights.h5",
    ]


def test_with_distribution_a_failed_save_keeps_the_previous_file(
    tmp_path, monkeypatch, distribution
):
    model = make_model()
    path = tmp_path / "model.weights.h5"
    model.save_weights(path)
    expected = model.get_weights()
    model.set_weights([w + 1 for w in expected])
    upstream_setitem = saving_lib.H5IOStore.__setitem__
    writes = []

    def setitem_then_fail(self, key, value):
        upstream_setitem(self, key, value)
        writes.append(key)
        if len(writes) == 2:
            raise OSError("killed while writing")

    monkeypatch.setattr(saving_lib.H5IOStore, "__setitem__", setitem_then_fail)
    with pytest.raises(OSError, match="killed while writing"):
        model.save_weights(path)
    monkeypatch.setattr(saving_lib.H5IOStore, "__setitem__", upstream_setitem)
    assert os.listdir(tmp_path) == ["model.weights.h5"]
    model.load_weights(path)
    for a, b in zip(model.get_weights(), expected):
        np.testing.assert_array_equal(a, b)


@pytest.fixture
def model_parallel():
    """Kernels split on a `model` axis of this process's one device."""
    mesh = keras.distribution.DeviceMesh((1,), ("model",), ["cpu:0"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )
    yield
    keras.distribution.set_distribution(None)


def test_sharded_model_saves_by_chunks_and_loads_by_part(
    tmp_path, monkeypatch, model_parallel
):
    from keras.src.backend.torch import shard_reads
    from keras.src.backend.torch import shard_writes

    calls = []
    for module, name in (
        (shard_writes, "write_by_chunks"),
        (shard_reads, "assign_from_view"),
    ):
        upstream = getattr(module, name)

        def spied(*args, upstream=upstream, name=name):
            calls.append(name)
            return upstream(*args)

        monkeypatch.setattr(module, name, spied)
    model = make_model()
    assert model.layers[0].kernel.value.placements[0].is_shard()
    expected = model.get_weights()
    model.save_weights(tmp_path / "model.weights.h5")
    model.save(tmp_path / "model.keras")
    # Keras's sharded format, in files of at most 40 bytes.
    model.save_weights(
        tmp_path / "model.weights.json", max_shard_size=40 / 1024**3
    )
    # The kernel and its two Adam slots, in each format.
    assert calls.count("write_by_chunks") == 9
    fresh = make_model()
    fresh.set_weights([w + 1 for w in expected])
    fresh.load_weights(tmp_path / "model.weights.h5")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    # Every variable of both models, optimizers' included, read by part.
    assert calls.count("assign_from_view") == 2 * (
        len(model.weights) + len(model.optimizer.variables)
    )
    for values in (fresh.get_weights(), loaded.get_weights()):
        for a, b in zip(values, expected):
            np.testing.assert_array_equal(a, b)
    keras.distribution.set_distribution(None)
    plain = keras.saving.load_model(tmp_path / "model.keras")
    plain_sharded = make_model()
    plain_sharded.load_weights(tmp_path / "model.weights.json")
    for values in (plain.get_weights(), plain_sharded.get_weights()):
        for a, b in zip(values, expected):
            np.testing.assert_array_equal(a, b)
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".h5")]) > 3


def test_makedirs_accepts_an_existing_folder_under_distribution(
    tmp_path, distribution
):
    from keras.src.utils import file_utils

    file_utils.makedirs(str(tmp_path))


def test_makedirs_is_upstream_without_distribution(tmp_path):
    from keras.src.utils import file_utils

    with pytest.raises(FileExistsError):
        file_utils.makedirs(str(tmp_path))


@pytest.mark.parametrize(
    "edit",
    [
        _saving_edits.edit_saving_api_save,
        _saving_edits.edit_saving_api_load,
        _saving_edits.edit_file_utils_makedirs,
        _saving_edits.edit_backup_and_restore,
        _saving_edits.edit_weights_store_reads_by_part,
        _saving_edits.edit_weights_store_writes_by_chunks,
        _saving_edits.edit_keras_archive_loads_in_place,
        _saving_edits.edit_optimizer_saves_variables,
    ],
)
def test_edits_leave_other_backends_alone(edit, monkeypatch):
    monkeypatch.setattr(_edit_support, "is_torch_backend", lambda: False)
    module = types.SimpleNamespace()
    edit(module)
    assert vars(module) == {}
