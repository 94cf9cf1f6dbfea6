"""Tests of `local_call_checks` (a layer's first call, checked)."""

from unittest import mock

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import layers
from keras.src import losses
from keras.src import models
from keras.src import testing
from keras.src.backend.common.remat import RematScope
from keras.src.backend.common.remat import get_current_remat_mode
from keras.src.backend.torch import batch_local_test
from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import local_call_checks
from keras.src.backend.torch import local_call_state
from keras.src.backend.torch import unit_gathering_test
from keras.src.distribution import distribution_lib as distribution_api
from keras.src.distribution import remat


class LocalCallChecksTest(batch_local_test.LocalCallTestCase):
    """A first call that draws, assigns, relays or communicates gives no
    plan: the layer runs on DTensors with that signature."""

    def test_random_draws_keep_dtensors(self):
        dropout = layers.Dropout(0.5, seed=3)
        self.call_in_step(dropout, self.batch((4, 5)), training=True)
        self.assertEqual(self.plans(dropout), [None])
        unseeded = layers.Dropout(0.5)
        self.call_in_step(unseeded, self.batch((4, 5)), training=True)
        self.assertEqual(self.plans(unseeded), [None])

    def test_assignments_keep_dtensors(self):
        model = models.Sequential([layers.Dense(5)])
        model.build((None, 5))
        counter = model.add_weight(shape=(), initializer="zeros")

        class Counting(layers.Layer):
            def call(self, x):
                counter.assign_add(1.0)
                return x

        counting = Counting()
        self.call_in_step(counting, self.batch((4, 5)))
        self.assertEqual(self.plans(counting), [None])

    def test_metric_updates_keep_dtensors(self):
        # On a batch axis of one process the update runs on the metric's
        # local tensors (`replicated_updates`); it is an assignment all
        # the same, which a local call could not make.
        from keras.src import metrics

        class Tracking(layers.Layer):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.mean = metrics.Mean(name="tracked_mean")

            def call(self, x):
                self.mean.update_state(x)
                return x

        tracking = Tracking()
        first, second = self.batch((4, 5), seed=1), self.batch((4, 5), seed=2)
        for x in (first, second):
            self.call_in_step(tracking, x)
        # Neither batch-local nor local to its shards with gradients.
        self.assertEqual(self.plans(tracking), [None, None])
        expected = np.mean(
            [first.full_tensor().numpy(), second.full_tensor().numpy()]
        )
        self.assertAllClose(float(tracking.mean.result()), expected)

    def test_dtensor_attributes_keep_dtensors(self):
        # An adapted `Normalization` holds its statistics as DTensors,
        # computed from its variables; so does a model holding it.
        values = np.random.default_rng(1).normal(size=(16, 5)) * 3 + 1
        normalization = layers.Normalization()
        normalization.adapt(values.astype("float32"))
        self.assertIsInstance(normalization.mean, DTensor)
        model = models.Sequential([normalization, layers.Dense(3)])
        model.build((None, 5))
        x = self.batch((4, 5))
        first = self.call_in_step(model, x)
        self.assertEqual(self.plans(normalization), [None])
        self.assertEqual(self.plans(model), [None])
        second = self.call_in_step(model, x)
        self.assertIsInstance(second, DTensor)
        self.assertAllClose(
            second.full_tensor().detach().numpy(),
            first.full_tensor().detach().numpy(),
        )

    def test_state_updates_keep_dtensors(self):
        norm = layers.BatchNormalization()
        norm.build((None, 5))
        self.call_in_step(norm, self.batch((4, 5)), training=True)
        self.assertEqual(self.plans(norm), [None])
        # In inference it computes each example alone.
        self.call_in_step(norm, self.batch((4, 5)), training=False)
        self.assertIsNotNone(self.plans(norm)[1])

    def test_added_losses_and_remat_keep_dtensors(self):
        regularized = layers.Dense(3, activity_regularizer="l2")
        regularized.build((None, 5))
        self.call_in_step(regularized, self.batch((4, 5)))
        self.assertEqual(self.plans(regularized), [None])
        # A sublayer recomputed, or a partial remat mode, keeps DTensors;
        # a layer recomputed whole may run locally (in its own checkpoint).
        model = models.Sequential([layers.Dense(3, activation="relu")])
        model.build((None, 5))
        remat_anywhere = local_call_checks.remat_anywhere
        self.assertFalse(remat_anywhere(model))
        model.layers[0]._remat_mode = remat.full_remat_mode()
        self.assertTrue(remat_anywhere(model))
        self.assertFalse(remat_anywhere(model.layers[0]))
        with RematScope(mode="activations"):
            model.layers[0]._remat_mode = get_current_remat_mode()
        self.assertTrue(remat_anywhere(model.layers[0]))

    def test_effects_are_not_counted_under_compile(self):
        state = local_call_state.step_state()
        before = state.effects
        local_call_checks.note_effect()
        self.assertEqual(state.effects, before + 1)
        with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
            local_call_checks.note_effect()
        self.assertEqual(state.effects, before + 1)

    def test_a_loss_has_no_sublayers(self):
        loss = losses.MeanSquaredError(name="mse_of_test")
        self.assertEqual(local_call_checks.sublayers(loss), ())


class UnshardedFirstCallTest(unit_gathering_test.ShardedKernelsTestCase):
    """A first call reads sharded variables unsharded, and must not
    assign them."""

    def test_assigning_an_unsharded_variable_in_a_call_raises(self):
        class Assigning(layers.Layer):
            def build(self, input_shape):
                self.kernel = self.add_weight(shape=(4, 3), name="kernel")

            def call(self, x):
                self.kernel.assign(self.kernel + 1.0)
                return x

        layer = self.sharded_layer(Assigning(name="assigning"), (None, 4))
        value = layer.kernel._value
        with self.assertRaisesRegex(RuntimeError, "assigning/kernel"):
            self.call_in_step(layer, self.batch((6, 4)))
        self.assertIs(layer.kernel._value, value)
        self.assertEqual(local_call_state.step_state().unsharded, {})


class OneProcessModelAxisTest(testing.TestCase):
    """Splits over mesh axes of one process leave local tensors whole."""

    def setUp(self):
        super().setUp()
        self.mesh = distribution_api.DeviceMesh(
            (1, 1), ("batch", "model"), ["cpu:0"]
        )
        distribution_api.set_distribution(
            distribution_api.ModelParallel(
                layout_map=distribution_api.LayoutMap(self.mesh),
                batch_dim_name="batch",
            )
        )
        self.addCleanup(distribution_api.set_distribution, None)

    def test_layout_that_moves_values_is_an_effect(self):
        backend_mesh = self.mesh.backend_mesh
        split = distribute_tensor(
            torch.zeros((4, 2)), backend_mesh, [Shard(0), Replicate()]
        )
        layout = dtensor_layouts.backend_layout(
            distribution_api.TensorLayout(("batch", "model"), self.mesh)
        )
        # Shard(1) over a "model" axis of one process: nothing moves.
        keeps = local_call_checks.keeps_local_values
        self.assertTrue(keeps(split, layout))
        with mock.patch.object(
            type(backend_mesh), "size", lambda self, mesh_dim=None: 2
        ):
            self.assertFalse(keeps(split, layout))

    def test_batch_layout_reads_one_process_axes_as_replicated(self):
        backend_mesh = self.mesh.backend_mesh
        placements = (Shard(0), Shard(1))
        self.assertEqual(
            local_call_checks.batch_layout(placements, backend_mesh),
            (Shard(0), Replicate()),
        )
