"""Tests of the sharding rules added where a torch release has none, and
of the stack and transpose wrappers.

Values are checked on one-device meshes, where a `Shard` placement keeps
its meaning for DTensor's sharding propagation; multi-process values are
checked by `benchmark_smoke_test.py` and the torch matrix
(`scripts/torch_matrix.sh`).
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import testing
from keras.src.backend.torch import sharding_rules
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import StridedShard
from keras.src.backend.torch.torch_internals import TensorMeta
from keras.src.distribution import distribution_lib as distribution_api


def pooled(function):
    """`function` of a `(batch, channels, *spatial)` tensor, summed with
    position weights so that its gradient differs at each position."""

    def loss(x):
        y = function(x)
        weights = torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)
        if isinstance(y, DTensor):
            weights = distribute_tensor(weights, y.device_mesh, y.placements)
        return (y * weights).sum()

    return loss


# Ops DTensor lacks rules for, by name: a loss of a `(batch, channels,
# *spatial)` input that runs the op forward and its backward.
SPATIAL_OPS = {
    "avg_pool2d": ((2, 3, 6, 6), pooled(lambda x: F.avg_pool2d(x, 2))),
    "avg_pool3d": ((2, 3, 4, 4, 4), pooled(lambda x: F.avg_pool3d(x, 2))),
    "max_pool3d": ((2, 3, 4, 4, 4), pooled(lambda x: F.max_pool3d(x, 2))),
    "adaptive_avg_pool3d": (
        (2, 3, 4, 4, 4),
        pooled(lambda x: F.adaptive_avg_pool3d(x, 2)),
    ),
    "adaptive_max_pool2d": (
        (2, 3, 6, 6),
        pooled(lambda x: F.adaptive_max_pool2d(x, 3)),
    ),
    "max_pool2d": ((2, 3, 6, 6), pooled(lambda x: F.max_pool2d(x, 2))),
    "adaptive_avg_pool2d": (
        (2, 3, 6, 6),
        pooled(lambda x: F.adaptive_avg_pool2d(x, 3)),
    ),
    "replicate_pad1d": (
        (2, 3, 5),
        pooled(lambda x: F.pad(x, (1, 2), mode="replicate")),
    ),
    "replicate_pad2d": (
        (2, 3, 5, 5),
        pooled(lambda x: F.pad(x, (0, 1, 0, 1), mode="replicate")),
    ),
    "replicate_pad3d": (
        (2, 3, 3, 3, 3),
        pooled(lambda x: F.pad(x, (1,) * 6, mode="replicate")),
    ),
    "reflect_pad2d": (
        (2, 3, 5, 5),
        pooled(lambda x: F.pad(x, (2, 1, 1, 2), mode="reflect")),
    ),
    "reflect_pad3d": (
        (2, 3, 3, 3, 3),
        pooled(lambda x: F.pad(x, (1,) * 6, mode="reflect")),
    ),
}


def head_sharded(value, mesh, placements):
    """`value` as a DTensor that requires grad, laid out as `placements`."""
    tensor = torch.from_numpy(value).requires_grad_(True)
    return distribute_tensor(tensor, mesh, placements)


class MissingRulesTest(testing.TestCase):
    """Padding and pooling gradients keep the batch or the channels split;
    `fill_` with a tensor value keeps any split."""

    def setUp(self):
        super().setUp()
        sharding_rules.register()
        self.mesh = distribution_api.DeviceMesh(
            (1,), ("batch",), ["cpu:0"]
        ).backend_mesh

    def check_spatial_op(self, name, placement):
        shape, loss = SPATIAL_OPS[name]
        value = np.random.default_rng(0).standard_normal(shape)
        plain = torch.tensor(value, dtype=torch.float32, requires_grad=True)
        expected = loss(plain)
        expected.backward()
        x = head_sharded(value.astype("float32"), self.mesh, [placement])
        got = loss(x)
        got.backward()
        self.assertAllClose(got.full_tensor().item(), expected.item())
        self.assertEqual(x.grad.placements, (placement,))
        self.assertAllClose(x.grad.full_tensor().numpy(), plain.grad.numpy())

    def test_spatial_ops_split_by_batch_channels_or_replicated(self):
        for name in SPATIAL_OPS:
            for placement in (Shard(0), Shard(1), Replicate()):
                with self.subTest(op=name, placement=placement):
                    self.check_spatial_op(name, placement)

    def test_fill_with_a_tensor_keeps_the_split(self):
        for placement in (Shard(0), Shard(1), Replicate()):
            x = distribute_tensor(torch.zeros(4, 3), self.mesh, [placement])
            value = distribute_tensor(
                torch.tensor(2.5), self.mesh, [Replicate()]
            )
            x.fill_(value)
            self.assertEqual(x.placements, (placement,))
            self.assertAllClose(x.full_tensor().numpy(), np.full((4, 3), 2.5))

    def test_squeeze_of_several_dimensions_keeps_the_split(self):
        value = np.arange(24.0, dtype="float32").reshape(4, 1, 6, 1)
        for placement, expected in (
            (Shard(0), Shard(0)),
            (Shard(2), Shard(1)),
            (Replicate(), Replicate()),
        ):
            x = distribute_tensor(
                torch.from_numpy(value), self.mesh, [placement]
            )
            got = torch.squeeze(x, (1, 3))
            self.assertEqual(got.placements, (expected,))
            self.assertAllClose(got.full_tensor().numpy(), value.reshape(4, 6))

    def test_squeeze_rule_renumbers_the_kept_dimensions(self):
        """The rule itself (torch 2.13 has its own; 2.11 takes this one):
        only dimensions of size 1 go, and a split follows its dimension."""
        spec = self.spec((4, 1, 6, 3))
        strategies = sharding_rules._squeeze_dims_sharding(spec, [1, -1])
        self.assertEqual(
            [(out[0], inputs[0]) for out, inputs in strategies],
            [
                (Replicate(), Replicate()),
                (Shard(0), Shard(0)),
                (Shard(1), Shard(2)),
                (Shard(2), Shard(3)),
            ],
        )

    def test_complex_keeps_the_split(self):
        real = np.arange(12.0, dtype="float32").reshape(4, 3)
        for placement in (Shard(0), Shard(1), Replicate()):
            parts = [
                distribute_tensor(torch.from_numpy(v), self.mesh, [placement])
                for v in (real, -real)
            ]
            got = torch.complex(*parts)
            self.assertEqual(got.placements, (placement,))
            self.assertAllClose(got.full_tensor().numpy(), real - 1j * real)
        rule = sharding_rules._complex_sharding(
            self.spec((4, 3)), self.spec((4, 3))
        )
        self.assertIn(([Shard(1)], [Shard(1), Shard(1)]), rule)

    def spec(self, shape):
        strides = torch.empty(shape).stride()
        meta = TensorMeta(torch.Size(shape), strides, torch.float32)
        return DTensorSpec(self.mesh, (Replicate(),), meta)

    def test_rules_torch_has_are_kept(self):
        """Each fallback op has a rule after `register`: this module's
        exactly where torch had none (`_ADDED_RULES`), torch's elsewhere.
        Torch 2.13 has its own for every pooling op, 2.11 for none."""
        propagator = DTensor._op_dispatcher.sharding_propagator
        for op in sharding_rules._fallback_rules():
            rule = propagator.op_strategy_funcs.get(op)
            added = getattr(rule, "args", (None,))[0]
            if op in sharding_rules._ADDED_RULES:
                self.assertIs(added, sharding_rules._ADDED_RULES[op], op)
            else:
                self.assertTrue(torch_internals.has_sharding_rule(op), op)
                self.assertNotIn(
                    added, set(sharding_rules._fallback_rules().values()), op
                )
        # Torch's own single-dimension rule for 2-D max pooling's backward,
        # where it has one.
        op = torch.ops.aten.max_pool2d_with_indices_backward.default
        if op in getattr(propagator, "op_single_dim_strategy_funcs", {}):
            self.assertNotIn(op, sharding_rules._ADDED_RULES)
            self.assertNotIn(op, propagator.op_strategy_funcs)


class StackDimTest(testing.TestCase):
    """`stack` along a negative dimension keeps its inputs' splits."""

    def test_negative_dimension_is_counted_in_the_output(self):
        sharding_rules.register()
        mesh = distribution_api.DeviceMesh(
            (1,), ("model",), ["cpu:0"]
        ).backend_mesh
        values = np.arange(4 * 8 * 4 * 8, dtype="float32").reshape(4, 8, 4, 8)
        tensor = distribute_tensor(torch.from_numpy(values), mesh, [Shard(2)])
        # The split dimension (2) moves up where the new one goes before it.
        for dim, split in ((-2, 2), (3, 2), (-1, 2), (-3, 3), (-5, 3)):
            stacked = torch.stack((tensor, -tensor), dim=dim)
            # Torch 2.11's own rule laid `dim=-2` out as `Shard(3)`.
            self.assertEqual(stacked.placements, (Shard(split),), dim)
            expected = np.stack((values, -values), axis=dim)
            self.assertAllClose(stacked.full_tensor().numpy(), expected)

    def test_register_wraps_once(self):
        sharding_rules.register()
        propagator = DTensor._op_dispatcher.sharding_propagator
        op = torch.ops.aten.stack.default
        rule = propagator.op_strategy_funcs[op]
        sharding_rules._wrap_rules()
        self.assertIs(propagator.op_strategy_funcs[op], rule)
        self.assertTrue(rule.keras_dim_normalized)


