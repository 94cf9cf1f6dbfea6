"""Tests of `training_local_calls` on a one-process mesh (the
multi-process case, split layers and the cuts of LoRA factors:
`integration_tests/keras_hub_workflow_test.py`)."""

import torch
from torch.distributed.tensor import DTensor

from keras.src import layers
from keras.src.backend.torch import gradient_comparisons
from keras.src.backend.torch import local_calls
from keras.src.backend.torch import training_local_calls
from keras.src.backend.torch.batch_local_test import LocalCallTestCase
from keras.src.backend.torch.inference_local_calls_test import call_on_path


class _ScaledGradient(torch.autograd.Function):
    """The identity, whose backward scales a DTensor gradient by 2 and a
    plain one by 3."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * (2.0 if isinstance(grad, DTensor) else 3.0)


class _GradientDependsOnDTensors(layers.Layer):
    """The same outputs on local tensors, another gradient."""

    def call(self, x):
        return _ScaledGradient.apply(x)


class _Counting(layers.Layer):
    """Counts its calls in a variable."""

    def build(self, input_shape):
        self.count = self.add_weight(
            shape=(), initializer="zeros", trainable=False
        )

    def call(self, x):
        self.count.assign(self.count + 1.0)
        return x * 2.0


class TrainingLocalCallsTest(LocalCallTestCase):
    def call(self, layer, x):
        """`layer(x)` through this path, in a step, with gradients; returns
        the output, the number of calls on DTensors and the gradients of
        `x` and of the layer's trainable variables (as full tensors) from
        a fixed cotangent."""
        x = x.detach().requires_grad_()
        for variable in layer.trainable_variables:
            variable.value.grad = None
        output, calls = call_on_path(training_local_calls, self.mesh, layer, x)
        cotangent = torch.linspace(-1.0, 1.0, output.numel()).reshape(
            output.shape
        )
        (output.full_tensor() * cotangent).sum().backward()
        grads = [x.grad.full_tensor()] + [
            v.value.grad.full_tensor() for v in layer.trainable_variables
        ]
        return output, calls, grads

    def test_a_call_reproduced_with_its_gradients_runs_locally(self):
        dense = layers.Dense(3)
        dense.build((None, 5))
        x = self.batch((4, 5))
        first, first_calls, first_grads = self.call(dense, x)
        second, second_calls, second_grads = self.call(dense, x)
        self.assertEqual((first_calls, second_calls), (1, 0))
        self.assertTrue(training_local_calls.runs_locally(dense))
        self.assertIsInstance(second, DTensor)
        self.assertTrue(local_calls.computed_locally(second))
        self.assertEqual(second.placements, first.placements)
        self.assertTrue(torch.equal(second.full_tensor(), first.full_tensor()))
        self.assertEqual(len(second_grads), 3)
        for mine, theirs in zip(second_grads, first_grads):
            self.assertTrue(torch.equal(mine, theirs))

    def test_a_gradient_computed_otherwise_locally_keeps_dtensors(self):
        layer = _GradientDependsOnDTensors()
        x = self.batch((4, 5))
        self.call(layer, x)
        _, second_calls, (grad,) = self.call(layer, x)
        self.assertEqual(second_calls, 1)
        self.assertFalse(training_local_calls.runs_locally(layer))
        cotangent = torch.linspace(-1.0, 1.0, 20).reshape(4, 5)
        self.assertTrue(torch.equal(grad, 2.0 * cotangent))

    def test_an_assigning_call_keeps_dtensors(self):
        layer = _Counting()
        layer.build((None, 5))
        x = self.batch((4, 5))
        self.call(layer, x)
        _, second_calls, _ = self.call(layer, x)
        self.assertEqual(second_calls, 1)
        self.assertFalse(training_local_calls.runs_locally(layer))
        # The check's runs assigned nothing: one count per real call.
        self.assertEqual(float(layer.count.value.full_tensor()), 2.0)

    def test_applies_only_with_gradients(self):
        x = self.batch((4, 5))
        mesh = x.device_mesh
        self.assertTrue(training_local_calls.applies([x], mesh))
        self.assertFalse(training_local_calls.applies([], mesh))
        with torch.no_grad():
            self.assertFalse(training_local_calls.applies([x], mesh))


class SameTest(LocalCallTestCase):
    """`same`: bit for bit, or up to rounding in float32 and float64."""

    def test_rounding_is_allowed_in_float32_only(self):
        same = gradient_comparisons.same
        their = torch.linspace(-1.0, 1.0, 64)
        close = their + 1e-7 * torch.sign(their)
        wrong = their * 1.001
        self.assertTrue(same(their.clone(), their))
        self.assertTrue(same(close, their))
        self.assertFalse(same(wrong, their))
        self.assertFalse(same(their[:32], their))
        low = their.to(torch.bfloat16)
        self.assertTrue(same(low.clone(), low))
        self.assertFalse(same(low * 1.01, low))
