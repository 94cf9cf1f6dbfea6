"""Tests of `reshard_after_forward` (unsharded values freed after forward,
unsharded again in backward) on a one-process mesh."""

import os
from unittest import mock

import numpy as np
import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import layers
from keras.src import models
from keras.src.backend.torch import gathered_units
from keras.src.backend.torch import reshard_after_forward
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import unit_gathering
from keras.src.backend.torch import unit_gathering_test


class ReshardAfterForwardTest(unit_gathering_test.ShardedKernelsTestCase):
    def test_backward_gathers_again_what_it_needs(self):
        # With units not joined, each Dense is a unit of its own.
        with mock.patch.dict(
            os.environ, {gathered_units.UNIT_CAP_ENV_VAR: "0"}
        ):
            model = models.Sequential([layers.Dense(6), layers.Dense(3)])
            model = self.sharded_layer(model, (None, 4))
            outputs, gradients, gathers = self.first_then_local(
                model, self.batch((6, 4))
            )
        # Both calls gather both kernels in forward. Backward of the local
        # call, whose saved kernels were not kept, gathers again the second
        # one (the first is not needed: the input needs no gradient).
        self.assertEqual(gathers, [2, 2, 2, 3])
        self.assertSameCalls(outputs, gradients)

    def sharded_value(self):
        values = torch.arange(12.0).reshape(4, 3)
        return distribute_tensor(values, self.mesh.backend_mesh, [Shard(0)])

    def test_a_saved_view_of_a_registered_value_is_unsharded_again(self):
        value = self.sharded_value()
        full = torch_internals.local_tensor(
            unit_gathering.unshard(value)
        ).contiguous()
        resharding = reshard_after_forward.ReshardAfterForward()
        resharding.register(None, (value,), (full,))
        weight = torch.full((3, 3), 2.0, requires_grad=True)
        with mock.patch.object(
            unit_gathering, "unshard", wraps=unit_gathering.unshard
        ) as unshard:
            with resharding.saved_tensors_hooks():
                # Each `mm` saves rows of `full` (a view of it) for
                # `weight`'s gradient: one unshard serves both.
                out = full[1:] @ weight + full[:3] @ weight
            self.assertEqual(unshard.call_count, 0)
            out.sum().backward()
        self.assertEqual(unshard.call_count, 1)
        ones = torch.ones(3, 3)
        expected = full[1:].T @ ones + full[:3].T @ ones
        np.testing.assert_allclose(weight.grad.numpy(), expected.numpy())

    def test_other_tensors_are_saved_as_they_are(self):
        resharding = reshard_after_forward.ReshardAfterForward()
        plain = torch.ones(3, requires_grad=True)
        with mock.patch.object(
            unit_gathering, "unshard", wraps=unit_gathering.unshard
        ) as unshard:
            with resharding.saved_tensors_hooks():
                out = plain * plain
            out.sum().backward()
        self.assertEqual(unshard.call_count, 0)
        np.testing.assert_array_equal(plain.grad.numpy(), 2 * np.ones(3))

    def test_no_resharding_means_no_hooks(self):
        with reshard_after_forward.saved_tensors_hooks(None):
            self.assertIsNone(
                torch._C._autograd._top_saved_tensors_default_hooks(False)
            )
