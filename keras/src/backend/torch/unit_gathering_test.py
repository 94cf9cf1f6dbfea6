"""Tests of `unit_gathering` (sharded variables of local calls, unsharded
unit by unit) on a one-process mesh."""

import contextlib
import os
from unittest import mock

import torch
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import layers
from keras.src import models
from keras.src import testing
from keras.src.backend.torch import batch_local_test
from keras.src.backend.torch import gathered_units
from keras.src.backend.torch import unit_gathering
from keras.src.distribution import distribution_lib as distribution_api


class ShardedKernelsTestCase(batch_local_test.LocalCallTestCase):
    """Layers whose kernels are sharded over the batch axis."""

    @contextlib.contextmanager
    def counting_gathers(self):
        """Counts the gathers of sharded values, one by one or by unit."""
        alone = mock.patch.object(
            unit_gathering, "unshard", wraps=unit_gathering.unshard
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

    def first_then_local(self, model, x):
        """Two training calls of `model` (checked first, then local).

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
        """The local call's output and gradients equal the first call's."""
        self.assertAllClose(outputs[1], outputs[0])
        for local, first in zip(gradients[1], gradients[0]):
            if local is None or first is None:
                self.assertIs(local, first)
                continue
            self.assertAllClose(local.numpy(), first.numpy())


class UnitGatheringTest(ShardedKernelsTestCase):
    def test_sharded_variables_are_read_unsharded_and_run_locally(self):
        dense = self.sharded_layer(layers.Dense(3), (None, 4))
        value = dense.kernel._value
        x = self.batch((6, 4))
        outputs, gradients = [], []
        with self.counting_gathers() as gathers:
            for _ in range(2):  # checked first, then local
                value.grad = None
                out = self.call_in_step(dense, x)
                (out * out).sum().backward()
                outputs.append(out.to_local().detach().numpy())
                gradients.append(value.grad)
        # One gather of the kernel per call; the kernel keeps its value.
        self.assertEqual(gathers(), 2)
        self.assertIs(dense.kernel._value, value)
        self.assertIsNotNone(self.plans(dense)[0])
        self.assertAllClose(outputs[1], outputs[0])
        for gradient in gradients:
            self.assertEqual(tuple(gradient.placements), (Shard(0),))
        self.assertAllClose(
            gradients[1].to_local().numpy(), gradients[0].to_local().numpy()
        )

    def unit_paths(self, model):
        """Per unit of `model`'s sharded kernels, its variables' paths
        (a tuple) and whether it is kept."""
        kernels = [v for v in model.variables if v.path.endswith("kernel")]
        units = unit_gathering.local_call_units(
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
        outputs, gradients, gathers = self.first_then_local(
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
        outputs, gradients, gathers = self.first_then_local(model, inputs)
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
                outputs, gradients, gathers = self.first_then_local(
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
            outputs, gradients, gathers = self.first_then_local(
                model, self.batch((6, 4))
            )
            units = unit_gathering.local_call_units(
                model,
                [(kernel, kernel._value) for kernel in kernels],
                (Partial(),),
            )
        # The first call gathers each kernel; the local call, two units
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
        outputs, gradients, gathers = self.first_then_local(
            model, self.batch((6, 4))
        )
        # The first call gathers each kernel; the local call, both in one
        # collective, and again in backward (for the first layer's input
        # gradient).
        self.assertEqual(gathers, [2, 2, 1, 2])
        self.assertSameCalls(outputs, gradients)

    def test_readable_locally(self):
        mesh = self.mesh.backend_mesh
        values = torch.zeros((4, 2))
        replicated = distribute_tensor(values, mesh, [Replicate()])
        sharded = distribute_tensor(values, mesh, [Shard(1)])
        readable = unit_gathering.readable_locally
        self.assertTrue(readable(replicated, (Shard(0),)))
        self.assertTrue(readable(replicated, (Replicate(),)))
        # Sharded over an axis that splits the batch, or whose gradient is
        # a partial sum over it.
        self.assertTrue(readable(sharded, (Shard(0),)))
        self.assertTrue(readable(sharded, (Partial(),)))
        self.assertFalse(readable(values, (Shard(0),)))
        # Split over an axis of one process: the local tensor is whole.
        self.assertTrue(readable(sharded, (Replicate(),)))
        self.assertFalse(unit_gathering.is_sharded(sharded, (Replicate(),)))
        self.assertTrue(unit_gathering.is_sharded(sharded, (Partial(),)))
        # Over several processes, a split that does not follow the batch
        # leaves each process a part of the value.
        with mock.patch.object(
            type(mesh), "size", lambda self, mesh_dim=None: 2
        ):
            self.assertFalse(readable(sharded, (Replicate(),)))
            self.assertTrue(readable(sharded, (Shard(0),)))


class GatheredOverBatchAxesTest(testing.TestCase):
    """The placements a variable split over the batch axes and a model
    axis is read with in a call on DTensors."""

    def test_batch_axes_gathered_model_axes_kept(self):
        class Value:
            placements = (Shard(1), Shard(0))
            device_mesh = "mesh"

            def redistribute(self, mesh, placements):
                return mesh, placements

        batch = (Shard(0), Replicate())
        self.assertEqual(
            unit_gathering.gathered_over_batch_axes(Value(), batch),
            ("mesh", (Replicate(), Shard(0))),
        )
        # Gradient placements (partial over the batch axes) read alike.
        gradient = (Partial(), Replicate())
        self.assertEqual(
            unit_gathering.gathered_over_batch_axes(Value(), gradient)[1],
            (Replicate(), Shard(0)),
        )
