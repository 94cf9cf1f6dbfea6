"""Tests of `DatasetView`: shape and dtype unread, blocks read on demand.

The views under a distribution, with variables reading their parts, are
tested in `integration_tests/sliced_loading_test.py`.
"""

import os
import re

import h5py
import ml_dtypes
import numpy as np
import pytest

from keras.src.saving import dataset_views


def saved(tmp_path, value, bfloat16=False):
    path = str(tmp_path / "arrays.h5")
    with h5py.File(path, "w") as f:
        dataset = f.create_dataset("group/x", data=value)
        if bfloat16:
            dataset.attrs["dtype"] = "bfloat16"
    return path


def test_view_has_shape_and_dtype_and_reads_blocks(tmp_path):
    value = np.arange(48, dtype="float32").reshape(6, 8)
    with h5py.File(saved(tmp_path, value), "r") as f:
        view = dataset_views.DatasetView(f["group/x"])
        assert view.shape == (6, 8)
        assert view.dtype == np.float32
        assert view.ndim == 2 and len(view) == 6
        assert view.nbytes == value.nbytes
        top, right = view.read_blocks(
            [(slice(0, 2), slice(0, 8)), (slice(2, 6), slice(5, 8))]
        )
        np.testing.assert_array_equal(top, value[:2])
        np.testing.assert_array_equal(right, value[2:, 5:])
        np.testing.assert_array_equal(np.asarray(view), value)
        np.testing.assert_array_equal(view[1:3, ::2], value[1:3, ::2])
        (empty,) = view.read_blocks([(slice(3, 3), slice(0, 8))])
        assert empty.shape == (0, 8)


def test_view_reopens_its_file_after_the_store_closed_it(tmp_path):
    value = np.arange(12, dtype="int64").reshape(3, 4)
    path = saved(tmp_path, value)
    with h5py.File(path, "r") as f:
        view = dataset_views.DatasetView(f["group/x"])
    (block,) = view.read_blocks([(slice(1, 3), slice(0, 2))])
    np.testing.assert_array_equal(block, value[1:3, :2])
    np.testing.assert_array_equal(np.asarray(view, dtype="float32"), value)


def test_bfloat16_arrays_read_as_bfloat16(tmp_path):
    value = np.linspace(-1, 1, 8).astype(ml_dtypes.bfloat16)
    with h5py.File(saved(tmp_path, value, bfloat16=True), "r") as f:
        view = dataset_views.DatasetView(f["group/x"])
        assert view.dtype == np.dtype(ml_dtypes.bfloat16)
        (block,) = view.read_blocks([(slice(2, 5),)])
        assert block.dtype == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(block, value[2:5])


def read_chars():
    with open("/proc/self/io") as f:
        return int(re.search(r"rchar:\s+(\d+)", f.read()).group(1))


@pytest.mark.skipif(
    not os.path.exists("/proc/self/io"), reason="reads /proc/self/io"
)
def test_a_block_of_columns_reads_its_bytes_only(tmp_path):
    value = np.ones((1024, 2048), dtype="float32")  # 8 MiB, rows of 8 KiB.
    path = saved(tmp_path, value)
    with dataset_views.open_for_blocks(path) as f:
        view = dataset_views.DatasetView(f["group/x"])
        before = read_chars()
        (block,) = view.read_blocks([(slice(0, 1024), slice(0, 512))])
        read = read_chars() - before
    assert block.nbytes == 2 * 2**20
    # HDF5's sieve buffer would read 64 KiB around each row: all 8 MiB.
    assert read < 1.1 * block.nbytes
