"""Single-process tests of one bucket of gradients.

An all-reduce over one process leaves the values as they are, so a
bucket's flattening, hand-back and accumulation are checked here; values
across processes are checked by the integration tests.
"""

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import distribute_tensor

from keras.src import testing
from keras.src.backend.torch import gradient_bucket
from keras.src.backend.torch import parameter_gradients
from keras.src.backend.torch import reducer_test


def replicated(mesh, shape):
    value = torch.arange(np.prod(shape), dtype=torch.float32).reshape(shape)
    return torch.nn.Parameter(distribute_tensor(value, mesh, [Replicate()]))


class BucketTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        self.mesh = reducer_test.one_process_mesh()
        self.layouts = parameter_gradients.GradientLayouts()

    def bucket(self, reduce_op="sum"):
        return gradient_bucket.Bucket(self.mesh, (0,), reduce_op, self.layouts)

    def test_a_parameters_gradients_are_summed_in_its_entry(self):
        weight = replicated(self.mesh, (2, 3))
        bucket = self.bucket()
        bucket.add(weight, torch.ones(2, 3))
        bucket.add(weight, torch.full((2, 3), 2.0))
        self.assertLen(bucket.entries, 1)
        self.assertEqual(bucket.nbytes, 6 * 4)
        self.assertAllClose(bucket.entries[0][1].numpy(), np.full((2, 3), 3.0))

    def test_launch_flattens_and_keeps_only_shapes(self):
        weight, bias = replicated(self.mesh, (2, 3)), replicated(self.mesh, 3)
        bucket = self.bucket()
        bucket.add(weight, torch.ones(2, 3))
        bucket.add(bias, torch.full((3,), 2.0))
        bucket.launch()
        self.assertEqual(
            bucket.entries,
            [(weight, torch.Size((2, 3))), (bias, torch.Size((3,)))],
        )
        self.assertIsNone(bucket.index)
        self.assertEqual(tuple(bucket.flat.shape), (9,))
        bucket.finish(set())
        self.assertAllClose(weight.grad.to_local().numpy(), np.ones((2, 3)))
        self.assertAllClose(bias.grad.to_local().numpy(), np.full(3, 2.0))

    def test_finish_hands_back_views_laid_out_as_parameters(self):
        weight, bias = replicated(self.mesh, (2, 3)), replicated(self.mesh, 3)
        bucket = self.bucket("avg")
        bucket.add(weight, torch.ones(2, 3))
        bucket.add(bias, torch.ones(3))
        bucket.launch()
        assigned = set()
        bucket.finish(assigned)
        self.assertEqual(assigned, {id(weight), id(bias)})
        for parameter in (weight, bias):
            grad = parameter.grad
            self.assertIs(type(grad), DTensor)
            self.assertEqual(grad.placements, parameter.placements)
            self.assertEqual(
                grad.to_local().untyped_storage().data_ptr(),
                bucket.flat.untyped_storage().data_ptr(),
            )

    def test_an_assigned_parameter_has_the_gradient_added(self):
        weight = replicated(self.mesh, (2, 3))
        first, second = self.bucket(), self.bucket()
        first.add(weight, torch.ones(2, 3))
        second.add(weight, torch.full((2, 3), 2.0))
        first.launch()
        second.launch()
        assigned = set()
        first.finish(assigned)
        second.finish(assigned)
        self.assertAllClose(
            weight.grad.to_local().numpy(), np.full((2, 3), 3.0)
        )

    def test_an_earlier_passs_gradient_is_accumulated(self):
        weight = replicated(self.mesh, (2, 3))
        weight.grad = self.layouts.like_parameter(torch.ones(2, 3), weight)
        bucket = self.bucket()
        bucket.add(weight, torch.ones(2, 3))
        bucket.launch()
        bucket.finish(set())
        self.assertAllClose(
            weight.grad.to_local().numpy(), np.full((2, 3), 2.0)
        )

    def test_abandon_waits_for_the_work(self):
        weight = replicated(self.mesh, 3)
        bucket = self.bucket()
        bucket.add(weight, torch.ones(3))
        bucket.launch()
        bucket.abandon()
        self.assertTrue(bucket.work.is_completed())
        self.assertIsNone(weight.grad)


class BucketsOfABackwardPassTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        self.mesh = reducer_test.one_process_mesh()
        self.shapes = [(8, 16), (16, 16), (16, 4)]
        reducer_test.pretend_mesh_dims_of_size_two(self)

    def test_one_bucket_holds_every_small_gradient(self):
        parameters = reducer_test.replicated_parameters(self.mesh, self.shapes)
        with reducer_test.counting_all_reduce() as all_reduce:
            reducer_test.mlp_loss(parameters, self.mesh).backward()
        self.assertEqual(all_reduce.call_count, 1)
        flat = all_reduce.call_args.args[0]
        self.assertEqual(flat.numel(), sum(np.prod(s) for s in self.shapes))
        # Gradients are views of the reduced bucket: no extra copies.
        for parameter in parameters:
            self.assertEqual(
                parameter.grad.to_local().untyped_storage().data_ptr(),
                flat.untyped_storage().data_ptr(),
            )
