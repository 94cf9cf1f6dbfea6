"""Tests of `local_calls` (a layer run on local shards) on one-process
meshes."""

import weakref

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import layers
from keras.src import models
from keras.src import testing
from keras.src.backend.torch import batch_local
from keras.src.backend.torch import batch_local_test
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import local_call_state
from keras.src.backend.torch import local_calls
from keras.src.distribution import distribution_lib as distribution_api
from keras.src.distribution import remat


def computed_of(value):
    """What the local call that returned `value` noted for it, or None."""
    return local_call_state.caches().computed.get(value)


class LocalCallsTest(batch_local_test.LocalCallTestCase):
    def test_local_gradients_are_partial_and_equal_dtensor_ones(self):
        dense = layers.Dense(3)
        dense.build((None, 5))
        x = self.batch((4, 5))
        gradients = []
        for _ in range(2):  # checked first, then local
            dense.kernel.value.grad = None
            out = self.call_in_step(dense, x)
            (out * out).sum().backward()
            gradients.append(dense.kernel.value.grad)
        # The local view's gradient is Partial; the gradient buckets have
        # reduced it into the variable's layout, as the DTensor one.
        self.assertEqual(gradients[1].placements, gradients[0].placements)
        self.assertAllClose(
            gradients[1].full_tensor().numpy(),
            gradients[0].full_tensor().numpy(),
        )

    def test_layer_recomputed_whole_runs_locally_and_recomputes(self):
        model = models.Sequential(
            [layers.Dense(8, activation="relu"), layers.Dense(3)]
        )
        model.build((None, 5))
        model._remat_mode = remat.full_remat_mode()
        x = self.batch((4, 5))
        calls = []
        upstream_call = model.call

        def counted_call(*args, **kwargs):
            calls.append(torch.is_grad_enabled())
            return upstream_call(*args, **kwargs)

        model.call = counted_call
        results = []
        for _ in range(2):  # checked first, then local
            for variable in model.trainable_variables:
                variable.value.grad = None
            calls.clear()
            out = self.call_in_step(model, x)
            (out * out).sum().backward()
            results.append(
                (
                    out.full_tensor().detach().numpy(),
                    [
                        v.value.grad.full_tensor().numpy()
                        for v in model.trainable_variables
                    ],
                    len(calls),
                )
            )
        self.assertIsNotNone(self.plans(model)[0])
        self.assertAllClose(results[1][0], results[0][0])
        for local, first in zip(results[1][1], results[0][1]):
            self.assertAllClose(local, first)
        # Forward and the recomputation in backward, both times.
        self.assertEqual(results[0][2], 2)
        self.assertEqual(results[1][2], 2)

    def test_outputs_of_local_calls_give_back_their_local_tensors(self):
        dense, x = self.first_called_dense()
        out = self.call_in_step(dense, x)
        self.assertTrue(local_calls.computed_locally(out))
        computed = local_calls.local_tensor_of(out)
        self.assertNotIsInstance(computed, DTensor)
        self.assertIs(local_calls.local_tensor_of(out), computed)
        # Its gradient reaches the kernel as through `to_local`.
        dense.kernel.value.grad = None
        (computed * computed).sum().backward()
        direct = dense.kernel.value.grad.full_tensor().clone()
        out = self.call_in_step(dense, x)
        dense.kernel.value.grad = None
        through = out.to_local()
        (through * through).sum().backward()
        np.testing.assert_array_equal(
            direct.numpy(), dense.kernel.value.grad.full_tensor().numpy()
        )
        # Changed in place since: its own local tensor, whose gradient
        # goes through the change.
        out = self.call_in_step(dense, x)
        out.mul_(2.0)
        self.assertFalse(local_calls.computed_locally(out))
        changed = local_calls.local_tensor_of(out)
        self.assertIsNot(changed, computed_of(out)[0])
        dense.kernel.value.grad = None
        changed.sum().backward()
        doubled = dense.kernel.value.grad.full_tensor().clone()
        dense.kernel.value.grad = None
        self.call_in_step(dense, x).to_local().sum().backward()
        np.testing.assert_array_equal(
            doubled.numpy(), 2.0 * dense.kernel.value.grad.full_tensor().numpy()
        )
        # Any other DTensor: `to_local()`.
        self.assertIsNone(computed_of(x))
        np.testing.assert_array_equal(
            local_calls.local_tensor_of(x).numpy(), x.to_local().numpy()
        )

    def test_the_computed_tensor_goes_with_its_output(self):
        dense, x = self.first_called_dense()
        out = self.call_in_step(dense, x)
        local = weakref.ref(computed_of(out)[0])
        self.assertIsNotNone(local())
        # The entry, and the local tensor it holds, go with the output.
        del out
        self.assertIsNone(local())

    def test_local_calls_are_counted_while_they_run(self):
        seen = []

        class Probe(layers.Layer):
            def call(self, x):
                seen.append(local_call_state.running_locally())
                return x * 2.0

        probe = Probe()
        x = self.batch((4, 5))
        self.call_in_step(probe, x)
        self.call_in_step(probe, x)
        self.assertEqual(seen, [False, True])
        self.assertFalse(local_call_state.running_locally())


class OneProcessModelAxisTest(testing.TestCase):
    """Splits over mesh axes of one process leave local tensors whole."""

    def setUp(self):
        super().setUp()
        self.mesh = distribution_api.DeviceMesh(
            (1, 1), ("batch", "model"), ["cpu:0"]
        )
        layout_map = distribution_api.LayoutMap(self.mesh)
        layout_map[".*up/kernel"] = (None, "model")
        layout_map[".*up/bias"] = ("model",)
        layout_map[".*down/kernel"] = ("model", None)
        layout_map[".*down/output"] = ("batch", None)
        distribution_api.set_distribution(
            distribution_api.ModelParallel(
                layout_map=layout_map, batch_dim_name="batch"
            )
        )
        self.addCleanup(distribution_api.set_distribution, None)

    def test_megatron_block_runs_locally_with_dtensor_results(self):
        model = models.Sequential(
            [
                layers.Dense(8, activation="relu", name="up"),
                layers.Dense(3, name="down"),
            ]
        )
        model.build((None, 5))
        kernel = model.layers[0].kernel
        self.assertEqual(
            tuple(kernel.value.placements), (Replicate(), Shard(1))
        )
        values = np.random.default_rng(0).normal(size=(4, 5))
        x = distribute_tensor(
            torch.as_tensor(values.astype("float32")),
            self.mesh.backend_mesh,
            [Shard(0), Replicate()],
        )
        outputs, gradients = [], []
        for _ in range(2):  # checked first, then local
            for variable in model.trainable_variables:
                variable.value.grad = None
            with created_tensors.replicate_created_tensors(self.mesh):
                out = model(x)
            (out * out).sum().backward()
            outputs.append(out)
            gradients.append([v.value.grad for v in model.trainable_variables])
        (plan,) = batch_local.plans_of(model).values()
        # The row-parallel output's layout moved nothing on this mesh.
        self.assertIsNotNone(plan)
        first, local = outputs
        self.assertEqual(local.placements, first.placements)
        self.assertIsNotNone(computed_of(local))
        self.assertAllClose(
            local.full_tensor().detach().numpy(),
            first.full_tensor().detach().numpy(),
        )
        for variable, first, second in zip(
            model.trainable_variables, *gradients
        ):
            self.assertEqual(second.placements, variable.value.placements)
            self.assertEqual(second.placements, first.placements)
            self.assertAllClose(
                second.full_tensor().numpy(), first.full_tensor().numpy()
            )
