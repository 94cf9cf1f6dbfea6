"""Single-process tests of `distributed_saving`: staging, renames, recovery.

Multi-process behaviour is tested in `integration_tests/checkpoint_test.py`.
"""

import io
import os

import pytest

from keras.src.saving import distributed_saving


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def read(path):
    with open(path) as f:
        return f.read()


def test_save_publishes_the_file_and_leaves_nothing_else(tmp_path):
    destination = tmp_path / "model.keras"
    seen = []

    def save(path):
        seen.append(path)
        write(path, "new")
        return "result"

    result = distributed_saving.save_from_process_zero(
        save, destination, "save_model"
    )
    assert result == "result"
    assert read(destination) == "new"
    staging, name = os.path.split(seen[0])
    assert name == "model.keras"
    assert os.path.dirname(staging) == str(tmp_path)
    assert os.path.basename(staging).startswith(".model.keras.staging-")
    assert os.listdir(tmp_path) == ["model.keras"]


def test_failed_save_keeps_the_previous_file(tmp_path):
    destination = tmp_path / "model.weights.h5"
    write(destination, "previous")

    def save(path):
        write(path, "partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        distributed_saving.save_from_process_zero(
            save, destination, "save_weights"
        )
    assert read(destination) == "previous"
    assert os.listdir(tmp_path) == ["model.weights.h5"]


def test_next_save_removes_leftovers_of_a_killed_save(tmp_path):
    destination = tmp_path / "model.keras"
    killed = tmp_path / ".model.keras.staging-killed"
    killed.mkdir()
    write(killed / "model.keras", "partial")
    distributed_saving.save_from_process_zero(
        lambda path: write(path, "new"), destination, "save_model"
    )
    assert os.listdir(tmp_path) == ["model.keras"]
    assert read(destination) == "new"


def test_index_files_are_published_last(tmp_path, monkeypatch):
    destination = tmp_path / "model.weights.json"
    order = []
    upstream_replace = distributed_saving.replace

    def replace(source, target, token):
        order.append(os.path.basename(target))
        upstream_replace(source, target, token)

    monkeypatch.setattr(distributed_saving, "replace", replace)

    def save(path):
        folder = os.path.dirname(path)
        write(os.path.join(folder, "model_00001.weights.h5"), "b")
        write(path, "index")
        write(os.path.join(folder, "model_00000.weights.h5"), "a")

    distributed_saving.save_from_process_zero(save, destination, "save")
    assert order == [
        "model_00000.weights.h5",
        "model_00001.weights.h5",
        "model.weights.json",
    ]
    assert sorted(os.listdir(tmp_path)) == sorted(order)


def test_folder_is_replaced_whole(tmp_path):
    destination = tmp_path / "checkpoint"
    destination.mkdir()
    write(destination / "old_only", "1")

    def save(path):
        os.makedirs(path)
        write(os.path.join(path, "new_only"), "2")

    distributed_saving.save_from_process_zero(save, destination, "save")
    assert os.listdir(destination) == ["new_only"]
    assert os.listdir(tmp_path) == ["checkpoint"]


def test_interrupted_folder_replace_is_restored(tmp_path, monkeypatch):
    destination = tmp_path / "checkpoint"
    destination.mkdir()
    write(destination / "value", "previous")
    staging = distributed_saving.make_staging_dir(destination, "token")
    write(os.path.join(staging, "value"), "new")
    renames = []
    upstream_rename = os.rename

    def rename_then_die(source, target):
        if renames:
            raise KeyboardInterrupt("killed between the two renames")
        renames.append(target)
        upstream_rename(source, target)

    monkeypatch.setattr(distributed_saving.os, "rename", rename_then_die)
    with pytest.raises(KeyboardInterrupt):
        distributed_saving.replace(staging, str(destination), "token")
    monkeypatch.setattr(distributed_saving.os, "rename", upstream_rename)

    assert not destination.exists()
    assert distributed_saving.needs_restore(destination)
    assert distributed_saving.restore_interrupted_replace(str(destination))
    assert read(destination / "value") == "previous"
    assert not distributed_saving.needs_restore(destination)


def test_overwrite_false_asks_in_a_single_process(tmp_path, monkeypatch):
    from keras.src.utils import io_utils

    destination = tmp_path / "model.keras"
    write(destination, "previous")
    monkeypatch.setattr(
        io_utils, "ask_to_proceed_with_overwrite", lambda path: False
    )
    result = distributed_saving.save_from_process_zero(
        lambda path: write(path, "new"),
        destination,
        "save_model",
        overwrite=False,
    )
    assert result is None
    assert read(destination) == "previous"


def test_file_objects_are_written_directly():
    buffer = io.BytesIO()
    distributed_saving.save_from_process_zero(
        lambda target: target.write(b"bytes"), buffer, "save_model"
    )
    assert buffer.getvalue() == b"bytes"


def test_copy_file(tmp_path):
    write(tmp_path / "source", "content")
    write(tmp_path / "destination", "old")
    distributed_saving.copy_file(
        str(tmp_path / "source"), str(tmp_path / "destination")
    )
    assert read(tmp_path / "destination") == "content"
    assert sorted(os.listdir(tmp_path)) == ["destination", "source"]


def test_process_zero_writes_and_check_in_a_single_process():
    with distributed_saving.process_zero_writes("op", io.BytesIO()) as call:
        assert call.is_writer
        assert call.target is None
    distributed_saving.check_every_process_calls("load_model", "path")
