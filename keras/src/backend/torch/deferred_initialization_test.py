"""Tests of variables created by a load: empty until the load writes them,
else filled with their initial values when the load ends.

The multi-process checks (a `.keras` file and a keras-hub preset loaded
under a distribution hold the file's values) are in
`integration_tests/sliced_loading_test.py`.
"""

from unittest import mock

import numpy as np
import torch

from keras.src import initializers
from keras.src import testing
from keras.src.backend.torch import deferred_initialization
from keras.src.backend.torch import distribution_lib
from keras.src.backend.torch import shard_reads
from keras.src.backend.torch import sharded_initialization
from keras.src.backend.torch import torch_internals
from keras.src.distribution import distribution_lib as distribution_api

SHAPE = (100, 12)


class LoadingCreatedVariablesTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        mesh = distribution_api.DeviceMesh((1,), ("model",), ["cpu:0"])
        self.layout = distribution_api.TensorLayout(
            ("model", None), mesh
        ).backend_layout
        self.enterContext(
            mock.patch.object(sharded_initialization, "CHUNK_BYTES", 256)
        )

    def shard(self, initializer):
        return sharded_initialization.initialize_variable_shard(
            initializer, SHAPE, torch.float32, self.layout
        )

    def initial(self, initializer):
        return np.asarray(initializer(SHAPE, dtype="float32"))

    def test_outside_a_load_shards_are_filled_at_creation(self):
        initializer = initializers.RandomNormal(seed=3)
        self.assertFalse(deferred_initialization.deferring())
        with mock.patch.object(deferred_initialization, "defer") as defer:
            shard = self.shard(initializer)
        defer.assert_not_called()
        np.testing.assert_array_equal(
            shard.to_local().numpy(), self.initial(initializer)
        )

    def test_shards_no_load_writes_get_their_initial_values_at_the_end(self):
        initializer = initializers.GlorotUniform(seed=6)
        with mock.patch.object(
            sharded_initialization, "_fill_shard"
        ) as fill_shard:
            with deferred_initialization.loading_created_variables():
                shard = self.shard(initializer)
                # Nested scopes belong to the outermost one.
                with deferred_initialization.loading_created_variables():
                    pass
                fill_shard.assert_not_called()
        fill_shard.assert_called_once()
        with deferred_initialization.loading_created_variables():
            shard = self.shard(initializer)
        np.testing.assert_array_equal(
            shard.to_local().numpy(), self.initial(initializer)
        )

    def test_shards_a_load_writes_keep_the_loaded_values(self):
        class Saved:
            def __init__(self, value):
                self.value = value
                self.shape = value.shape
                self.dtype = value.dtype

            def read_blocks(self, blocks):
                return [self.value[block] for block in blocks]

        first = np.full(SHAPE, 2.0, dtype="float32")
        second = np.full(SHAPE, 3.0, dtype="float32")
        initializer = initializers.RandomUniform(seed=4)
        with deferred_initialization.loading_created_variables():
            from_view = torch.nn.Parameter(self.shard(initializer))
            assigned = torch.nn.Parameter(self.shard(initializer))
            left = torch.nn.Parameter(self.shard(initializer))
            shard_reads.assign_from_view(from_view, Saved(first), "float32")
            distribution_lib.assign_to_variable(assigned, second)
        np.testing.assert_array_equal(
            from_view.to_local().detach().numpy(), first
        )
        np.testing.assert_array_equal(
            assigned.to_local().detach().numpy(), second
        )
        np.testing.assert_array_equal(
            left.to_local().detach().numpy(), self.initial(initializer)
        )

    def test_a_variable_keeps_the_shard_the_load_fills(self):
        # The parameter of a variable holds the storage that was deferred,
        # so the fill at the end reaches the variable.
        initializer = initializers.RandomNormal(seed=5)
        with deferred_initialization.loading_created_variables():
            parameter = distribution_lib.distribute_variable(
                self.shard(initializer), self.layout
            )
        local = torch_internals.local_tensor(parameter)
        np.testing.assert_array_equal(
            local.detach().numpy(), self.initial(initializer)
        )

    def test_other_dtypes_are_deferred_and_filled_from_the_full_value(self):
        initializer = initializers.RandomNormal(seed=8)
        full = initializer(SHAPE, dtype="bfloat16")
        shard = sharded_initialization.initialize_variable_shard(
            initializer, SHAPE, torch.bfloat16, self.layout
        )
        # Outside a load, bfloat16 takes the full path.
        self.assertIsNone(shard)
        with deferred_initialization.loading_created_variables():
            shard = sharded_initialization.initialize_variable_shard(
                initializer, SHAPE, torch.bfloat16, self.layout
            )
        self.assertEqual(shard.dtype, torch.bfloat16)
        torch.testing.assert_close(
            shard.to_local(), torch.as_tensor(full), rtol=0, atol=0
        )

    def test_a_fill_that_cannot_run_by_chunks_takes_the_full_value(self):
        initializer = initializers.TruncatedNormal(seed=7)
        with mock.patch.object(
            sharded_initialization,
            "_fill_shard",
            side_effect=sharded_initialization._NotSplittable("test"),
        ):
            with deferred_initialization.loading_created_variables():
                shard = self.shard(initializer)
        np.testing.assert_array_equal(
            shard.to_local().numpy(), self.initial(initializer)
        )
