"""Tests of the attention kernels' sharding rules (`attention_rules`).

The rules are functions of shapes and placements: DTensor's sharding
propagation runs them here on one-device meshes.
"""

from unittest import mock

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src import testing
from keras.src.backend.torch import attention_rules
from keras.src.backend.torch import sharding_rules
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import OpSchema
from keras.src.backend.torch.torch_internals import OpSpec
from keras.src.backend.torch.torch_internals import OpStrategy
from keras.src.backend.torch.torch_internals import TensorMeta
from keras.src.distribution import distribution_lib as distribution_api


class CudaAttentionRulesTest(testing.TestCase):
    """The CUDA attention kernels' rules, checked on CPU.

    The rules are functions of the inputs' shapes and placements, so
    DTensor's sharding propagation runs them here on placeholders of the
    ops' arguments (bfloat16 queries of shape [B, H, T, D], as on a GPU),
    for queries replicated, split by batch and split by head, with no
    mask, a mask that broadcasts over heads ([B, 1, T, T]) and a mask per
    head ([B, H, T, T]). Each must give the queries' placement to the
    outputs, with nothing redistributed: the inputs arrive laid out as
    `argument_layouts._align_attention_mask` lays them out.
    """

    SHAPE = (2, 4, 8, 16)
    PLACEMENTS = {"batch": Shard(0), "head": Shard(1), "replicated": None}

    def setUp(self):
        super().setUp()
        sharding_rules.register()
        self.mesh = distribution_api.DeviceMesh(
            (1,), ("model",), ["cpu:0"]
        ).backend_mesh
        self.propagator = DTensor._op_dispatcher.sharding_propagator

    def spec(self, shape, placement, dtype=torch.bfloat16):
        value = torch.empty(shape, dtype=dtype)
        meta = TensorMeta(value.shape, value.stride(), value.dtype)
        return DTensorSpec(self.mesh, (placement,), meta)

    def cases(self):
        """(name, query placement, query spec, mask spec) of every case."""
        batch, heads, length, _ = self.SHAPE
        for name, placement in self.PLACEMENTS.items():
            placement = placement or Replicate()
            query = self.spec(self.SHAPE, placement)
            for mask_shape in (None, (batch, 1, length, length)):
                yield name, placement, query, self.mask(mask_shape, placement)
            per_head = (batch, heads, length, length)
            yield name, placement, query, self.spec(per_head, placement)

    def mask(self, shape, placement):
        if shape is None:
            return None
        broadcast = placement.is_shard() and shape[placement.dim] == 1
        return self.spec(shape, Replicate() if broadcast else placement)

    def propagate(self, op, args):
        sharding = self.propagator.propagate_op_sharding_non_cached(
            OpSchema(op, args, {})
        )
        self.assertFalse(sharding.needs_redistribute, op)
        return [
            None if spec is None else tuple(spec.placements)
            for spec in sharding.output_spec
        ]

    def forward_args(self, op, query, mask):
        if op is torch.ops.aten._scaled_dot_product_flash_attention.default:
            return (query, query, query, 0.0, False, False)
        return (query, query, query, mask, True, 0.0, False)

    def test_forward_rules(self):
        aten = torch.ops.aten
        ops = (
            aten._scaled_dot_product_cudnn_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default,
        )
        for op in ops:
            for name, placement, query, mask in self.cases():
                if "flash" in str(op) and mask is not None:
                    continue  # The flash kernel takes no mask.
                outputs = self.propagate(op, self.forward_args(op, query, mask))
                # Output and log-sum-exp, as the queries.
                self.assertEqual(outputs[:2], [(placement,)] * 2, (op, name))

    def test_backward_rules(self):
        aten = torch.ops.aten
        length = self.SHAPE[2]
        for name, placement, query, mask in self.cases():
            lse = self.spec(self.SHAPE[:3], placement, torch.float32)
            seed = self.spec((), Replicate(), torch.int64)
            cudnn = self.propagate(
                aten._scaled_dot_product_cudnn_attention_backward.default,
                (query, query, query, query, query, lse, seed, seed, mask)
                + (None, None, length, length, 0.0, False),
            )
            self.assertEqual(cudnn, [(placement,)] * 3, name)
            # A mask that needs a gradient, then one that needs none (a
            # padding mask's, as keras-hub's models pass).
            for wants_mask_grad in (mask is not None, False):
                efficient = self.propagate(
                    aten._scaled_dot_product_efficient_attention_backward.default,
                    (query, query, query, query, mask, query, lse, seed, seed)
                    + (0.0, [True, True, True, wants_mask_grad], False),
                )
                self.assertEqual(efficient[:3], [(placement,)] * 3, name)
                if not wants_mask_grad:
                    self.assertIsNone(efficient[3])
                elif mask.placements[0] == placement:
                    self.assertEqual(efficient[3], (placement,))
                else:
                    # A broadcast mask's gradient sums over the query parts.
                    self.assertEqual(efficient[3], (Partial(),))

    def test_efficient_backward_gives_no_mask_gradient_unasked(self):
        """A mask that needs no gradient has none: torch 2.11's DTensor
        refuses a placement for the missing output ("output 3 ... does
        not have an associated TensorMeta", seen on an H100)."""
        query = self.spec(self.SHAPE, Shard(0))
        mask = self.mask((self.SHAPE[0], 1, 8, 8), Shard(0))
        for wants_mask_grad in (True, False):
            strategies = attention_rules._efficient_attention_backward_sharding(
                *(query, query, query, query, mask, query, query, None, None),
                *(0.0, [True, True, True, wants_mask_grad], False),
            )
            for outputs, _ in strategies:
                self.assertEqual(outputs[3] is not None, wants_mask_grad)

    def test_flash_backward_keeps_torchs_rule(self):
        aten = torch.ops.aten
        length = self.SHAPE[2]
        for name, placement, query, mask in self.cases():
            if mask is not None:
                continue
            lse = self.spec(self.SHAPE[:3], placement, torch.float32)
            seed = self.spec((), Replicate(), torch.int64)
            grads = self.propagate(
                aten._scaled_dot_product_flash_attention_backward.default,
                (query, query, query, query, query, lse, None, None)
                + (length, length, 0.0, False, seed, seed),
            )
            self.assertEqual(grads, [(placement,)] * 3, name)

    def test_masked_kernels_take_these_rules(self):
        """The four kernels with a mask take this module's rules; the flash
        kernels keep torch's (registered by DTensor itself)."""
        aten = torch.ops.aten
        funcs = self.propagator.op_strategy_funcs
        for op in list(attention_rules.rules())[2:]:
            self.assertNotEqual(
                funcs[op].__module__,
                "torch.distributed.tensor._ops._matrix_ops",
                op,
            )
        for op in (
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_backward.default,
        ):
            self.assertEqual(
                funcs[op].__module__,
                "torch.distributed.tensor._ops._matrix_ops",
                op,
            )