class StridedTransposeTest(testing.TestCase):
    """`t` moves a `_StridedShard` with its dimension."""

    def test_strided_shard_moves_to_the_other_dimension(self):
        sharding_rules.register()
        mesh = distribution_api.DeviceMesh(
            (1, 1), ("fsdp", "model"), ["cpu:0"]
        ).backend_mesh
        values = np.arange(8 * 4, dtype="float32").reshape(8, 4)
        # Dimension 0 split over both axes, "model" first: what
        # `(("model", "fsdp"), None)` gives a kernel (on axes of one process
        # the split factor is only a label; `layout_helpers_test` runs the
        # same transposes on a (2, 2) mesh).
        kernel = distribute_tensor(
            torch.from_numpy(values),
            mesh,
            [StridedShard(0, split_factor=2), Shard(0)],
        )
        for transpose in (torch.t, lambda x: x.transpose(0, 1)):
            transposed = transpose(kernel)
            # Torch 2.11's own `t` rule left `_StridedShard(dim=0)`.
            self.assertEqual(
                transposed.placements,
                (StridedShard(1, split_factor=2), Shard(1)),
            )
            self.assertAllClose(transposed.to_local().numpy(), values.T)

    def test_register_wraps_once(self):
        sharding_rules.register()
        propagator = DTensor._op_dispatcher.sharding_propagator
        op = torch.ops.aten.t.default
        rule = propagator.op_strategy_funcs[op]
        sharding_rules._wrap_rules()
        self.assertIs(propagator.op_strategy_funcs[op], rule)
        self.assertTrue(rule.keras_strided_shards_moved)
