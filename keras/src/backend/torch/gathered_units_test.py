"""Tests of `gathered_units` on a one-process mesh."""

import numpy as np
import torch
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import layers
from keras.src import models
from keras.src import testing
from keras.src.backend.torch import gathered_units
from keras.src.distribution import distribution_lib as distribution_api


class GatheredUnitsTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        self.mesh = distribution_api.DeviceMesh((1,), ("batch",), ["cpu:0"])
        distribution_api.set_distribution(
            distribution_api.DataParallel(device_mesh=self.mesh)
        )
        self.addCleanup(distribution_api.set_distribution, None)

    def sharded(self, shape, dim, seed):
        values = np.random.default_rng(seed).normal(size=shape)
        return distribute_tensor(
            torch.as_tensor(values.astype("float32")).requires_grad_(),
            self.mesh.backend_mesh,
            [Shard(dim)],
        )

    def test_unit_gathers_full_values_and_scatters_gradients(self):
        values = [self.sharded((4, 6), 1, 0), self.sharded((6, 2), 0, 1)]
        plan = gathered_units.unit_plan(values, (Partial(),))
        self.assertIsNotNone(plan)
        fulls = gathered_units.gather_unit(plan, None, values)
        for full, value in zip(fulls, values):
            self.assertNotIsInstance(full, type(value))
            self.assertAllClose(full.detach(), value.full_tensor().detach())
        (fulls[0].sum() * 2 + (fulls[1] * fulls[1]).sum()).backward()
        first, second = (value.grad for value in values)
        self.assertEqual(tuple(first.placements), (Shard(1),))
        self.assertEqual(tuple(second.placements), (Shard(0),))
        self.assertAllClose(first.to_local(), np.full((4, 6), 2.0))
        self.assertAllClose(
            second.to_local(), 2 * values[1].to_local().detach()
        )

    def test_an_unused_value_gets_a_zero_gradient(self):
        values = [self.sharded((4, 6), 0, 0), self.sharded((4,), 0, 1)]
        plan = gathered_units.unit_plan(values, (Partial(),))
        fulls = gathered_units.gather_unit(plan, None, values)
        fulls[0].sum().backward()
        self.assertAllClose(values[1].grad.to_local(), np.zeros((4,)))

    def test_plan_refuses_what_one_collective_cannot_gather(self):
        mesh = self.mesh.backend_mesh
        sharded = self.sharded((4, 6), 0, 0)
        replicated = distribute_tensor(torch.zeros(3), mesh, [Replicate()])
        plan = gathered_units.unit_plan
        # The batch must be split over exactly one axis.
        self.assertIsNone(plan([sharded], (Replicate(),)))
        # Every value sharded on it; one dtype.
        self.assertIsNone(plan([sharded, replicated], (Partial(),)))
        doubles = distribute_tensor(
            torch.zeros((4,), dtype=torch.float64), mesh, [Shard(0)]
        )
        self.assertIsNone(plan([sharded, doubles], (Partial(),)))

    def test_units_are_direct_sublayers_then_the_layer_itself(self):
        inner = models.Sequential(
            [layers.Dense(4, name="a"), layers.Dense(4, name="b")],
            name="block",
        )
        model = models.Sequential([inner, layers.Dense(2, name="head")])
        model.build((None, 3))
        kernels = [v for v in model.variables if "kernel" in v.path]
        ids = {id(kernel) for kernel in kernels}
        units = gathered_units.units_of(model, lambda v: id(v) in ids)
        block_unit = units[id(kernels[0])]
        self.assertEqual(
            [v.path for v in block_unit],
            [
                kernels[0].path,
                kernels[1].path,
            ],
        )
        self.assertIs(units[id(kernels[1])], block_unit)
        self.assertEqual(
            [v.path for v in units[id(kernels[2])]], [kernels[2].path]
        )
        self.assertEqual(len(units), 3)

    def test_a_layer_recomputed_whole_is_one_unit(self):
        block = models.Sequential(
            [layers.Dense(4, name="a"), layers.Dense(4, name="b")]
        )
        block.build((None, 3))
        kernels = [v for v in block.variables if "kernel" in v.path]
        ids = {id(kernel) for kernel in kernels}
        units = gathered_units.units_of(
            block, lambda v: id(v) in ids, whole=True
        )
        self.assertEqual(len(units), 2)
        self.assertIs(units[id(kernels[0])], units[id(kernels[1])])

    def test_join_small_units(self):
        join = gathered_units.join_small_units
        a, b, c, d = ("a",), ("b",), ("c",), ("d",)
        # Consecutive units of one key, up to the cap.
        self.assertEqual(
            join([("k", 4, a), ("k", 4, b), ("k", 4, c)], 8), [a + b, c]
        )
        # A unit with no key, or another key, joins nothing and starts
        # afresh.
        self.assertEqual(
            join([("k", 1, a), (None, 1, b), ("k", 1, c), ("j", 1, d)], 8),
            [a, b, c, d],
        )
        self.assertEqual(
            join([(None, 1, a), (None, 1, b)], 8),
            [a, b],
        )
        # A cap of 0 joins nothing; a unit above the cap stays whole.
        self.assertEqual(join([("k", 1, a), ("k", 1, b)], 0), [a, b])
        self.assertEqual(join([("k", 9, a), ("k", 1, b)], 8), [a, b])

    def test_functional_graph_is_cut_at_single_live_tensors(self):
        inputs = layers.Input((4,))
        x = layers.Dense(4, name="pre")(inputs)
        for i in range(2):
            y = layers.Dense(8, name=f"b{i}_up")(x)
            x = layers.Add(name=f"b{i}_add")(
                [x, layers.Dense(4, name=f"b{i}_down")(y)]
            )
        model = models.Model(inputs, layers.Dense(2, name="head")(x))
        segments = gathered_units.segments_of(model)
        self.assertEqual(
            [[op.name for op in segment] for segment in segments],
            [
                ["pre"],
                ["b0_up", "b0_down", "b0_add"],
                ["b1_up", "b1_down", "b1_add"],
                ["head"],
            ],
        )
        kernels = {v.path: v for v in model.variables if "kernel" in v.path}
        ids = {id(v) for v in kernels.values()}
        units = gathered_units.block_units(model, lambda v: id(v) in ids)
        self.assertEqual(
            [([v.path for v in group], kept) for group, kept in units],
            [
                (["pre/kernel", "head/kernel"], True),
                (["b0_up/kernel", "b0_down/kernel"], False),
                (["b1_up/kernel", "b1_down/kernel"], False),
            ],
        )

    def test_a_model_without_repeated_segments_has_no_blocks(self):
        model = models.Sequential(
            [layers.Dense(6), layers.Dense(5), layers.Dense(3)]
        )
        model.build((None, 4))
        self.assertIsNone(gathered_units.block_units(model, lambda v: True))

    def test_repeated_runs(self):
        runs = gathered_units.repeated_runs
        # An embedding, two blocks of two segments (attention, MLP), a
        # norm without variables and a head.
        signatures = list("eamamnh")
        weights = [1, 4, 2, 4, 2, 0, 1]
        self.assertEqual(runs(signatures, weights), [(1, 2, 2)])
        # Two runs of different blocks, found one after the other.
        self.assertEqual(runs(list("aabccc"), [1] * 6), [(0, 1, 2), (3, 1, 3)])
        # Repeated segments without weight are no blocks.
        self.assertEqual(runs(list("xxa"), [0, 0, 1]), [])
        # The run holding the most weight wins over a longer period's.
        self.assertEqual(runs(list("abab"), [1, 0, 1, 0]), [(0, 2, 2)])
