"""Tests of `batch_local` (which path a layer call takes) on a one-process
mesh; `LocalCallTestCase` serves the tests of the local-call modules."""

from unittest import mock

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import layers
from keras.src import losses
from keras.src import models
from keras.src import testing
from keras.src.backend.torch import batch_local
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import local_calls
from keras.src.distribution import distribution_lib as distribution_api
from keras.src.distribution import remat


class LocalCallTestCase(testing.TestCase):
    """A DataParallel distribution on a one-process "batch" mesh."""

    def setUp(self):
        super().setUp()
        self.mesh = distribution_api.DeviceMesh((1,), ("batch",), ["cpu:0"])
        distribution_api.set_distribution(
            distribution_api.DataParallel(device_mesh=self.mesh)
        )
        self.addCleanup(distribution_api.set_distribution, None)

    def batch(self, shape, seed=0):
        values = np.random.default_rng(seed).normal(size=shape)
        return distribute_tensor(
            torch.as_tensor(values.astype("float32")),
            self.mesh.backend_mesh,
            [Shard(0)],
        )

    def call_in_step(self, layer, *args, **kwargs):
        with created_tensors.replicate_created_tensors(self.mesh):
            return layer(*args, **kwargs)

    def plans(self, layer):
        """The layer's plans so far, in signature order (None: DTensors)."""
        return list(batch_local.plans_of(layer).values())

    def first_called_dense(self):
        """A built `Dense(3)` and a batch, after the checked first call."""
        dense = layers.Dense(3)
        dense.build((None, 5))
        x = self.batch((4, 5))
        self.call_in_step(dense, x)
        return dense, x


class BatchLocalTest(LocalCallTestCase):
    """The first call per signature is checked; the next ones run locally
    where it proved that exact."""

    def test_dense_stack_runs_locally_after_its_first_call(self):
        model = models.Sequential(
            [layers.Dense(8, activation="relu"), layers.Dense(3)]
        )
        model.build((None, 5))
        x = self.batch((4, 5))
        first = self.call_in_step(model, x)
        self.assertEqual(len(self.plans(model)), 1)
        self.assertIsNotNone(self.plans(model)[0])
        local = self.call_in_step(model, x)
        self.assertIsInstance(local, DTensor)
        self.assertEqual(tuple(local.placements), (Shard(0),))
        self.assertEqual(tuple(local.shape), (4, 3))
        self.assertAllClose(
            local.to_local().detach().numpy(),
            first.to_local().detach().numpy(),
        )

    def test_new_signature_is_checked_again(self):
        dense = layers.Dense(3)
        dense.build((None, 5))
        self.call_in_step(dense, self.batch((4, 5)))
        self.call_in_step(dense, self.batch((2, 5)))
        self.assertEqual(len(self.plans(dense)), 2)

    def test_training_mode_of_the_call_context_is_in_the_signature(self):
        dropout = layers.Dropout(0.5, seed=3)
        model = models.Sequential([layers.Dense(5), dropout])
        model.build((None, 5))
        x = self.batch((4, 5))
        self.call_in_step(model, x, training=False)
        self.call_in_step(model, x, training=True)
        # The sublayer inherits `training`: inference ran locally, training
        # drew random values.
        plans = self.plans(dropout)
        self.assertEqual(len(plans), 2)
        self.assertIsNotNone(plans[0])
        self.assertIsNone(plans[1])

    def test_remat_marked_after_the_first_call_keeps_dtensors(self):
        model = models.Sequential([layers.Dense(8), layers.Dense(3)])
        model.build((None, 5))
        x = self.batch((4, 5))
        self.call_in_step(model, x)
        self.assertFalse(self.plans(model)[0].recomputes(model))
        # `remat_layers` marks layers once they have been called.
        model.layers[0]._remat_mode = remat.full_remat_mode()
        self.assertTrue(self.plans(model)[0].recomputes(model))
        with mock.patch.object(
            local_calls, "call_locally", wraps=local_calls.call_locally
        ) as local:
            self.call_in_step(model, x)
        # The model keeps DTensors; its layers run locally, the recomputed
        # one in its own checkpoint.
        self.assertEqual(
            [call.args[0] for call in local.call_args_list],
            list(model.layers),
        )

    def test_calls_under_saved_tensor_hooks_keep_dtensors(self):
        # Inside `torch.utils.checkpoint` (forward and recomputation) a
        # layer must take the same path in both passes.
        dense, x = self.first_called_dense()
        self.assertIsNotNone(self.plans(dense)[0])
        with mock.patch.object(local_calls, "call_locally") as local:
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t: t, lambda t: t
            ):
                self.call_in_step(dense, x)
            local.assert_not_called()
            self.call_in_step(dense, x)
            local.assert_called_once()

    def test_switched_off_every_call_keeps_dtensors(self):
        dense = layers.Dense(3)
        dense.build((None, 5))
        x = self.batch((4, 5))
        with mock.patch.object(batch_local, "ENABLED", False):
            for _ in range(2):
                self.call_in_step(dense, x)
        self.assertEqual(self.plans(dense), [])

    def test_calls_without_a_distribution_are_upstream(self):
        dense = layers.Dense(3)
        dense.build((None, 5))
        distribution_api.set_distribution(None)
        dense(self.batch((4, 5)))
        self.assertEqual(self.plans(dense), [])

    def test_signatures_refuse_what_values_cannot_tell(self):
        for arguments in ((torch.ones(2),), (np.ones(2),), (object(),)):
            with self.assertRaises(batch_local._NotLocal):
                batch_local._signature(arguments, [])
        leaves = []
        signature = batch_local._signature(
            ((self.batch((4, 5)),), {"training": True}), leaves
        )
        self.assertEqual(len(leaves), 1)
        self.assertNotEqual(
            signature,
            batch_local._signature(
                ((self.batch((4, 5)),), {"training": 1}), []
            ),
        )

    def test_built_in_loss_values_run_locally(self):
        loss = losses.CategoricalCrossentropy(from_logits=True)
        logits = self.batch((6, 4))
        logits.requires_grad_(True)
        labels = self.batch((6, 4), seed=1).softmax(-1).detach()
        results, gradients, local_calls_made = [], [], []
        # Checked; per-sample values local; then the whole loss local
        # (`batch_reductions.call_loss`).
        for _ in range(3):
            logits.grad = None
            with mock.patch.object(
                local_calls, "call_locally", wraps=local_calls.call_locally
            ) as local:
                value = self.call_in_step(loss, labels, logits)
            value.backward()
            results.append(value.full_tensor().item())
            gradients.append(logits.grad.full_tensor().numpy())
            local_calls_made.append([c.args[0] for c in local.call_args_list])
        (plan,) = self.plans(loss)
        self.assertIsNotNone(plan)
        self.assertEqual(plan.sublayers, ())
        self.assertEqual(local_calls_made, [[], [loss], []])
        # Exactly the values and gradients of the DTensor call.
        self.assertEqual(results[0], results[1])
        self.assertEqual(results[0], results[2])
        np.testing.assert_array_equal(gradients[0], gradients[1])
        np.testing.assert_array_equal(gradients[0], gradients[2])


