"""Tests of the view-like ops' rules (`view_rules`).

Values are checked on one-device meshes, where a `Shard` placement keeps
its meaning for DTensor's sharding propagation; multi-process values are
checked by `benchmark_smoke_test.py` and the torch matrix
(`scripts/torch_matrix.sh`).
"""

from unittest import mock

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import ops
from keras.src import testing
from keras.src.backend.torch import sharding_rules
from keras.src.backend.torch import view_rules
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import OpSchema
from keras.src.backend.torch.torch_internals import OpSpec
from keras.src.backend.torch.torch_internals import OpStrategy
from keras.src.backend.torch.torch_internals import StridedShard
from keras.src.backend.torch.torch_internals import TensorMeta
from keras.src.backend.torch.torch_probes import FakeMesh
from keras.src.distribution import distribution_lib as distribution_api


def head_sharded(value, mesh, placements):
    """`value` as a DTensor that requires grad, laid out as `placements`."""
    tensor = torch.from_numpy(value).requires_grad_(True)
    return distribute_tensor(tensor, mesh, placements)


# Torch 2.12 and later express merging a sharded dimension into the one
# before it as a `_StridedShard`; earlier releases refuse it.
TORCH_FLATTENS_SHARDED_DIMENSIONS = tuple(
    int(part) for part in torch.__version__.split(".")[:2]
) >= (2, 12)


