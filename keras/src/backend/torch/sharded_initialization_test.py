"""Tests of creating sharded variables shard by shard.

The multi-process checks (each process's shard equal to its slice of the
single-process value, for every layout of the parity tests) are in
`integration_tests/training_parity_test.py`.
"""

import logging
from unittest import mock

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard

from keras.src import initializers
from keras.src import random
from keras.src import testing
from keras.src.backend.torch import sharded_initialization
from keras.src.distribution import distribution_lib as distribution_api


def splittable_initializers():
    return [
        initializers.RandomNormal(0.5, 2.0, seed=3),
        initializers.RandomUniform(-0.1, 0.3, seed=4),
        initializers.TruncatedNormal(seed=5),
        initializers.GlorotUniform(seed=6),
        initializers.GlorotNormal(seed=7),
        initializers.HeNormal(seed=8),
        initializers.LecunUniform(seed=9),
        initializers.Zeros(),
        initializers.Ones(),
        initializers.Constant(0.25),
    ]


# Rows of a variable read as consecutive chunks, as processes with
# different shards read them: whole, several chunks, skipping rows, and
# the last row alone (where torch redraws the last 16 normal values).
def row_pieces(rows):
    return [
        [(0, rows)],
        [(0, 7), (7, 50), (50, rows)],
        [(13, 29), (29, 30), (60, rows)],
        [(rows - 1, rows)],
    ]


class ChunkedDrawsTest(testing.TestCase):
    """An initializer's rows, chunk by chunk, equal its full value's."""

    def setUp(self):
        super().setUp()
        # Small blocks, so that chunks and skips cross block boundaries.
        self.enterContext(
            mock.patch.object(sharded_initialization, "_SKIP_VALUES", 48)
        )

    def test_rows_equal_the_full_value(self):
        # Sizes that are and are not a multiple of torch's groups of 16.
        for shape in [(1000, 37), (77, 5, 3), (4099,), (300, 64)]:
            for initializer in splittable_initializers():
                full = torch.as_tensor(initializer(shape, dtype="float32"))
                for pieces in row_pieces(shape[0]):
                    draws = sharded_initialization._ChunkedDraws(shape)
                    for start, end in pieces:
                        rows = draws.run(initializer, "float32", start, end)
                        np.testing.assert_array_equal(
                            rows.numpy(),
                            full[start:end].numpy(),
                            err_msg=f"{initializer} {shape} {start}:{end}",
                        )

    def test_a_second_draw_is_refused(self):
        def two_draws(shape, dtype=None):
            return random.normal(shape, seed=1) + random.normal(shape, seed=2)

        draws = sharded_initialization._ChunkedDraws((64, 4))
        with self.assertRaises(sharded_initialization._NotSplittable):
            draws.run(two_draws, "float32", 0, 8)

    def test_rows_out_of_order_are_refused(self):
        initializer = initializers.RandomUniform(seed=1)
        draws = sharded_initialization._ChunkedDraws((64, 4))
        draws.run(initializer, "float32", 10, 20)
        with self.assertRaises(sharded_initialization._NotSplittable):
            draws.run(initializer, "float32", 0, 8)


class InitializeVariableShardTest(testing.TestCase):
    """Shards of whole variables on a one-process mesh, and what falls back."""

    def setUp(self):
        super().setUp()
        mesh = distribution_api.DeviceMesh((1,), ("model",), ["cpu:0"])
        self.layout = distribution_api.TensorLayout(
            ("model", None), mesh
        ).backend_layout
        self.enterContext(
            mock.patch.object(sharded_initialization, "CHUNK_BYTES", 256)
        )

    def shard(self, initializer, shape=(100, 12), dtype=torch.float32):
        return sharded_initialization.initialize_variable_shard(
            initializer, shape, dtype, self.layout
        )

    def test_shard_equals_the_full_value(self):
        for initializer in splittable_initializers():
            shard = self.shard(initializer)
            self.assertIsInstance(shard, DTensor)
            self.assertEqual(tuple(shard.placements), (Shard(0),))
            full = initializer((100, 12), dtype="float32")
            np.testing.assert_array_equal(
                shard.to_local().numpy(), np.asarray(full)
            )

    def test_what_takes_the_full_path(self):
        class OwnCall(initializers.RandomNormal):
            def __call__(self, shape, dtype=None):
                return super().__call__(shape, dtype) * 2

        full_path = {
            "mixes rows": initializers.Orthogonal(seed=1),
            "identity": initializers.Identity(),
            "own __call__": OwnCall(seed=1),
            "array constant": initializers.Constant(np.ones((100, 12))),
            "seed generator": initializers.RandomNormal(
                seed=random.SeedGenerator(1)
            ),
        }
        for name, initializer in full_path.items():
            self.assertIsNone(self.shard(initializer), name)
        uniform = initializers.RandomUniform(seed=1)
        self.assertIsNone(self.shard(uniform, dtype=torch.float16))
        self.assertIsNone(self.shard(uniform, shape=(8, 8)))

    def test_full_path_is_logged_once_per_initializer(self):
        logger = "keras.src.backend.torch.sharded_initialization"
        sharded_initialization._logged_fallbacks.clear()
        with self.assertLogs(logger, level=logging.INFO) as logs:
            self.shard(initializers.Orthogonal(seed=1))
            self.shard(initializers.Orthogonal(seed=2), shape=(50, 50))
            # Small variables take the full path without a word.
            self.shard(initializers.Identity(), shape=(4, 4))
        self.assertLen(logs.records, 1)
        self.assertIn("Orthogonal", logs.output[0])
        self.assertIn("(100, 12)", logs.output[0])
