"""Tests of reduced gradients laid out as their parameters."""

import copy
import gc

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import testing
from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import parameter_gradients
from keras.src.backend.torch import reducer_test
from keras.src.backend.torch import torch_internals


class ParameterCacheTest(testing.TestCase):
    def test_values_are_kept_by_identity_and_dropped_with_the_parameter(self):
        cache = parameter_gradients.ParameterCache()
        first = torch.nn.Parameter(torch.zeros(3))
        second = torch.nn.Parameter(torch.zeros(3))
        attributes = set(vars(first))
        cache.set(first, "first")
        cache.set(second, "second")
        # Equal values, distinct parameters.
        self.assertEqual(cache.get(first), "first")
        self.assertEqual(cache.get(second), "second")
        self.assertEqual(set(vars(first)), attributes)
        cache.set(first, "again")
        self.assertEqual(cache.get(first), "again")
        self.assertLen(cache, 2)
        del first
        gc.collect()
        self.assertLen(cache, 1)
        self.assertEqual(cache.get(second), "second")

    def test_an_entry_naming_another_object_is_not_read(self):
        cache = parameter_gradients.ParameterCache()
        parameter = torch.nn.Parameter(torch.zeros(3))
        other = torch.nn.Parameter(torch.zeros(3))
        cache.set(parameter, "kept")
        # As if `other` had reused the id of a parameter gone.
        cache._entries[id(other)] = cache._entries[id(parameter)]
        self.assertIsNone(cache.get(other))


class GradientLayoutsTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        self.mesh = reducer_test.one_process_mesh()

    def test_gradients_copy_the_parameters_spec(self):
        layouts = parameter_gradients.GradientLayouts()
        (parameter,) = reducer_test.replicated_parameters(self.mesh, [(8, 4)])
        attributes = set(vars(parameter))
        grads = [
            layouts.like_parameter(torch.ones(8, 4), parameter)
            for _ in range(2)
        ]
        self.assertEqual(set(vars(parameter)), attributes)
        for grad in grads:
            self.assertIs(type(grad), DTensor)
            self.assertEqual(
                torch_internals.spec_of(grad),
                torch_internals.spec_of(parameter),
            )
            self.assertIsNot(
                torch_internals.spec_of(grad),
                torch_internals.spec_of(parameter),
            )
        self.assertIsNot(
            torch_internals.spec_of(grads[0]), torch_internals.spec_of(grads[1])
        )

    def test_a_non_contiguous_parameters_gradient_is_contiguous(self):
        layouts = parameter_gradients.GradientLayouts()
        value = distribute_tensor(
            torch.zeros(4, 8).t(), self.mesh, [Replicate()]
        )
        parameter = torch.nn.Parameter(value)
        self.assertEqual(parameter.stride(), (1, 8))
        grad = layouts.like_parameter(torch.ones(8, 4), parameter)
        self.assertEqual(grad.stride(), (4, 1))
        self.assertEqual(grad.placements, parameter.placements)

    def test_contiguous_strides_are_kept_per_shape(self):
        layouts = parameter_gradients.GradientLayouts()
        shape = torch.Size((2, 3, 4))
        strides = layouts.contiguous_strides(shape)
        self.assertEqual(tuple(strides), (12, 4, 1))
        self.assertIs(
            layouts.contiguous_strides(torch.Size((2, 3, 4))), strides
        )

    def test_an_earlier_gradient_is_accumulated_and_a_partial_replaced(self):
        layouts = parameter_gradients.GradientLayouts()
        (parameter,) = reducer_test.replicated_parameters(self.mesh, [(4,)])
        local = torch.ones(4)
        self.assertIs(parameter_gradients.accumulated(parameter, local), local)
        parameter.grad = layouts.like_parameter(
            torch.full((4,), 2.0), parameter
        )
        self.assertAllClose(
            parameter_gradients.accumulated(parameter, local).numpy(),
            np.full(4, 3.0),
        )

    def test_sharded_gradient_does_not_keep_the_full_buffer(self):
        parameter = torch.nn.Parameter(
            distribute_tensor(torch.zeros(8, 4), self.mesh, [Shard(0)])
        )
        # The local gradient is a slice of a buffer twice its size.
        buffer = torch.arange(64, dtype=torch.float32).reshape(16, 4)
        grad = DTensor.from_local(
            buffer[:8], self.mesh, [Replicate()], run_check=False
        )
        lean = parameter_gradients.redistribute_gradient(grad, parameter)
        local = lean.to_local()
        self.assertEqual(
            local.untyped_storage().nbytes(),
            local.numel() * local.element_size(),
        )
        self.assertAllClose(lean.full_tensor().numpy(), buffer[:8].numpy())


class DTensorFromSpecTest(testing.TestCase):
    def test_same_dtensor_as_the_constructor(self):
        mesh = reducer_test.one_process_mesh()
        (parameter,) = reducer_test.replicated_parameters(mesh, [(8, 4)])
        local = torch.arange(32, dtype=torch.float32).reshape(8, 4)
        made = dtensor_layouts.dtensor_from_spec(
            local, copy.copy(torch_internals.spec_of(parameter))
        )
        constructed = DTensor(
            local,
            copy.copy(torch_internals.spec_of(parameter)),
            requires_grad=False,
        )
        for dtensor in (made, constructed):
            self.assertIs(type(dtensor), DTensor)
            self.assertIs(torch_internals.local_tensor(dtensor), local)
            self.assertFalse(dtensor.requires_grad)
            self.assertIsNone(dtensor.grad_fn)
        # A spec copy is `copy.copy`'s.
        spec = torch_internals.spec_of(parameter)
        copied = dtensor_layouts.copy_spec(spec)
        self.assertIsNot(copied, spec)
        self.assertEqual(vars(copied), vars(copy.copy(spec)))
        self.assertEqual(hash(copied), hash(spec))
        # Whatever `DTensor.__init__` sets, the helper must set too.
        self.assertEqual(set(vars(made)), set(vars(constructed)))
        self.assertEqual(
            torch_internals.spec_of(made), torch_internals.spec_of(constructed)
        )
        self.assertEqual(made.shape, constructed.shape)
        self.assertEqual(made.stride(), constructed.stride())
        self.assertAllClose((made * 2).full_tensor().numpy(), 2 * local.numpy())