def clear_sharding_caches():
    """Forgets the placements DTensor propagated (Python and C++ caches),
    so that a changed rule is asked again."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    clear_native = getattr(
        torch._C, "_clear_DTensor_sharding_propagator_cache", None
    )
    if clear_native is not None:
        clear_native()


class HeadShardedMatmulTest(testing.TestCase):
    """`q @ k^T` with heads (dim 1) sharded, as attention computes it:
    the values of the scores and gradients, and their placements.

    Where torch's `view` rule merges the sharded heads into the batch
    dimension (torch >= 2.12), the heads stay split in the scores and the
    gradients. Where it refuses (torch < 2.12, stood in for here by a rule
    refusing as torch 2.11 does), `view_with_reshape_fallback` takes
    `reshape`'s rule, which gathers the heads: they come out replicated,
    the batch split kept."""

    def setUp(self):
        super().setUp()
        sharding_rules.register()
        rng = np.random.default_rng(0)
        self.q = rng.standard_normal((2, 4, 8, 16)).astype("float32")
        self.k = rng.standard_normal((2, 4, 16, 8)).astype("float32")

    def check_matmul(self, mesh, placements, matmul, expected_placements):
        q = head_sharded(self.q, mesh, placements)
        k = head_sharded(self.k, mesh, placements)
        scores = matmul(q, k)
        (scores * scores).sum().backward()
        plain_q = torch.from_numpy(self.q).requires_grad_(True)
        plain_k = torch.from_numpy(self.k).requires_grad_(True)
        expected = torch.matmul(plain_q, plain_k)
        (expected * expected).sum().backward()
        self.assertAllClose(
            scores.full_tensor().detach(), expected.detach(), atol=1e-4
        )
        self.assertAllClose(q.grad.full_tensor(), plain_q.grad, atol=1e-3)
        self.assertAllClose(k.grad.full_tensor(), plain_k.grad, atol=1e-3)
        expected_placements = tuple(expected_placements)
        self.assertEqual(scores.placements, expected_placements)
        self.assertEqual(q.grad.placements, expected_placements)
        self.assertEqual(k.grad.placements, expected_placements)

    def model_mesh(self):
        mesh = distribution_api.DeviceMesh((1,), ("model",), ["cpu:0"])
        return mesh.backend_mesh

    def batch_model_mesh(self):
        mesh = distribution_api.DeviceMesh(
            (1, 1), ("batch", "model"), ["cpu:0"]
        )
        return mesh.backend_mesh

    @pytest.mark.skipif(
        not TORCH_FLATTENS_SHARDED_DIMENSIONS,
        reason="torch < 2.12 refuses to merge a sharded dimension",
    )
    def test_torch_matmul_on_model_mesh_keeps_heads_split(self):
        clear_sharding_caches()
        self.check_matmul(
            self.model_mesh(), [Shard(1)], torch.matmul, [Shard(1)]
        )

    @pytest.mark.skipif(
        not TORCH_FLATTENS_SHARDED_DIMENSIONS,
        reason="torch < 2.12 refuses to merge a sharded dimension",
    )
    def test_keras_matmul_on_batch_model_mesh_keeps_heads_split(self):
        clear_sharding_caches()
        self.check_matmul(
            self.batch_model_mesh(),
            [Shard(0), Shard(1)],
            ops.matmul,
            [Shard(0), Shard(1)],
        )

    def refusing_to_merge_a_sharded_dimension(self):
        """The view rules refuse, as torch 2.11's, wherever the installed
        ones would merge a sharded dimension into a `_StridedShard`."""
        propagator = DTensor._op_dispatcher.sharding_propagator
        reshape_rule = propagator.op_strategy_funcs[
            torch.ops.aten.reshape.default
        ]

        def refusing(view_rule):
            def rule(op_schema):
                strategy = view_rule(op_schema)
                for spec in strategy.strategies:
                    if any(
                        isinstance(p, StridedShard)
                        for p in spec.output_spec.placements
                    ):
                        raise RuntimeError(
                            "Attempted to flatten multiple dimensions, with "
                            "dimension 1 being sharded."
                        )
                return strategy

            return rule

        rules = {
            op: view_rules.view_with_reshape_fallback(
                refusing(propagator.op_strategy_funcs[op]), reshape_rule
            )
            for op in sharding_rules._VIEW_OPS
        }
        self.addCleanup(clear_sharding_caches)
        patch = mock.patch.dict(propagator.op_strategy_funcs, rules)
        clear_sharding_caches()
        return patch

    def test_refused_merge_gathers_heads_on_model_mesh(self):
        with self.refusing_to_merge_a_sharded_dimension():
            self.check_matmul(
                self.model_mesh(), [Shard(1)], torch.matmul, [Replicate()]
            )

    def test_refused_merge_gathers_heads_on_batch_model_mesh(self):
        with self.refusing_to_merge_a_sharded_dimension():
            self.check_matmul(
                self.batch_model_mesh(),
                [Shard(0), Shard(1)],
                ops.matmul,
                [Shard(0), Replicate()],
            )


class ViewFallbackTest(testing.TestCase):
    """The fallback steps in on `view`'s refusals to flatten or reshape a
    sharded dimension, and on nothing else."""

    def setUp(self):
        super().setUp()
        # A view of a tensor split along its first dimension.
        mesh = distribution_api.DeviceMesh(
            (1,), ("batch",), ["cpu:0"]
        ).backend_mesh
        meta = TensorMeta(torch.Size([4, 6]), (6, 1), torch.float32)
        spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)
        self.schema = OpSchema(
            torch.ops.aten.view.default,
            (OpStrategy([OpSpec(spec)]), [24]),
            {},
        )

    def rule_raising(self, message):
        def view_rule(op_schema):
            raise RuntimeError(message)

        return view_rule

    def test_refusal_to_flatten_takes_the_reshape_rule(self):
        rule = view_rules.view_with_reshape_fallback(
            self.rule_raising(
                "Attempted to flatten multiple dimensions, with dimension 1 "
                "being sharded."
            ),
            lambda op_schema: ("reshape", op_schema),
        )
        self.assertEqual(rule(self.schema), ("reshape", self.schema))

    def test_refusal_to_reshape_a_sharded_dimension_takes_reshape(self):
        rule = view_rules.view_with_reshape_fallback(
            self.rule_raising("would remove or reshape sharded dimension 1"),
            lambda op_schema: ("reshape", op_schema),
        )
        self.assertEqual(rule(self.schema), ("reshape", self.schema))

    def test_refusals_of_uneven_splits_take_the_reshape_rule(self):
        """A batch that does not divide by the processes (a last batch)
        is split unevenly; `view` refuses to flatten or unflatten it, and
        `reshape`'s rule gathers it first."""
        for message in (
            "Cannot flatten unevenly sharded tensor: dimension 0 (size 9) "
            "is not evenly divisible by mesh dimension 0 (size 2).",
            "Cannot unflatten unevenly sharded tensor: output dimension 0 "
            "(size 3) is not evenly divisible by mesh dimension 0 (size 2).",
        ):
            rule = view_rules.view_with_reshape_fallback(
                self.rule_raising(message),
                lambda op_schema: ("reshape", op_schema),
            )
            self.assertEqual(rule(self.schema), ("reshape", self.schema))

    def test_an_uneven_split_behind_an_axis_of_one_process_is_checked(self):
        """`(Shard(0), Shard(0))` on a (1, 2) mesh, 3 rows: torch's rules
        check the first axis only; they see the split of the second."""
        mesh = FakeMesh((1, 2))
        meta = TensorMeta(torch.Size([3, 8, 16]), (128, 16, 1), torch.float32)
        spec = DTensorSpec(mesh, (Shard(0), Shard(0)), tensor_meta=meta)
        even = DTensorSpec(
            mesh,
            (Shard(0), Shard(0)),
            tensor_meta=TensorMeta(
                torch.Size([4, 8, 16]), (128, 16, 1), torch.float32
            ),
        )
        self.assertTrue(view_rules._hides_an_uneven_split(spec, 0))
        self.assertFalse(view_rules._hides_an_uneven_split(spec, 1))
        self.assertFalse(view_rules._hides_an_uneven_split(even, 0))
        seen = []

        def view_rule(op_schema):
            (input_spec,) = [
                s.output_spec for s in op_schema.args_schema[0].strategies
            ]
            seen.append(input_spec.placements)
            if input_spec.placements[0] != Replicate():
                return "viewed as if split evenly"
            raise RuntimeError(
                "Cannot flatten unevenly sharded tensor: dimension 0 "
                "(size 3) is not evenly divisible by mesh dimension 1 "
                "(size 2)."
            )

        def reshape_rule(op_schema):
            (input_spec,) = [
                s.output_spec for s in op_schema.args_schema[0].strategies
            ]
            gathered = DTensorSpec(
                mesh, (Replicate(), Replicate()), tensor_meta=meta
            )
            seen.append(("reshape", input_spec.placements))
            return OpStrategy(
                [OpSpec(output_specs=gathered, input_specs=(gathered,))]
            )

        rule = view_rules.view_with_reshape_fallback(view_rule, reshape_rule)
        schema = OpSchema(
            torch.ops.aten.view.default,
            (OpStrategy([OpSpec(spec)]), [24, 16]),
            {},
        )
        with mock.patch.object(
            view_rules, "generate_redistribute_costs", lambda *a: [0.0]
        ):
            strategy = rule(schema)
        hidden = (Replicate(), Shard(0))
        self.assertEqual(seen, [hidden, ("reshape", hidden)])
        (op_spec,) = strategy.strategies
        self.assertEqual(op_spec.redistribute_cost, [[0.0]])

    def test_refusal_to_unflatten_a_strided_shard_gathers_it(self):
        mesh = distribution_api.DeviceMesh(
            (1, 1), ("batch", "model"), ["cpu:0"]
        ).backend_mesh
        meta = TensorMeta(torch.Size([48, 16]), (16, 1), torch.float32)
        strided = DTensorSpec(
            mesh,
            (StridedShard(0, split_factor=6), Shard(1)),
            tensor_meta=meta,
        )
        schema = OpSchema(
            torch.ops.aten.view.default,
            (OpStrategy([OpSpec(strided)]), [6, 8, 16]),
            {},
        )
        seen = []

        def view_rule(op_schema):
            (spec,) = [
                s.output_spec for s in op_schema.args_schema[0].strategies
            ]
            if spec.placements[0] != Replicate():
                raise RuntimeError(
                    "Cannot unflatten tensor with _StridedShard placement: "
                    "split_factor=6 does not match any output dimension."
                )
            seen.append(spec.placements)
            return OpStrategy([OpSpec(output_specs=spec, input_specs=(spec,))])

        rule = view_rules.view_with_reshape_fallback(
            view_rule, lambda op_schema: ("reshape", op_schema)
        )
        strategy = rule(schema)
        # The strided shard is replicated, the other placement kept, and
        # the cost of gathering it priced.
        self.assertEqual(seen, [(Replicate(), Shard(1))])
        (op_spec,) = strategy.strategies
        self.assertEqual(len(op_spec.redistribute_cost), 1)

    def test_refusals_reshape_shares_are_raised_as_views(self):
        """Not decided by words: where `reshape`'s rule refuses too, the
        refusal was not the layout's, and `view`'s is raised."""

        def reshape_rule(op_schema):
            raise RuntimeError("reshape's refusal")

        rule = view_rules.view_with_reshape_fallback(
            self.rule_raising("some other refusal"), reshape_rule
        )
        with self.assertRaisesRegex(RuntimeError, "some other refusal"):
            rule(self.schema)

    def test_view_of_a_dimension_on_a_size_one_axis(self):
        """`Shard(1)` on a mesh axis of size 1 holds the whole dimension;
        the view torch's rule refuses takes the reshape rule (free there)."""
        mesh = distribution_api.DeviceMesh(
            (1, 1), ("batch", "model"), ["cpu:0"]
        )
        x = distribute_tensor(
            torch.arange(16.0).reshape(16, 1),
            mesh.backend_mesh,
            [Shard(0), Shard(1)],
        )
        y = x.view(1, -1)
        self.assertEqual(tuple(y.shape), (1, 16))
        self.assertAllClose(
            y.full_tensor().numpy(), np.arange(16.0).reshape(1, 16)
        )

    def test_accepted_views_keep_the_view_rule(self):
        rule = view_rules.view_with_reshape_fallback(
            lambda op_schema: ("view", op_schema),
            lambda op_schema: ("reshape", op_schema),
        )
        self.assertEqual(rule(self.schema), ("view", self.schema))

    def test_register_wraps_once(self):
        sharding_rules.register()
        propagator = DTensor._op_dispatcher.sharding_propagator
        first = propagator.op_strategy_funcs[torch.ops.aten.view.default]
        sharding_rules.register()
        again = propagator.op_strategy_funcs[torch.ops.aten.view.default]
        self.assertIs(first, again)
        self.assertTrue(first.keras_reshape_fallback)

    def test_views_torch_allows_stay_local(self):
        mesh = distribution_api.DeviceMesh((1,), ("model",), ["cpu:0"])
        x = distribute_tensor(
            torch.arange(24.0).reshape(4, 6), mesh.backend_mesh, [Shard(0)]
        )
        self.assertEqual(x.view(2, 2, 6).placements, (Shard(0),))
        self.assertEqual(x.view(24).placements, (Shard(0),))
        y = distribute_tensor(
            torch.arange(24.0).reshape(4, 6), mesh.backend_mesh, [Replicate()]
        )
        self.assertEqual(y.view(6, 4).placements, (Replicate(),))


