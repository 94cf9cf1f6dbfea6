"""Tests of `batch_local` on a one-process mesh."""

import contextlib
import os
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
from keras.src.backend.common.remat import RematScope
from keras.src.backend.common.remat import get_current_remat_mode
from keras.src.backend.torch import batch_local
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import gathered_units
from keras.src.backend.torch import gradient_buckets_test
from keras.src.distribution import distribution_lib as distribution_api
from keras.src.distribution import remat


class BatchLocalTest(testing.TestCase):
    """Layers proven local to each batch shard run on local tensors."""

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

    def verdicts(self, layer):
        return list(batch_local._VERDICTS.get(layer, {}).values())

    def test_dense_stack_runs_locally_after_its_first_call(self):
        model = models.Sequential(
            [layers.Dense(8, activation="relu"), layers.Dense(3)]
        )
        model.build((None, 5))
        x = self.batch((4, 5))
        watched = self.call_in_step(model, x)
        self.assertEqual(len(self.verdicts(model)), 1)
        self.assertIsNotNone(self.verdicts(model)[0])
        local = self.call_in_step(model, x)
        self.assertIsInstance(local, DTensor)
        self.assertEqual(tuple(local.placements), (Shard(0),))
        self.assertEqual(tuple(local.shape), (4, 3))
        self.assertAllClose(
            local.to_local().detach().numpy(),
            watched.to_local().detach().numpy(),
        )

    def test_local_gradients_are_partial_and_equal_dtensor_ones(self):
        dense = layers.Dense(3)
        dense.build((None, 5))
        x = self.batch((4, 5))
        gradients = []
        for _ in range(2):  # watched, then local
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

    def test_new_signature_is_watched_again(self):
        dense = layers.Dense(3)
        dense.build((None, 5))
        self.call_in_step(dense, self.batch((4, 5)))
        self.call_in_step(dense, self.batch((2, 5)))
        self.assertEqual(len(self.verdicts(dense)), 2)

    def test_random_draws_keep_dtensors(self):
        dropout = layers.Dropout(0.5, seed=3)
        self.call_in_step(dropout, self.batch((4, 5)), training=True)
        self.assertEqual(self.verdicts(dropout), [None])
        unseeded = layers.Dropout(0.5)
        self.call_in_step(unseeded, self.batch((4, 5)), training=True)
        self.assertEqual(self.verdicts(unseeded), [None])

    def test_training_mode_of_the_call_context_is_in_the_signature(self):
        dropout = layers.Dropout(0.5, seed=3)
        model = models.Sequential([layers.Dense(5), dropout])
        model.build((None, 5))
        x = self.batch((4, 5))
        self.call_in_step(model, x, training=False)
        self.call_in_step(model, x, training=True)
        # The sublayer inherits `training`: inference ran locally, training
        # drew random values.
        verdicts = self.verdicts(dropout)
        self.assertEqual(len(verdicts), 2)
        self.assertIsNotNone(verdicts[0])
        self.assertIsNone(verdicts[1])

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
        self.assertEqual(self.verdicts(counting), [None])

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
        self.assertEqual(self.verdicts(tracking), [None])
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
        self.assertEqual(self.verdicts(normalization), [None])
        self.assertEqual(self.verdicts(model), [None])
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
        self.assertEqual(self.verdicts(norm), [None])
        # In inference it computes each example alone.
        self.call_in_step(norm, self.batch((4, 5)), training=False)
        self.assertIsNotNone(self.verdicts(norm)[1])

    def test_added_losses_and_remat_keep_dtensors(self):
        regularized = layers.Dense(3, activity_regularizer="l2")
        regularized.build((None, 5))
        self.call_in_step(regularized, self.batch((4, 5)))
        self.assertEqual(self.verdicts(regularized), [None])
        # A sublayer recomputed, or a partial remat mode, keeps DTensors;
        # a layer recomputed whole may run locally (in its own checkpoint).
        model = models.Sequential([layers.Dense(3, activation="relu")])
        model.build((None, 5))
        self.assertFalse(batch_local._remat_anywhere(model))
        model.layers[0]._remat_mode = remat.full_remat_mode()
        self.assertTrue(batch_local._remat_anywhere(model))
        self.assertFalse(batch_local._remat_anywhere(model.layers[0]))
        with RematScope(mode="activations"):
            model.layers[0]._remat_mode = get_current_remat_mode()
        self.assertTrue(batch_local._remat_anywhere(model.layers[0]))

    def test_remat_marked_after_the_verdict_keeps_dtensors(self):
        model = models.Sequential([layers.Dense(8), layers.Dense(3)])
        model.build((None, 5))
        x = self.batch((4, 5))
        self.call_in_step(model, x)
        self.assertFalse(self.verdicts(model)[0].recomputes(model))
        # `remat_layers` marks layers once they have been called.
        model.layers[0]._remat_mode = remat.full_remat_mode()
        self.assertTrue(self.verdicts(model)[0].recomputes(model))
        with mock.patch.object(
            batch_local, "_call_locally", wraps=batch_local._call_locally
        ) as local:
            self.call_in_step(model, x)
        # The model keeps DTensors; its layers run locally, the recomputed
        # one in its own checkpoint.
        self.assertEqual(
            [call.args[0] for call in local.call_args_list],
            list(model.layers),
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
        for _ in range(2):  # watched, then local
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
        self.assertIsNotNone(self.verdicts(model)[0])
        self.assertAllClose(results[1][0], results[0][0])
        for local, watched in zip(results[1][1], results[0][1]):
            self.assertAllClose(local, watched)
        # Forward and the recomputation in backward, both times.
        self.assertEqual(results[0][2], 2)
        self.assertEqual(results[1][2], 2)

    def test_calls_under_saved_tensor_hooks_keep_dtensors(self):
        # Inside `torch.utils.checkpoint` (forward and recomputation) a
        # layer must take the same path in both passes.
        dense = layers.Dense(3)
        dense.build((None, 5))
        x = self.batch((4, 5))
        self.call_in_step(dense, x)
        self.assertIsNotNone(self.verdicts(dense)[0])
        with mock.patch.object(batch_local, "_call_locally") as local:
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
        self.assertEqual(self.verdicts(dense), [])

    def test_local_view_gradient_is_partial(self):
        dense = layers.Dense(3)
        dense.build((None, 5))
        value = dense.kernel.value
        placements = (Partial(),)
        scope = batch_local._LocalVariables(dense, placements)
        view = scope.get_current_value(dense.kernel)
        # One view per variable in a scope; the spec is kept on the value.
        self.assertIs(scope.get_current_value(dense.kernel), view)
        self.assertIn(
            placements,
            getattr(value, batch_local._GRADIENT_SPECS_ATTRIBUTE),
        )
        self.assertNotIsInstance(view, DTensor)
        (gradient,) = torch.autograd.grad(view.sum(), value)
        self.assertEqual(tuple(gradient.placements), placements)
        self.assertAllClose(gradient.to_local().numpy(), np.ones((5, 3)))

    def watched_dense(self):
        """A built `Dense(3)` and a batch, after the watched first call."""
        dense = layers.Dense(3)
        dense.build((None, 5))
        x = self.batch((4, 5))
        self.call_in_step(dense, x)
        return dense, x

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
        watched = self.call_in_step(layer, x)
        self.assertIsNotNone(self.verdicts(layer)[0])
        with mock.patch.object(
            batch_local._LocalView, "apply", wraps=batch_local._LocalView.apply
        ) as view:
            local = self.call_in_step(layer, x)
        self.assertEqual(view.call_count, 0)
        self.assertFalse(local.requires_grad)
        self.assertAllClose(
            local.to_local().numpy(), watched.to_local().numpy()
        )
        self.assertAllClose(local.to_local().numpy(), 3.0 * x.to_local())

    def test_views_are_kept_from_call_to_call(self):
        dense, x = self.watched_dense()
        (verdict,) = self.verdicts(dense)
        gradients, views, versions = [], [], []
        for _ in range(3):
            dense.kernel.value.grad = None
            out = self.call_in_step(dense, x)
            (out * out).sum().backward()
            gradients.append(dense.kernel.value.grad.full_tensor().clone())
            views.append(verdict.views[id(dense.kernel)][2])
            versions.append(views[-1]._version)
            # An optimizer's in-place update of the local tensor, which
            # the kept view shares.
            with torch.no_grad():
                dense.kernel.value._local_tensor.mul_(0.5)
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
        dense, x = self.watched_dense()
        (verdict,) = self.verdicts(dense)
        # Reduce over the one-process batch axis as if it were larger.
        gradient_buckets_test.pretend_mesh_dims_of_size_two(self)
        gradients, views = [], []
        for accumulating in (True, True, False, True):
            dense.kernel.value.grad = None
            step = (
                batch_local.accumulating_into_variables()
                if accumulating
                else contextlib.nullcontext()
            )
            with step:
                out = self.call_in_step(dense, x)
                (out * out).sum().backward()
            view = verdict.views[id(dense.kernel)][2]
            self.assertEqual(view.is_leaf, accumulating)
            if view.is_leaf:
                # Its gradient went to the kernel's bucket.
                self.assertIsNone(view.grad)
            gradient = dense.kernel.value.grad
            self.assertEqual(tuple(gradient.placements), (Replicate(),))
            gradients.append(gradient.full_tensor())
            views.append(view)
        # A leaf is kept from step to step; a step that does not
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

    def test_kept_views_are_dropped_when_not_good(self):
        dense, x = self.watched_dense()
        (verdict,) = self.verdicts(dense)
        self.call_in_step(dense, x)
        view = verdict.views[id(dense.kernel)][2]
        # Without gradients: a view made for that call, not kept.
        with torch.no_grad():
            scope = batch_local._LocalVariables(
                dense, verdict.gradient_placements, views=verdict.views
            )
            fresh = scope.get_current_value(dense.kernel)
        self.assertIsNot(fresh, view)
        self.assertIsNone(fresh.grad_fn)
        self.assertIs(verdict.views[id(dense.kernel)][2], view)
        # A new value: a new view, kept in place of the old one.
        dense.kernel._value = distribute_tensor(
            dense.kernel.value.full_tensor().detach().clone(),
            self.mesh.backend_mesh,
            [Replicate()],
        ).requires_grad_(True)
        self.call_in_step(dense, x)
        self.assertIsNot(verdict.views[id(dense.kernel)][2], view)
        # Under saved-tensor hooks (a checkpoint), nothing is kept.
        scope = batch_local._LocalVariables(
            dense, verdict.gradient_placements, views=None
        )
        self.assertIsNone(scope.views)

    def test_outputs_of_local_calls_give_back_their_local_tensors(self):
        dense, x = self.watched_dense()
        out = self.call_in_step(dense, x)
        computed = batch_local.local_tensor_of(out)
        self.assertNotIsInstance(computed, DTensor)
        self.assertIs(batch_local.local_tensor_of(out), computed)
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
        computed = getattr(out, batch_local._COMPUTED_LOCALLY_ATTRIBUTE)[0]
        changed = batch_local.local_tensor_of(out)
        self.assertIsNot(changed, computed)
        dense.kernel.value.grad = None
        changed.sum().backward()
        doubled = dense.kernel.value.grad.full_tensor().clone()
        dense.kernel.value.grad = None
        self.call_in_step(dense, x).to_local().sum().backward()
        np.testing.assert_array_equal(
            doubled.numpy(), 2.0 * dense.kernel.value.grad.full_tensor().numpy()
        )
        # Any other DTensor: `to_local()`.
        attribute = batch_local._COMPUTED_LOCALLY_ATTRIBUTE
        self.assertIsNone(getattr(x, attribute, None))
        np.testing.assert_array_equal(
            batch_local.local_tensor_of(x).numpy(), x.to_local().numpy()
        )

    def test_outputs_are_laid_out_and_differentiated_as_from_local(self):
        mesh = self.mesh.backend_mesh
        values = torch.arange(12.0).reshape(4, 3)
        reference = DTensor.from_local(values, mesh, [Shard(0)])
        spec = reference._spec
        for gradient_placement in (Shard(0), Replicate()):
            grads = []
            for make in (
                lambda local: batch_local._AsDTensor.apply(
                    local, spec, (Shard(0),)
                ),
                lambda local: DTensor.from_local(local, mesh, [Shard(0)]),
            ):
                local = values.clone().requires_grad_()
                out = make(local)
                self.assertIsInstance(out, DTensor)
                self.assertEqual(out.placements, (Shard(0),))
                self.assertEqual(out.shape, reference.shape)
                self.assertEqual(out.stride(), reference.stride())
                self.assertIsNot(out._spec, spec)
                # The output's gradient arrives with these placements.
                out.backward(
                    distribute_tensor(
                        torch.arange(12.0).reshape(4, 3) - 5.0,
                        mesh,
                        [gradient_placement],
                    )
                )
                grads.append(local.grad)
            self.assertNotIsInstance(grads[0], DTensor)
            np.testing.assert_array_equal(grads[0].numpy(), grads[1].numpy())
        # A partial output's gradient comes back replicated, as
        # `from_local`'s.
        local = torch.ones(3, requires_grad=True)
        partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
        out = batch_local._AsDTensor.apply(local, partial._spec, (Replicate(),))
        out.sum().backward()
        np.testing.assert_array_equal(local.grad.numpy(), np.ones(3))
        # Where backward builds a graph, the gradient stays differentiable.
        local = values.clone().requires_grad_()
        out = batch_local._AsDTensor.apply(local, spec, (Shard(0),))
        (grad,) = torch.autograd.grad(
            (out * out).sum(), local, create_graph=True
        )
        self.assertTrue(grad.requires_grad)
        np.testing.assert_array_equal(grad.detach().numpy(), 2 * values)

    @contextlib.contextmanager
    def counting_gathers(self):
        """Counts the gathers of sharded values, one by one or by unit."""
        alone = mock.patch.object(
            batch_local, "_gather", wraps=batch_local._gather
        )
        by_unit = mock.patch.object(
            gathered_units.UnitPlan,
            "start_gather",
            autospec=True,
            side_effect=gathered_units.UnitPlan.start_gather,
        )
        with alone as one, by_unit as unit:
            yield lambda: one.call_count + unit.call_count

    def shard_kernels(self):
        """Sets a distribution that shards kernels over the batch axis."""
        layout_map = distribution_api.LayoutMap(self.mesh)
        layout_map[".*kernel"] = ("batch", None)
        distribution_api.set_distribution(
            distribution_api.ModelParallel(layout_map=layout_map)
        )

    def sharded_layer(self, layer, input_shape):
        """Builds `layer` with its kernels sharded over the batch axis."""
        self.shard_kernels()
        layer.build(input_shape)
        for variable in layer.variables:
            if variable.path.endswith("kernel"):
                placements = tuple(variable.value.placements)
                self.assertEqual(placements, (Shard(0),))
        return layer

    def test_sharded_variables_are_read_gathered_and_run_locally(self):
        dense = self.sharded_layer(layers.Dense(3), (None, 4))
        value = dense.kernel._value
        x = self.batch((6, 4))
        outputs, gradients = [], []
        with self.counting_gathers() as gathers:
            for _ in range(2):  # watched, then local
                value.grad = None
                out = self.call_in_step(dense, x)
                (out * out).sum().backward()
                outputs.append(out.to_local().detach().numpy())
                gradients.append(value.grad)
        # One gather of the kernel per call; the kernel keeps its value.
        self.assertEqual(gathers(), 2)
        self.assertIs(dense.kernel._value, value)
        self.assertIsNotNone(self.verdicts(dense)[0])
        self.assertAllClose(outputs[1], outputs[0])
        for gradient in gradients:
            self.assertEqual(tuple(gradient.placements), (Shard(0),))
        self.assertAllClose(
            gradients[1].to_local().numpy(), gradients[0].to_local().numpy()
        )

    def watched_then_local(self, model, x):
        """Two training calls of `model` (watched, then local).

        Returns per call its output, the local parts of the gradients, and
        the gathers counted after forward and after backward.
        """
        outputs, gradients, gathers = [], [], []
        for _ in range(2):
            for variable in model.trainable_variables:
                variable.value.grad = None
            with self.counting_gathers() as gathered:
                out = self.call_in_step(model, x)
                gathers.append(gathered())
                (out * out).sum().backward()
                gathers.append(gathered())
            outputs.append(out.to_local().detach().numpy())
            gradients.append(
                [
                    None if v.value.grad is None else v.value.grad.to_local()
                    for v in model.trainable_variables
                ]
            )
        return outputs, gradients, gathers

    def assertSameCalls(self, outputs, gradients):
        """The local call's output and gradients equal the watched one's."""
        self.assertAllClose(outputs[1], outputs[0])
        for local, watched in zip(gradients[1], gradients[0]):
            if local is None or watched is None:
                self.assertIs(local, watched)
                continue
            self.assertAllClose(local.numpy(), watched.numpy())

    def test_backward_gathers_again_what_it_needs(self):
        # With units not joined, each Dense is a unit of its own.
        with mock.patch.dict(
            os.environ, {gathered_units.UNIT_CAP_ENV_VAR: "0"}
        ):
            model = models.Sequential([layers.Dense(6), layers.Dense(3)])
            model = self.sharded_layer(model, (None, 4))
            outputs, gradients, gathers = self.watched_then_local(
                model, self.batch((6, 4))
            )
        # Both calls gather both kernels in forward. Backward of the local
        # call, whose saved kernels were not kept, gathers again the second
        # one (the first is not needed: the input needs no gradient).
        self.assertEqual(gathers, [2, 2, 2, 3])
        self.assertSameCalls(outputs, gradients)

    def unit_paths(self, model):
        """Per unit of `model`'s sharded kernels, its variables' paths
        (a tuple) and whether it is kept."""
        kernels = [v for v in model.variables if v.path.endswith("kernel")]
        units = batch_local._units(
            model, [(k, k._value) for k in kernels], (Partial(),)
        )
        return {
            tuple(v.path for v in unit.variables): unit.kept
            for unit in units.values()
        }

    def test_blocks_of_a_flat_model_are_units_and_the_root_is_kept(self):
        # A functional model builds its layers as it is made.
        self.shard_kernels()
        inputs = layers.Input((4,))
        x = layers.Dense(4, name="pre")(inputs)
        for i in range(2):
            y = layers.Dense(8, activation="relu", name=f"b{i}_up")(x)
            x = layers.Add()([x, layers.Dense(4, name=f"b{i}_down")(y)])
        model = models.Model(inputs, layers.Dense(3, name="head")(x))
        model = self.sharded_layer(model, (None, 4))
        self.assertEqual(
            self.unit_paths(model),
            {
                ("pre/kernel", "head/kernel"): True,
                ("b0_up/kernel", "b0_down/kernel"): False,
                ("b1_up/kernel", "b1_down/kernel"): False,
            },
        )
        outputs, gradients, gathers = self.watched_then_local(
            model, self.batch((6, 4))
        )
        # The local call gathers its three units in forward; backward
        # gathers the two blocks again, not the kept root.
        self.assertEqual(gathers[2:], [3, 5])
        self.assertSameCalls(outputs, gradients)

    def test_blocks_with_a_shared_layer_and_two_inputs(self):
        # The graph is cut only where a single tensor is live: not
        # between the two inputs' branches. A layer shared by both blocks
        # belongs to the first block's unit.
        self.shard_kernels()
        first, second = layers.Input((4,)), layers.Input((4,))
        x = layers.Add()([layers.Dense(4, name="a")(first), second])
        shared = layers.Dense(4, name="shared")
        for i in range(2):
            y = layers.Dense(8, activation="relu", name=f"b{i}_up")(x)
            y = shared(layers.Dense(4, name=f"b{i}_down")(y))
            x = layers.Add()([x, y])
        model = models.Model([first, second], layers.Dense(3, name="h")(x))
        model = self.sharded_layer(model, [(None, 4), (None, 4)])
        self.assertEqual(
            self.unit_paths(model),
            {
                ("a/kernel", "h/kernel"): True,
                ("b0_up/kernel", "b0_down/kernel", "shared/kernel"): False,
                ("b1_up/kernel", "b1_down/kernel"): False,
            },
        )
        inputs = [self.batch((6, 4)), self.batch((6, 4), seed=1)]
        outputs, gradients, gathers = self.watched_then_local(model, inputs)
        self.assertSameCalls(outputs, gradients)

    def test_the_next_unit_is_gathered_ahead(self):
        events = []
        start = gathered_units.UnitPlan.start_gather
        finish = gathered_units.UnitPlan.finish_gather

        def noting_start(plan, shards):
            events.append(("start", tuple(shards[0].shape)))
            return start(plan, shards)

        def noting_finish(plan, started):
            events.append(("finish", tuple(plan.local_shapes[0])))
            return finish(plan, started)

        with mock.patch.dict(
            os.environ, {gathered_units.UNIT_CAP_ENV_VAR: "0"}
        ):
            model = models.Sequential(
                [layers.Dense(6), layers.Dense(5), layers.Dense(3)]
            )
            model = self.sharded_layer(model, (None, 4))
            self.call_in_step(model, self.batch((6, 4)))
            events.clear()
            with (
                mock.patch.object(
                    gathered_units.UnitPlan,
                    "start_gather",
                    autospec=True,
                    side_effect=noting_start,
                ),
                mock.patch.object(
                    gathered_units.UnitPlan,
                    "finish_gather",
                    autospec=True,
                    side_effect=noting_finish,
                ),
            ):
                self.call_in_step(model, self.batch((6, 4)))
        # Each unit's gather is issued once the previous unit's is done,
        # before that unit's values are used; each unit is gathered once.
        self.assertEqual(
            events,
            [
                ("start", (4, 6)),
                ("finish", (4, 6)),
                ("start", (6, 5)),
                ("finish", (6, 5)),
                ("start", (5, 3)),
                ("finish", (5, 3)),
            ],
        )

    def test_a_unit_gathered_ahead_but_not_read_is_waited_for(self):
        class FirstOnly(layers.Layer):
            """Holds two Dense sublayers and calls the first only."""

            def __init__(self):
                super().__init__(name="first_only")
                self.first = layers.Dense(4, name="first")
                self.second = layers.Dense(4, name="second")

            def build(self, input_shape):
                self.first.build(input_shape)
                self.second.build(input_shape)

            def call(self, x):
                return self.first(x)

        with mock.patch.dict(
            os.environ, {gathered_units.UNIT_CAP_ENV_VAR: "0"}
        ):
            layer = self.sharded_layer(FirstOnly(), (None, 4))
            with mock.patch.object(
                gathered_units.StartedGather,
                "wait",
                autospec=True,
                side_effect=gathered_units.StartedGather.wait,
            ) as wait:
                outputs, gradients, gathers = self.watched_then_local(
                    layer, self.batch((6, 4))
                )
        # The local call gathers the first unit and, ahead, the second,
        # which it never reads: that gather is waited for at the end.
        self.assertEqual(gathers[2], 2)
        self.assertEqual(wait.call_count, 1)
        self.assertSameCalls(outputs, gradients)

    def test_small_consecutive_units_are_joined(self):
        model = models.Sequential(
            [layers.Dense(6), layers.Dense(5), layers.Dense(3)]
        )
        model = self.sharded_layer(model, (None, 4))
        kernels = [layer.kernel for layer in model.layers]
        # The two first kernels' gathered bytes fit the cap; the third
        # starts a unit of its own.
        cap_mb = (4 * 6 + 6 * 5) * 4 / 2**20
        with mock.patch.dict(
            os.environ, {gathered_units.UNIT_CAP_ENV_VAR: str(cap_mb)}
        ):
            outputs, gradients, gathers = self.watched_then_local(
                model, self.batch((6, 4))
            )
            units = batch_local._units(
                model,
                [(kernel, kernel._value) for kernel in kernels],
                (Partial(),),
            )
        # The watched call gathers each kernel; the local call, two units
        # in forward, and both again in backward.
        self.assertEqual(gathers, [3, 3, 2, 4])
        self.assertSameCalls(outputs, gradients)
        self.assertIs(units[id(kernels[0])], units[id(kernels[1])])
        self.assertIsNot(units[id(kernels[1])], units[id(kernels[2])])
        self.assertEqual(units[id(kernels[2])].variables, (kernels[2],))

    def test_a_unit_is_gathered_once_whatever_its_read_order(self):
        class Reversed(layers.Layer):
            """Calls its second sublayer first."""

            def __init__(self):
                super().__init__(name="reversed")
                self.first = layers.Dense(4, name="first")
                self.second = layers.Dense(4, name="second")

            def call(self, x):
                return self.first(self.second(x))

        model = models.Sequential([Reversed()])
        model = self.sharded_layer(model, (None, 4))
        outputs, gradients, gathers = self.watched_then_local(
            model, self.batch((6, 4))
        )
        # The watched call gathers each kernel; the local call, both in one
        # collective, and again in backward (for the first layer's input
        # gradient).
        self.assertEqual(gathers, [2, 2, 1, 2])
        self.assertSameCalls(outputs, gradients)

    def test_assigning_a_gathered_variable_in_a_call_raises(self):
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

    def test_readable_locally(self):
        mesh = self.mesh.backend_mesh
        values = torch.zeros((4, 2))
        replicated = distribute_tensor(values, mesh, [Replicate()])
        sharded = distribute_tensor(values, mesh, [Shard(1)])
        readable = batch_local._readable_locally
        self.assertTrue(readable(replicated, (Shard(0),)))
        self.assertTrue(readable(replicated, (Replicate(),)))
        # Sharded over an axis that splits the batch, or whose gradient is
        # a partial sum over it.
        self.assertTrue(readable(sharded, (Shard(0),)))
        self.assertTrue(readable(sharded, (Partial(),)))
        self.assertFalse(readable(values, (Shard(0),)))
        # Split over an axis of one process: the local tensor is whole.
        self.assertTrue(readable(sharded, (Replicate(),)))
        # Over several processes, a split that does not follow the batch
        # leaves each process a part of the value.
        with mock.patch.object(
            type(mesh), "size", lambda self, mesh_dim=None: 2
        ):
            self.assertFalse(readable(sharded, (Replicate(),)))
            self.assertTrue(readable(sharded, (Shard(0),)))

    def test_calls_without_a_distribution_are_upstream(self):
        dense = layers.Dense(3)
        dense.build((None, 5))
        distribution_api.set_distribution(None)
        dense(self.batch((4, 5)))
        self.assertEqual(self.verdicts(dense), [])

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
        results, gradients, local_calls = [], [], []
        # Watched; per-sample values local; then the whole loss local
        # (`batch_reductions.call_loss`).
        for _ in range(3):
            logits.grad = None
            with mock.patch.object(
                batch_local, "_call_locally", wraps=batch_local._call_locally
            ) as local:
                value = self.call_in_step(loss, labels, logits)
            value.backward()
            results.append(value.full_tensor().item())
            gradients.append(logits.grad.full_tensor().numpy())
            local_calls.append([c.args[0] for c in local.call_args_list])
        (verdict,) = self.verdicts(loss)
        self.assertIsNotNone(verdict)
        self.assertEqual(verdict.sublayers, ())
        self.assertEqual(local_calls, [[], [loss], []])
        # Exactly the values and gradients of the DTensor call.
        self.assertEqual(results[0], results[1])
        self.assertEqual(results[0], results[2])
        np.testing.assert_array_equal(gradients[0], gradients[1])
        np.testing.assert_array_equal(gradients[0], gradients[2])

    def test_loss_errors_name_the_loss(self):
        loss = losses.MeanSquaredError(name="mse_of_test")
        self.assertEqual(
            batch_local._describe(loss),
            "MeanSquaredError 'mse_of_test'",
        )
        self.assertEqual(batch_local._sublayers(loss), ())


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
        for _ in range(2):  # watched, then local
            for variable in model.trainable_variables:
                variable.value.grad = None
            with created_tensors.replicate_created_tensors(self.mesh):
                out = model(x)
            (out * out).sum().backward()
            outputs.append(out)
            gradients.append([v.value.grad for v in model.trainable_variables])
        (verdict,) = batch_local._VERDICTS[model].values()
        # The row-parallel output's layout moved nothing on this mesh.
        self.assertIsNotNone(verdict)
        watched, local = outputs
        self.assertEqual(local.placements, watched.placements)
        self.assertIsNotNone(
            getattr(local, batch_local._COMPUTED_LOCALLY_ATTRIBUTE, None)
        )
        self.assertAllClose(
            local.full_tensor().detach().numpy(),
            watched.full_tensor().detach().numpy(),
        )
        for variable, first, second in zip(
            model.trainable_variables, *gradients
        ):
            self.assertEqual(second.placements, variable.value.placements)
            self.assertEqual(second.placements, first.placements)
            self.assertAllClose(
                second.full_tensor().numpy(), first.full_tensor().numpy()
            )

    def test_layout_that_moves_values_is_an_effect(self):
        backend_mesh = self.mesh.backend_mesh
        split = distribute_tensor(
            torch.zeros((4, 2)), backend_mesh, [Shard(0), Replicate()]
        )
        layout = dtensor_layouts.backend_layout(
            distribution_api.TensorLayout(("batch", "model"), self.mesh)
        )
        # Shard(1) over a "model" axis of one process: nothing moves.
        self.assertTrue(batch_local.keeps_local_values(split, layout))
        with mock.patch.object(
            type(backend_mesh), "size", lambda self, mesh_dim=None: 2
        ):
            self.assertFalse(batch_local.keeps_local_values(split, layout))
