"""Tests of the sharding rules added where a torch release refuses.

Values are checked on one-device meshes, where a `Shard` placement keeps
its meaning for DTensor's sharding propagation; multi-process values are
checked by `benchmark_smoke_test.py` and the torch matrix
(`scripts/torch_matrix.sh`).
"""

import numpy as np
import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import ops
from keras.src import testing
from keras.src.backend.torch import sharding_rules
from keras.src.distribution import distribution_lib as distribution_api


def head_sharded(value, mesh, placements):
    """`value` as a DTensor that requires grad, laid out as `placements`."""
    tensor = torch.from_numpy(value).requires_grad_(True)
    return distribute_tensor(tensor, mesh, placements)


class HeadShardedMatmulTest(testing.TestCase):
    """`q @ k^T` with heads (dim 1) sharded, as attention computes it."""

    def setUp(self):
        super().setUp()
        sharding_rules.register()
        rng = np.random.default_rng(0)
        self.q = rng.standard_normal((2, 4, 8, 16)).astype("float32")
        self.k = rng.standard_normal((2, 4, 16, 8)).astype("float32")

    def check_matmul(self, mesh, placements, matmul):
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

    def test_torch_matmul_on_model_mesh(self):
        mesh = distribution_api.DeviceMesh((1,), ("model",), ["cpu:0"])
        self.check_matmul(mesh.backend_mesh, [Shard(1)], torch.matmul)

    def test_keras_matmul_on_batch_model_mesh(self):
        mesh = distribution_api.DeviceMesh(
            (1, 1), ("batch", "model"), ["cpu:0"]
        )
        self.check_matmul(mesh.backend_mesh, [Shard(0), Shard(1)], ops.matmul)


class ViewFallbackTest(testing.TestCase):
    """The fallback steps in on `view`'s refusals to flatten or reshape a
    sharded dimension, and on nothing else."""

    def rule_raising(self, message):
        def view_rule(op_schema):
            raise RuntimeError(message)

        return view_rule

    def test_refusal_to_flatten_takes_the_reshape_rule(self):
        rule = sharding_rules.view_with_reshape_fallback(
            self.rule_raising(
                "Attempted to flatten multiple dimensions, with dimension 1 "
                "being sharded."
            ),
            lambda op_schema: ("reshape", op_schema),
        )
        self.assertEqual(rule("schema"), ("reshape", "schema"))

    def test_refusal_to_reshape_a_sharded_dimension_takes_reshape(self):
        rule = sharding_rules.view_with_reshape_fallback(
            self.rule_raising("would remove or reshape sharded dimension 1"),
            lambda op_schema: ("reshape", op_schema),
        )
        self.assertEqual(rule("schema"), ("reshape", "schema"))

    def test_other_refusals_are_raised(self):
        rule = sharding_rules.view_with_reshape_fallback(
            self.rule_raising("some other refusal"),
            lambda op_schema: ("reshape", op_schema),
        )
        with self.assertRaisesRegex(RuntimeError, "some other refusal"):
            rule("schema")

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
        rule = sharding_rules.view_with_reshape_fallback(
            lambda op_schema: ("view", op_schema),
            lambda op_schema: ("reshape", op_schema),
        )
        self.assertEqual(rule("schema"), ("view", "schema"))

    def test_register_wraps_once(self):
        sharding_rules.register()
        propagator = sharding_rules.DTensor._op_dispatcher.sharding_propagator
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