class PartialSumsReducedTest(LocalCallTestCase):
    """A layer's DTensor outputs hold no pending partial sums."""

    def test_partial_outputs_are_reduced_and_others_kept(self):
        mesh = self.mesh.backend_mesh
        local = torch.arange(6.0).reshape(2, 3)
        partial = DTensor.from_local(local, mesh, [Partial()])
        sharded = self.batch((4, 3))
        outputs = batch_local.partial_sums_reduced(
            {"partial": partial, "sharded": sharded, "number": 3}
        )
        self.assertEqual(tuple(outputs["partial"].placements), (Replicate(),))
        self.assertAllClose(outputs["partial"].to_local(), local)
        self.assertIs(outputs["sharded"], sharded)
        self.assertEqual(outputs["number"], 3)
        self.assertIs(batch_local.partial_sums_reduced(sharded), sharded)

    def test_a_layer_returning_partial_sums_returns_them_reduced(self):
        mesh = self.mesh.backend_mesh

        class PartialSum(layers.Layer):
            def call(self, x):
                return DTensor.from_local(x.to_local(), mesh, [Partial()])

        output = self.call_in_step(PartialSum(), self.batch((4, 3)))
        self.assertEqual(tuple(output.placements), (Replicate(),))


class InputSpecTest(testing.TestCase):
    """A local call's inputs are local shards: their input specs were
    checked on the global shapes at the first call
    (`edit_layer_call_runs_batch_local`)."""

    def test_a_local_call_skips_input_specs(self):
        from keras.src.backend.torch import local_call_state
        from keras.src.layers.input_spec import InputSpec

        class _LastAxisOfFive(layers.Layer):
            def __init__(self):
                super().__init__()
                self.input_spec = InputSpec(axes={-1: 5})

            def call(self, x):
                return x

        layer = _LastAxisOfFive()
        shard = torch.ones(4, 2)
        with self.assertRaisesRegex(ValueError, "expected axis -1"):
            layer(shard)
        state = local_call_state.step_state()
        state.local_calls += 1
        try:
            self.assertIs(layer(shard), shard)
        finally:
            state.local_calls -= 1