class UnbindFallbackTest(testing.TestCase):
    """`unbind` along a sharded dimension gathers that dimension; other
    unbinds keep torch's rule."""

    def setUp(self):
        super().setUp()
        sharding_rules.register()
        self.value = np.arange(24.0, dtype="float32").reshape(4, 3, 2)

    def distributed(self, shape, names, placements):
        mesh = distribution_api.DeviceMesh(shape, names, ["cpu:0"])
        tensor = torch.from_numpy(self.value).requires_grad_(True)
        return distribute_tensor(tensor, mesh.backend_mesh, placements)

    def check_rows(self, rows, placements):
        self.assertLen(rows, 4)
        for row, expected in zip(rows, self.value):
            self.assertEqual(row.placements, placements)
            self.assertAllClose(row.full_tensor().detach().numpy(), expected)

    def test_iterating_over_a_sharded_dimension_gathers_it(self):
        x = self.distributed((1,), ("batch",), [Shard(0)])
        rows = list(x)
        self.check_rows(rows, (Replicate(),))
        weights = torch.arange(4.0).reshape(4, 1, 1)
        replicated = DTensor.from_local(weights, x.device_mesh, [Replicate()])
        (torch.stack(rows) * replicated).sum().backward()
        self.assertAllClose(
            x.grad.full_tensor().numpy(),
            np.broadcast_to(weights.numpy(), self.value.shape),
        )

    def test_gathers_only_the_unbound_dimension(self):
        x = self.distributed((1, 1), ("batch", "model"), [Shard(0), Shard(1)])
        # Dimension 1 of `x` is dimension 0 of each row.
        self.check_rows(torch.unbind(x, 0), (Replicate(), Shard(0)))

    def test_unbinding_another_dimension_keeps_torchs_rule(self):
        x = self.distributed((1,), ("batch",), [Shard(1)])
        self.check_rows(torch.unbind(x, 0), (Shard(0),))

    def test_an_unbind_of_an_unsplit_dimension_is_torchs_alone(self):
        """Decided by placements: where the unbound dimension is not
        split, torch's rule decides, refusals included."""
        mesh = distribution_api.DeviceMesh((1,), ("batch",), ["cpu:0"])
        meta = TensorMeta(torch.Size([4, 3]), (3, 1), torch.float32)
        spec = DTensorSpec(mesh.backend_mesh, (Shard(1),), tensor_meta=meta)
        schema = OpSchema(
            torch.ops.aten.unbind.int, (OpStrategy([OpSpec(spec)]), 0), {}
        )
        seen = []

        def refusing(op_schema):
            seen.append(op_schema)
            raise RuntimeError("some other refusal")

        rule = view_rules.unbind_with_gather_fallback(refusing)
        with self.assertRaisesRegex(RuntimeError, "some other refusal"):
            rule(schema)
        self.assertEqual(seen, [schema])

    def test_register_wraps_once(self):
        propagator = DTensor._op_dispatcher.sharding_propagator
        first = propagator.op_strategy_funcs[torch.ops.aten.unbind.int]
        sharding_rules._wrap_rules()
        again = propagator.op_strategy_funcs[torch.ops.aten.unbind.int]
        self.assertIs(first, again)
        self.assertTrue(first.keras_gather_fallback)
