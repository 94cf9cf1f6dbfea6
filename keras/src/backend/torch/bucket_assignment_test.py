"""Tests of which bucket a gradient joins."""

import gc
from unittest import mock

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Partial

from keras.src import testing
from keras.src.backend.torch import bucket_assignment
from keras.src.backend.torch import distribution_lib
from keras.src.backend.torch import reducer
from keras.src.backend.torch import reducer_test
from keras.src.backend.torch import torch_internals
from keras.src.distribution import distribution_lib as distribution_api


class BucketAssignmentTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        self.mesh = reducer_test.one_process_mesh()
        reducer_test.pretend_mesh_dims_of_size_two(self)

    def test_partial_sum_reduction_plans(self):
        partial = (Partial(),)
        self.assertEqual(
            bucket_assignment.partial_sum_reduction(
                self.mesh, partial, (Replicate(),)
            ),
            ((0,), "sum"),
        )
        # A reduce-scatter to a sharded parameter is left to DTensor.
        self.assertIsNone(
            bucket_assignment.partial_sum_reduction(
                self.mesh, partial, (Shard(0),)
            )
        )

    def test_axes_of_one_process_need_no_reduction(self):
        with mock.patch.object(
            bucket_assignment, "mesh_dim_size", lambda mesh, dim: 1
        ):
            self.assertEqual(
                bucket_assignment.partial_sum_reduction(
                    self.mesh, (Partial(),), (Replicate(),)
                ),
                ((), None),
            )

    def test_reductions_are_kept_by_mesh_shape_and_placements(self):
        assignment = bucket_assignment.BucketAssignment()
        partial, replicated = (Partial(),), (Replicate(),)
        with mock.patch.object(
            bucket_assignment,
            "partial_sum_reduction",
            wraps=bucket_assignment.partial_sum_reduction,
        ) as planned:
            first = assignment.reduction(self.mesh, partial, replicated)
            again = assignment.reduction(self.mesh, partial, replicated)
        self.assertIs(again, first)
        self.assertEqual(planned.call_count, 1)

    def test_local_plans_are_kept_outside_the_parameter(self):
        assignment = bucket_assignment.BucketAssignment()
        (parameter,) = reducer_test.replicated_parameters(self.mesh, [(4,)])
        placements = (Partial(),)
        attributes = set(vars(parameter))
        kept = assignment.local_plan(
            parameter, placements, torch_internals.local_tensor(parameter)
        )
        self.assertEqual(set(vars(parameter)), attributes)
        spec, kept_placements, reduction, key = kept
        self.assertIs(spec, torch_internals.spec_of(parameter))
        self.assertIs(kept_placements, placements)
        self.assertEqual(reduction, ((0,), "sum"))
        self.assertEqual(
            key,
            bucket_assignment.bucket_key(self.mesh, reduction, parameter.dtype),
        )
        self.assertIs(
            assignment.local_plan(
                parameter, placements, torch_internals.local_tensor(parameter)
            ),
            kept,
        )
        # Planned again for other placements, and dropped with the
        # parameter.
        other = assignment.local_plan(
            parameter, (Partial(),), torch_internals.local_tensor(parameter)
        )
        self.assertIsNot(other, kept)
        del parameter
        gc.collect()
        self.assertEqual(len(assignment._local_plans), 0)

    def test_gradient_plans(self):
        assignment = reducer.context().assignment
        (parameter,) = reducer_test.replicated_parameters(self.mesh, [(4,)])
        replicated = distribute_tensor(torch.zeros(4), self.mesh, [Replicate()])
        self.assertIsNone(assignment.gradient_plan(parameter, replicated))
        partial = type(replicated).from_local(
            torch.zeros(4), self.mesh, [Partial()], run_check=False
        )
        reduction, key = assignment.gradient_plan(parameter, partial)
        self.assertEqual(reduction, ((0,), "sum"))
        self.assertIs(key[0], self.mesh)
        self.assertEqual(key[1], (id(self.mesh), reduction, torch.float32))


class TwoDimensionalMeshTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        mesh = distribution_api.DeviceMesh(
            (1, 1), ("batch", "model"), ["cpu:0"]
        )
        self.mesh = distribution_lib._to_backend_mesh(mesh)
        reducer_test.pretend_mesh_dims_of_size_two(self)

    def test_placements_sharing_a_reduction_share_a_bucket(self):
        # Column-, bias- and row-sharded parameters on "model": their
        # gradients differ in placement on "model" and are all partial
        # sums over "batch", so one all-reduce over "batch" serves them.
        generator = torch.Generator().manual_seed(0)
        values = [
            torch.randn(shape, generator=generator)
            for shape in [(8, 16), (16,), (16, 4)]
        ]
        placements = [
            [Replicate(), Shard(1)],
            [Replicate(), Shard(0)],
            [Replicate(), Shard(0)],
        ]
        parameters = []
        for value, placement in zip(values, placements):
            parameter = torch.nn.Parameter(
                distribute_tensor(value, self.mesh, placement)
            )
            parameter.register_post_accumulate_grad_hook(
                reducer.reduce_gradient_when_ready
            )
            parameters.append(parameter)
        x = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 48.0
        inputs = distribute_tensor(x, self.mesh, [Shard(0), Replicate()])
        with reducer_test.counting_all_reduce() as all_reduce:
            kernel_up, bias_up, kernel_down = parameters
            hidden = torch.tanh(inputs @ kernel_up + bias_up)
            ((hidden @ kernel_down) ** 2).sum().backward()
        self.assertEqual(all_reduce.call_count, 1)

        reference = [torch.nn.Parameter(v.clone()) for v in values]
        hidden = torch.tanh(x @ reference[0] + reference[1])
        ((hidden @ reference[2]) ** 2).sum().backward()
        for parameter, placement, expected in zip(
            parameters, placements, reference
        ):
            self.assertEqual(list(parameter.grad.placements), placement)
            self.assertAllClose(
                parameter.grad.full_tensor().numpy(),
                expected.grad.numpy(),
                atol=1e-5,
            )

    def test_partial_sums_of_two_reduce_ops_need_more_than_a_bucket(self):
        self.assertEqual(
            bucket_assignment.partial_sum_reduction(
                self.mesh, (Partial(), Partial()), (Replicate(), Replicate())
            ),
            ((0, 1), "sum"),
        )
        self.assertIsNone(
            bucket_assignment.partial_sum_reduction(
                self.mesh,
                (Partial(), Partial("max")),
                (Replicate(), Replicate()),
            )
        )
