"""Single-process tests of `gather_bucket`.

Which gradients a bucket gathers is decided from specs alone, tested on
stand-in meshes of any size. The bucket itself runs on a one-process
mesh, where the gather leaves each local gradient whole; the gathers
across processes are checked by `integration_tests/collectives_test.py`
(their count) and `keras_hub_workflow_test.py` (LoRA training equal to
one process).
"""

import types

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import testing
from keras.src.backend.torch import gather_bucket
from keras.src.backend.torch import parameter_gradients
from keras.src.backend.torch.reducer_test import one_process_mesh
from keras.src.backend.torch.torch_internals import StridedShard


def spec(sizes, placements, shape=(8, 4)):
    """A stand-in spec: what `gathered_dim` reads of a `DTensorSpec`."""
    mesh = types.SimpleNamespace(size=lambda axis: sizes[axis])
    return types.SimpleNamespace(
        mesh=mesh,
        placements=tuple(placements),
        tensor_meta=types.SimpleNamespace(shape=torch.Size(shape)),
    )


class GatheredDimTest(testing.TestCase):
    def test_gathered_and_declined_gradients(self):
        R, P = Replicate(), Partial()
        cases = [
            # One axis to gather: (mesh axis, tensor dim).
            ((1, 2), (R, Shard(0)), (R, R), (1, 0)),
            ((2,), (Shard(1),), (R,), (0, 1)),
            # A partial sum over one process is whole already.
            ((1, 2), (P, Shard(1)), (R, R), (1, 1)),
            # The other axes keep the parameter's placements.
            ((2, 2), (Shard(0), Shard(1)), (Shard(0), R), (1, 1)),
            # Declined: DTensor redistributes these.
            ((2, 2), (P, Shard(0)), (R, R), None),
            ((2, 2), (Shard(0), Shard(1)), (R, R), None),
            ((1, 2), (R, Shard(0)), (R, Shard(1)), None),
            ((3,), (Shard(0),), (R,), None),
            ((2,), (StridedShard(0, split_factor=2),), (R,), None),
            ((2,), (P,), (R,), None),
        ]
        for sizes, grad, parameter, expected in cases:
            self.assertEqual(
                gather_bucket.gathered_dim(
                    spec(sizes, grad), spec(sizes, parameter)
                ),
                expected,
                msg=(sizes, grad, parameter),
            )


class GatherBucketTest(testing.TestCase):
    def parameter(self, mesh, shape):
        value = distribute_tensor(torch.zeros(shape), mesh, [Replicate()])
        return torch.nn.Parameter(value)

    def test_gradients_are_handed_back_whole_and_summed(self):
        mesh = one_process_mesh()
        layouts = parameter_gradients.GradientLayouts()
        first, second = (self.parameter(mesh, s) for s in ((4, 3), (2, 5)))
        a, b, c = torch.randn(4, 3), torch.randn(4, 3), torch.randn(2, 5)
        bucket = gather_bucket.GatherBucket(mesh, 0, layouts)
        bucket.add(first, a, 0)
        bucket.add(second, c, 1)
        # A second gradient of one parameter in one pass is summed.
        bucket.add(first, b, 0)
        bucket.launch()
        assigned = set()
        bucket.finish(assigned)
        self.assertEqual(assigned, {id(first), id(second)})
        for parameter, expected in ((first, a + b), (second, c)):
            self.assertIsInstance(parameter.grad, DTensor)
            self.assertEqual(parameter.grad.placements, (Replicate(),))
            self.assertAllClose(parameter.grad.to_local(), expected)
        # Buffers are dropped once handed back.
        self.assertIsNone(bucket.flat)

    def test_a_parameter_given_a_gradient_already_adds_to_it(self):
        mesh = one_process_mesh()
        layouts = parameter_gradients.GradientLayouts()
        parameter = self.parameter(mesh, (4, 3))
        earlier = torch.ones(4, 3)
        parameter.grad = layouts.like_parameter(earlier.clone(), parameter)
        bucket = gather_bucket.GatherBucket(mesh, 0, layouts)
        gradient = torch.randn(4, 3)
        bucket.add(parameter, gradient, 0)
        bucket.launch()
        bucket.finish({id(parameter)})
        self.assertAllClose(parameter.grad.to_local(), earlier + gradient)
