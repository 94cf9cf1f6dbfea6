"""Tests of `creation_handlers` on a one-process mesh."""

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

import keras
from keras.src import testing
from keras.src.backend.torch import created_tensors
from keras.src.distribution import distribution_lib as distribution_api


class OneProcessMeshTestCase(testing.TestCase):
    """A test case with a one-process ("batch",) mesh."""

    def setUp(self):
        super().setUp()
        self.mesh = distribution_api.DeviceMesh((1,), ("batch",), ["cpu:0"])
        self.backend_mesh = self.mesh.backend_mesh


class CreationHandlersTest(OneProcessMeshTestCase):
    """Tensors made from Python values inside a step are replicated, and
    random draws take the values of the global shape."""

    def test_factories_make_replicated_dtensors(self):
        with created_tensors.replicate_created_tensors(self.mesh):
            positions = torch.arange(6)
            constants = torch.as_tensor(np.ones((2, 3), dtype="float32"))
            scalar = torch.tensor(2.0)
            broadcast = torch.broadcast_to(scalar, (2, 3))
            meta = torch.ones(3, device="meta")
        for value in (positions, constants, scalar, broadcast):
            self.assertIsInstance(value, DTensor)
            self.assertEqual(tuple(value.placements), (Replicate(),))
        self.assertAllClose(positions.to_local().numpy(), np.arange(6))
        # A scalar counts too, so what is derived from it alone (as
        # metrics broadcast a missing sample weight) is replicated.
        self.assertAllClose(broadcast.to_local().numpy(), np.full((2, 3), 2))
        # Meta tensors (shape inference) hold no values and stay plain.
        self.assertNotIsInstance(meta, DTensor)

    def test_tensors_made_under_vmap_are_replicated(self):
        """Keras's `vectorized_map` (`torch.vmap`) makes tensors too, as a
        multi-label `AUC` does: `DTensor.from_local`'s autograd function
        cannot run under `vmap`, so a value that needs no gradient is
        wrapped without one."""
        rows = distribute_tensor(
            torch.arange(6.0).reshape(2, 3), self.backend_mesh, [Replicate()]
        )
        labels = [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
        scores = [[0.9, 0.2, 0.6], [0.3, 0.7, 0.4], [0.8, 0.1, 0.5]]
        expected = keras.metrics.AUC(multi_label=True, num_labels=3)
        expected.update_state(labels, scores)
        with created_tensors.replicate_created_tensors(self.mesh):
            got = torch.vmap(lambda row: row * torch.tensor(2.0))(rows)
            metric = keras.metrics.AUC(multi_label=True, num_labels=3)
            metric.update_state(torch.tensor(labels), torch.tensor(scores))
            auc = metric.result()
        self.assertEqual(tuple(got.placements), (Replicate(),))
        self.assertAllClose(got.full_tensor().numpy(), [[0, 2, 4], [6, 8, 10]])
        self.assertAllClose(
            auc.full_tensor().numpy(), expected.result().numpy()
        )

    def test_zero_d_dtensor_arguments_count_as_python_values(self):
        # As Keras's pairwise losses build a mask: `ops.eye(ops.size(x))`.
        plain_size = torch.tensor(3)
        with created_tensors.replicate_created_tensors(self.mesh):
            size = torch.prod(torch.as_tensor((3,)))
            eye = torch.eye(size, size, dtype=torch.bool)
            from_plain = torch.eye(plain_size, plain_size)
        self.assertIsInstance(size, DTensor)
        self.assertIsInstance(eye, DTensor)
        self.assertEqual(tuple(eye.placements), (Replicate(),))
        self.assertAllClose(eye.to_local().numpy(), np.eye(3, dtype=bool))
        # A plain tensor may hold a process's own value: the result stays
        # plain.
        self.assertNotIsInstance(from_plain, DTensor)

    def test_tensors_from_tensors_stay_plain(self):
        plain = torch.ones(3)
        with created_tensors.replicate_created_tensors(self.mesh):
            copied = torch.as_tensor(plain)
            doubled = plain * 2
        self.assertNotIsInstance(copied, DTensor)
        self.assertNotIsInstance(doubled, DTensor)

    def test_random_draws_use_the_given_generator(self):
        probabilities = torch.full((4, 6), 0.5)
        expected = torch.bernoulli(
            probabilities, generator=torch.Generator().manual_seed(5)
        )
        with created_tensors.replicate_created_tensors(self.mesh):
            drawn = torch.bernoulli(
                torch.full((4, 6), 0.5),
                generator=torch.Generator().manual_seed(5),
            )
        self.assertIsInstance(drawn, DTensor)
        self.assertAllClose(drawn.to_local().numpy(), expected.numpy())

    def test_dropout_mask_equals_the_plain_one(self):
        x = torch.ones(8, 5)
        torch.manual_seed(3)
        expected = torch.nn.functional.dropout(x, p=0.4, training=True)
        inputs = DTensor.from_local(
            x, self.backend_mesh, [Shard(0)], run_check=False
        )
        torch.manual_seed(3)
        with created_tensors.replicate_created_tensors(self.mesh):
            dropped = torch.nn.functional.dropout(inputs, p=0.4, training=True)
            kept = torch.nn.functional.dropout(inputs, p=0.4, training=False)
        self.assertAllClose(dropped.full_tensor().numpy(), expected.numpy())
        self.assertIs(kept, inputs)
