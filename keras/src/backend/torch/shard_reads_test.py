"""Single-process tests of `shard_reads`: runs, blocks and their assembly.

Which elements each process reads, and the values loaded, on 4 processes
for every layout kind (one axis, several axes, a dimension over two axes
in both orders, replicated, uneven), are tested in
`integration_tests/sliced_loading_test.py`.
"""

from unittest import mock

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src.backend.torch import shard_reads
from keras.src.backend.torch.torch_internals import StridedShard


class Recorded:
    """A saved array that records the blocks read from it."""

    def __init__(self, value):
        self.value = value
        self.shape = value.shape
        self.dtype = value.dtype
        self.blocks = []

    def read_blocks(self, blocks):
        self.blocks.extend(blocks)
        return [self.value[block] for block in blocks]


def test_runs_of_consecutive_positions():
    assert shard_reads.runs_of(np.array([3, 4, 5])) == [(3, 6, 0)]
    assert shard_reads.runs_of(np.array([0, 1, 4, 5, 8])) == [
        (0, 2, 0),
        (4, 6, 2),
        (8, 9, 4),
    ]
    assert shard_reads.runs_of(np.array([], dtype=np.int64)) == [(0, 0, 0)]


@pytest.mark.parametrize(
    "positions",
    [
        [np.arange(2, 4), np.arange(0, 6)],
        # A strided split: rows 0, 1, 4, 5 of 8.
        [np.array([0, 1, 4, 5]), np.arange(3, 6)],
        [np.array([], dtype=np.int64), np.arange(0, 6)],
    ],
)
@pytest.mark.parametrize("chunk_bytes", [1, 48, 1 << 20])
def test_local_tensor_written_from_its_blocks(positions, chunk_bytes):
    value = np.arange(48, dtype="float32").reshape(8, 6)
    saved = Recorded(value)
    local = torch.full((len(positions[0]), len(positions[1])), -1.0)
    with mock.patch.object(shard_reads, "CHUNK_BYTES", chunk_bytes):
        shard_reads.write_blocks(local, positions, saved, "float32")
    np.testing.assert_array_equal(local.numpy(), value[np.ix_(*positions)])
    # Only the local elements come off the file, in chunks of rows of at
    # most `chunk_bytes` (one row at least).
    sizes = [value[block].nbytes for block in saved.blocks]
    assert sum(sizes) == local.numel() * 4
    assert max(sizes, default=0) <= max(chunk_bytes, 4 * 6)


def test_a_scalar_is_one_read():
    saved = Recorded(np.array(7.0, dtype="float32"))
    local = torch.zeros(())
    shard_reads.write_blocks(local, [], saved, "float32")
    assert float(local) == 7.0 and saved.blocks == [()]


@pytest.mark.parametrize(
    "placement, dim, expected",
    [
        (Shard(1), 1, Shard(0)),
        (Shard(1), 0, Replicate()),
        (StridedShard(0, split_factor=2), 0, StridedShard(0, split_factor=2)),
        (Replicate(), 0, Replicate()),
    ],
)
def test_placement_on_one_dimension(placement, dim, expected):
    assert shard_reads._placement_on_dim(placement, dim) == expected


def test_partial_placements_are_refused():
    with pytest.raises(ValueError, match="cannot be loaded"):
        shard_reads._placement_on_dim(Partial(), 0)


def test_positions_on_a_mesh_of_one_process(distribution):
    mesh = distribution.device_mesh.backend_mesh
    positions = shard_reads.local_positions((5, 3), mesh, (Shard(0),))
    np.testing.assert_array_equal(positions[0], np.arange(5))
    np.testing.assert_array_equal(positions[1], np.arange(3))
    parameter = torch.distributed.tensor.distribute_tensor(
        torch.zeros(5, 3), mesh, (Shard(0),)
    )
    saved = Recorded(np.arange(15, dtype="float32").reshape(5, 3))
    shard_reads.assign_from_view(parameter, saved, "float32")
    np.testing.assert_array_equal(parameter.to_local().numpy(), saved.value)


def test_bfloat16_chunks_are_written_bit_for_bit():
    import ml_dtypes

    value = np.linspace(-3, 3, 48, dtype="float32").reshape(8, 6)
    saved = Recorded(value.astype(ml_dtypes.bfloat16))
    local = torch.zeros((8, 6), dtype=torch.bfloat16)
    with mock.patch.object(shard_reads, "CHUNK_BYTES", 24):
        shard_reads.write_blocks(
            local, [np.arange(8), np.arange(6)], saved, "bfloat16"
        )
    np.testing.assert_array_equal(
        local.view(torch.int16).numpy(), saved.value.view("int16")
    )