class CpuAttentionBackwardTest(testing.TestCase):
    """The CPU flash-attention backward runs in its query's layout."""

    SHAPE = (4, 4, 8, 8)

    def setUp(self):
        super().setUp()
        sharding_rules.register()
        self.mesh = distribution_api.DeviceMesh(
            (1, 1), ("batch", "model"), ["cpu:0"]
        ).backend_mesh
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        self.op = op.default
        propagator = DTensor._op_dispatcher.sharding_propagator
        self.strategy = propagator.op_strategy_funcs[self.op]

    def tensor(self, shape, placements):
        meta = TensorMeta(
            torch.Size(shape),
            torch.empty(shape).stride(),
            torch.float32,
        )
        spec = DTensorSpec(self.mesh, placements, tensor_meta=meta)
        return OpStrategy([OpSpec(spec)])

    def schema(self, grad_placements, placements, mask_placements):
        saved = [self.tensor(self.SHAPE, placements) for _ in range(4)]
        lse = self.tensor(self.SHAPE[:3], placements)
        mask = self.tensor((4, 1, 8, 8), mask_placements)
        return OpSchema(
            self.op,
            (self.tensor(self.SHAPE, grad_placements), *saved, lse)
            + (0.0, False),
            {"attn_mask": mask},
        )

    def test_every_tensor_takes_the_querys_placements(self):
        # The forward ran split by batch on the second axis, its mask
        # split alike; the incoming gradient is a partial sum on both.
        placements = (Replicate(), Shard(0))
        schema = self.schema((Partial(), Partial()), placements, placements)
        (chosen,) = self.strategy(schema).strategies
        for spec in chosen.input_specs:
            self.assertEqual(spec.placements, placements)
        self.assertEqual(
            [spec.placements for spec in chosen.output_specs],
            [placements] * 3,
        )
        # Only the incoming gradient moves.
        grad_cost, *saved_costs = chosen.redistribute_cost
        self.assertGreater(max(grad_cost), 0)
        self.assertEqual([max(c) for c in saved_costs], [0] * 5)

    def test_placements_attention_cannot_split_become_replicated(self):
        placements = (Shard(2), Shard(1))
        schema = self.schema((Partial(), Partial()), placements, placements)
        (chosen,) = self.strategy(schema).strategies
        self.assertEqual(
            chosen.output_specs[0].placements, (Replicate(), Shard(1))
        )

    def test_arguments_of_several_layouts_take_the_per_axis_rule(self):
        rule = mock.Mock(return_value="per-axis strategies")
        strategy = attention_rules.backward_in_query_layout(rule)
        schema = self.schema(
            (Partial(), Partial()), (Replicate(), Shard(0)), (Replicate(),) * 2
        )
        query = schema.args_schema[1]
        query.strategies.append(query.strategies[0])
        self.assertEqual(strategy(schema), "per-axis strategies")
        rule.assert_called_once_with(schema)

    def test_register_wraps_once(self):
        sharding_rules._wrap_rules()
        propagator = DTensor._op_dispatcher.sharding_propagator
        self.assertIs(propagator.op_strategy_funcs[self.op], self.strategy)
        self.assertTrue(self.strategy.keras_query_layout)
