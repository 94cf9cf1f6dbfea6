"""Tests of reading a `.keras` archive's weights file in place.

Loading under a distribution (`load_model_in_place`, through the saving
edits) is tested in `integration_tests/sliced_loading_test.py`.
"""

import io
import zipfile

import h5py
import numpy as np

from keras.src.saving import zip_members


def archive_with(tmp_path, compression=zipfile.ZIP_STORED):
    """A zip holding a text file, then an HDF5 file of one 256 KiB array."""
    value = np.arange(256 * 256, dtype="float32").reshape(256, 256)
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        f["x"] = value
    path = str(tmp_path / "model.keras")
    with zipfile.ZipFile(path, "w", compression=compression) as archive:
        archive.writestr("config.json", "{}")
        archive.writestr("model.weights.h5", buffer.getvalue())
    return path, value


class Counted:
    """Counts the bytes read through a member file."""

    def __init__(self, member):
        self.member = member
        self.count = 0

    def readinto(self, buffer):
        read = self.member.readinto(buffer)
        self.count += read
        return read

    def __getattr__(self, name):
        return getattr(self.member, name)


def test_stored_member_reads_as_a_file_and_seeks_freely(tmp_path):
    path, value = archive_with(tmp_path)
    with zipfile.ZipFile(path) as archive:
        member = zip_members.open_stored_member(archive, "model.weights.h5")
        expected = archive.read("model.weights.h5")
    assert member.read() == expected
    member.seek(-10, io.SEEK_END)
    assert member.read() == expected[-10:]
    member.seek(100)
    assert member.read(5) == expected[100:105]
    member.close()


def test_h5py_reads_only_the_block_it_asks_for(tmp_path):
    path, value = archive_with(tmp_path)
    with zipfile.ZipFile(path) as archive:
        counted = Counted(
            zip_members.open_stored_member(archive, "model.weights.h5")
        )
        size = archive.getinfo("model.weights.h5").file_size
    with h5py.File(counted, "r") as f:
        np.testing.assert_array_equal(f["x"][:32], value[:32])
    # An eighth of the array, and the file's metadata.
    assert counted.count < size / 4
    counted.member.close()


def test_compressed_member_is_not_read_in_place(tmp_path):
    path, _ = archive_with(tmp_path, compression=zipfile.ZIP_DEFLATED)
    with zipfile.ZipFile(path) as archive:
        member = zip_members.open_stored_member(archive, "model.weights.h5")
    assert member is None


def test_archive_from_a_buffer_is_not_read_in_place(tmp_path):
    path, _ = archive_with(tmp_path)
    with open(path, "rb") as f:
        buffer = io.BytesIO(f.read())
    with zipfile.ZipFile(buffer) as archive:
        member = zip_members.open_stored_member(archive, "model.weights.h5")
    assert member is None
