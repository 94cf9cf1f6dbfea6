"""Single-process tests of `shard_writes`: chunks put where they belong.

Saving under 4 processes (every sharded variable written by chunks, the
file read back by plain Keras) is tested in
`integration_tests/sliced_loading_test.py`.
"""

from unittest import mock

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src.backend.torch import shard_writes


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate()])
@pytest.mark.parametrize("chunk_bytes", [1, 40, 1 << 20])
def test_chunks_rebuild_the_full_value(distribution, placement, chunk_bytes):
    mesh = distribution.device_mesh.backend_mesh
    value = torch.arange(70, dtype=torch.float32).reshape(7, 10)
    parameter = distribute_tensor(value, mesh, (placement,))
    written = np.full((7, 10), -1.0, dtype="float32")
    pieces = []

    def write(selection, values):
        pieces.append(values.nbytes)
        written[selection] = values

    with mock.patch.object(shard_writes, "CHUNK_BYTES", chunk_bytes):
        shard_writes.write_by_chunks(parameter, write)
    np.testing.assert_array_equal(written, value.numpy())
    # One chunk of rows at a time, of at most `chunk_bytes` (a row at
    # least).
    assert sum(pieces) == value.numel() * 4
    assert max(pieces) <= max(chunk_bytes, 40)


def test_bfloat16_chunks_are_written_as_ml_dtypes_bits(distribution):
    import ml_dtypes

    mesh = distribution.device_mesh.backend_mesh
    value = torch.linspace(-3, 3, 70).reshape(7, 10).to(torch.bfloat16)
    parameter = distribute_tensor(value, mesh, (Shard(0),))
    written = np.zeros((7, 10), dtype=ml_dtypes.bfloat16)

    def write(selection, values):
        assert values.dtype == ml_dtypes.bfloat16
        written[selection] = values

    with mock.patch.object(shard_writes, "CHUNK_BYTES", 40):
        shard_writes.write_by_chunks(parameter, write)
    np.testing.assert_array_equal(
        written.view("int16"), value.view(torch.int16).numpy()
    )
