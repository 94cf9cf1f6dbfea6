"""Tests of `local_variables` (the variables of a local call) on a
one-process mesh."""

import contextlib
from unittest import mock

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import distribute_tensor

from keras.src import layers
from keras.src import losses
from keras.src.backend.torch import batch_local_test
from keras.src.backend.torch import local_call_state
from keras.src.backend.torch import local_variables
from keras.src.backend.torch import local_views
from keras.src.backend.torch import reducer_test
from keras.src.backend.torch import torch_internals


class LocalVariablesTest(batch_local_test.LocalCallTestCase):
    def test_local_view_gradient_is_partial(self):
        dense = layers.Dense(3)
        dense.build((None, 5))
        value = dense.kernel.value
        placements = (Partial(),)
        scope = local_variables.LocalVariableScope(dense, placements)
        view = scope.get_current_value(dense.kernel)
        # One view per variable in a scope; the spec is cached per value.
        self.assertIs(scope.get_current_value(dense.kernel), view)
        specs = local_call_state.caches().gradient_specs[value]
        self.assertIn(placements, specs)
        self.assertNotIsInstance(view, DTensor)
        (gradient,) = torch.autograd.grad(view.sum(), value)
        self.assertEqual(tuple(gradient.placements), placements)
        self.assertAllClose(gradient.to_local().numpy(), np.ones((5, 3)))

    def test_non_trainable_variables_are_read_without_an_autograd_node(self):
        class Scaled(layers.Layer):
            def build(self, input_shape):
                self.scale = self.add_weight(
                    shape=(input_shape[-1],),
                    initializer="ones",
                    trainable=False,
                )

            def call(self, x):
                return x * (self.scale * 3.0)

        layer = Scaled()
        layer.build((None, 5))
        x = self.batch((4, 5))
        first = self.call_in_step(layer, x)
        self.assertIsNotNone(self.plans(layer)[0])
        with mock.patch.object(
            local_views.LocalView, "apply", wraps=local_views.LocalView.apply
        ) as view:
            local = self.call_in_step(layer, x)
        self.assertEqual(view.call_count, 0)
        self.assertFalse(local.requires_grad)
        self.assertAllClose(local.to_local().numpy(), first.to_local().numpy())
        self.assertAllClose(local.to_local().numpy(), 3.0 * x.to_local())

    def test_views_are_cached_from_call_to_call(self):
        dense, x = self.first_called_dense()
        (plan,) = self.plans(dense)
        gradients, views, versions = [], [], []
        for _ in range(3):
            dense.kernel.value.grad = None
            out = self.call_in_step(dense, x)
            (out * out).sum().backward()
            gradients.append(dense.kernel.value.grad.full_tensor().clone())
            views.append(plan.views[id(dense.kernel)].view)
            versions.append(views[-1]._version)
            # An optimizer's in-place update of the local tensor, which
            # the cached view shares.
            with torch.no_grad():
                torch_internals.local_tensor(dense.kernel.value).mul_(0.5)
        # One view, read again after each in-place update.
        self.assertIs(views[1], views[0])
        self.assertIs(views[2], views[0])
        self.assertEqual(versions, [versions[0] + i for i in range(3)])
        # The gradients of the DTensor call at the halved kernels.
        expected = []
        for halvings in range(3):
            kernel = dense.kernel.value.full_tensor() * 2.0 ** (3 - halvings)
            kernel = kernel.detach().requires_grad_(True)
            plain = x.full_tensor() @ kernel + dense.bias.value.full_tensor()
            (plain * plain).sum().backward()
            expected.append(kernel.grad)
        for gradient, want in zip(gradients, expected):
            self.assertAllClose(gradient.numpy(), want.numpy())

    def test_steps_that_accumulate_read_gradient_leaves(self):
        dense, x = self.first_called_dense()
        (plan,) = self.plans(dense)
        # Reduce over the one-process batch axis as if it were larger.
        reducer_test.pretend_mesh_dims_of_size_two(self)
        gradients, views = [], []
        for accumulating in (True, True, False, True):
            dense.kernel.value.grad = None
            step = (
                local_call_state.accumulating_into_variables()
                if accumulating
                else contextlib.nullcontext()
            )
            with step:
                out = self.call_in_step(dense, x)
                (out * out).sum().backward()
            view = plan.views[id(dense.kernel)].view
            self.assertEqual(view.is_leaf, accumulating)
            if view.is_leaf:
                # Its gradient went to the kernel's bucket.
                self.assertIsNone(view.grad)
            gradient = dense.kernel.value.grad
            self.assertEqual(tuple(gradient.placements), (Replicate(),))
            gradients.append(gradient.full_tensor())
            views.append(view)
        # A leaf is cached from step to step; a step that does not
        # accumulate reads a view that leads back to the value, and the
        # next accumulating step a new leaf.
        self.assertIs(views[1], views[0])
        self.assertIsNot(views[3], views[0])
        for gradient in gradients[1:]:
            self.assertAllClose(gradient.numpy(), gradients[0].numpy())
        kernel = dense.kernel.value.full_tensor().detach().requires_grad_()
        plain = x.full_tensor() @ kernel + dense.bias.value.full_tensor()
        (plain * plain).sum().backward()
        self.assertAllClose(gradients[0].numpy(), kernel.grad.numpy())

    def test_cached_views_are_dropped_when_not_good(self):
        dense, x = self.first_called_dense()
        (plan,) = self.plans(dense)
        self.call_in_step(dense, x)
        view = plan.views[id(dense.kernel)].view
        # Without gradients: a view made for that call, not cached.
        with torch.no_grad():
            scope = local_variables.LocalVariableScope(
                dense, plan.gradient_placements, views=plan.views
            )
            fresh = scope.get_current_value(dense.kernel)
        self.assertIsNot(fresh, view)
        self.assertIsNone(fresh.grad_fn)
        self.assertIs(plan.views[id(dense.kernel)].view, view)
        # A new value: a new view, cached in place of the old one.
        dense.kernel._value = distribute_tensor(
            dense.kernel.value.full_tensor().detach().clone(),
            self.mesh.backend_mesh,
            [Replicate()],
        ).requires_grad_(True)
        self.call_in_step(dense, x)
        self.assertIsNot(plan.views[id(dense.kernel)].view, view)
        # Under saved-tensor hooks (a checkpoint), nothing is cached.
        scope = local_variables.LocalVariableScope(
            dense, plan.gradient_placements, views=None
        )
        self.assertIsNone(scope.views)

    def test_assignments_in_a_local_call_raise(self):
        dense = layers.Dense(3)
        dense.build((None, 5))
        scope = local_variables.LocalVariableScope(dense, (Partial(),))
        with self.assertRaisesRegex(RuntimeError, "dense.*/kernel"):
            with scope:
                dense.kernel.assign(torch.ones((5, 3)))

    def test_errors_name_the_layer_or_the_loss(self):
        loss = losses.MeanSquaredError(name="mse_of_test")
        self.assertEqual(
            local_variables.describe(loss),
            "MeanSquaredError 'mse_of_test'",
        )
        dense = layers.Dense(3, name="named_dense")
        dense.build((None, 5))
        self.assertEqual(local_variables.describe(dense), "Layer 'named_dense'")
