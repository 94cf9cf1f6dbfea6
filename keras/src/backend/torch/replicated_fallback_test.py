"""Tests of the replicated fallback: inside Keras steps only."""

from unittest import mock

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import testing
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import replicated_fallback
from keras.src.backend.torch import sharding_rules
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import OpSpec
from keras.src.backend.torch.torch_internals import OpStrategy
from keras.src.distribution import distribution_lib as distribution_api

aten = torch.ops.aten


class ReplicatedFallbackTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        sharding_rules.register()
        self.keras_mesh = distribution_api.DeviceMesh(
            (1,), ("batch",), ["cpu:0"]
        )
        self.mesh = self.keras_mesh.backend_mesh
        self.edges = torch.tensor([[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]])
        self.values = torch.tensor([[1.0, 4.5], [0.5, 3.0]])

    def step(self):
        return created_tensors.replicate_created_tensors(self.keras_mesh)

    def searchsorted(self):
        return torch.searchsorted(
            distribute_tensor(self.edges, self.mesh, [Shard(0)]),
            distribute_tensor(self.values, self.mesh, [Shard(1)]),
        )

    def test_inside_a_step_an_op_without_a_rule_runs_replicated(self):
        expected = torch.searchsorted(self.edges, self.values)
        fallback = (
            DTensor._op_dispatcher._propagate_op_sharding_dispatch_slow_path
        )
        fallback.warned.discard(aten.searchsorted.Tensor)
        with self.assertLogs(replicated_fallback.logger, "WARNING") as logs:
            with self.step():
                got = self.searchsorted()
                again = self.searchsorted()
        # Warned once, naming the op and what it costs.
        self.assertLen(logs.output, 1)
        self.assertIn("aten.searchsorted.Tensor", logs.output[0])
        self.assertIn("all-gathering", logs.output[0])
        for result in (got, again):
            self.assertEqual(result.placements, (Replicate(),))
            self.assertAllClose(result.full_tensor(), expected)

    def test_outside_a_step_dtensor_raises_its_own_error(self):
        # Even after the same op, on the same layouts, ran in a step on
        # this thread: no rule was registered, and nothing was cached.
        with self.step():
            self.searchsorted()
        self.assertFalse(
            torch_internals.has_sharding_rule(aten.searchsorted.Tensor)
        )
        with self.assertRaisesRegex(
            NotImplementedError, "does not have a sharding strategy"
        ):
            self.searchsorted()

    def test_scatter_reduce_runs_replicated_in_a_step(self):
        """Keras's segment reductions (`AUC`) take `scatter_reduce`."""
        data = torch.arange(6.0)
        ids = torch.tensor([0, 1, 0, 2, 1, 0])
        expected = torch.zeros(3).scatter_reduce(0, ids, data, "sum")
        with self.step():
            got = distribute_tensor(torch.zeros(3), self.mesh, [Replicate()])
            got = got.scatter_reduce(
                0,
                distribute_tensor(ids, self.mesh, [Shard(0)]),
                distribute_tensor(data, self.mesh, [Shard(0)]),
                "sum",
            )
        self.assertEqual(got.placements, (Replicate(),))
        self.assertAllClose(got.full_tensor(), expected)

    def test_gradients_flow_through_a_replicated_op(self):
        x = torch.arange(6.0).reshape(2, 3).requires_grad_(True)
        index = torch.tensor([[0, 1, 0], [1, 0, 1]])
        out = torch.zeros(2, 3).scatter_reduce(0, index, x, "sum")
        with self.step():
            dx = distribute_tensor(x.detach(), self.mesh, [Shard(0)])
            dx.requires_grad_(True)
            dout = distribute_tensor(
                torch.zeros(2, 3), self.mesh, [Replicate()]
            ).scatter_reduce(
                0, distribute_tensor(index, self.mesh, [Shard(0)]), dx, "sum"
            )
            dout.sum().backward()
        out.sum().backward()
        self.assertAllClose(dx.grad.full_tensor(), x.grad)

    def test_a_rule_blind_to_the_mesh_runs_replicated_in_a_step(self):
        """Torch 2.11's `constant_pad_nd` rule gives one placement on any
        mesh ("(Replicate(),) != (1, 2)" in `MelSpectrogram` on a (1, 2)
        mesh); stood in for here."""
        op = aten.constant_pad_nd.default
        propagator = torch_internals.sharding_propagator()

        def blind_rule(op_schema):
            mesh = op_schema.get_mesh_from_args(validate=False)
            spec = DTensorSpec(mesh, (Replicate(),))
            return OpStrategy(
                [OpSpec(spec, input_specs=(spec,), redistribute_cost=[[1]])]
            )

        single_dim = getattr(propagator, "op_single_dim_strategy_funcs", {})
        mesh = distribution_api.DeviceMesh(
            (1, 1), ("batch", "model"), ["cpu:0"]
        )
        value = torch.arange(12.0).reshape(3, 4)
        with (
            mock.patch.dict(propagator.op_strategy_funcs, {op: blind_rule}),
            mock.patch.dict(single_dim),
            mock.patch.dict(propagator.op_to_schema_info),
        ):
            single_dim.pop(op, None)
            torch_internals.clear_propagation_caches()
            with created_tensors.replicate_created_tensors(mesh):
                x = distribute_tensor(
                    value, mesh.backend_mesh, [Shard(0), Replicate()]
                )
                got = F.pad(x, (1, 2))
        torch_internals.clear_propagation_caches()
        self.assertEqual(got.placements, (Replicate(), Replicate()))
        self.assertAllClose(got.full_tensor(), F.pad(value, (1, 2)))

    def test_which_ops_can_run_replicated(self):
        runs = replicated_fallback.runs_replicated
        self.assertTrue(runs(aten.ne.Tensor))
        self.assertTrue(runs(aten.searchsorted.Tensor))
        # Writes to its input; draws random values; takes a list of
        # tensors; returns a list; returns a view of its input.
        self.assertFalse(runs(aten.add_.Tensor))
        self.assertFalse(runs(aten.bernoulli.p))
        self.assertFalse(runs(aten.cat.default))
        self.assertFalse(runs(aten.unbind.int))
        self.assertFalse(runs(aten.diagonal.default))

    def test_install_is_idempotent(self):
        dispatcher = DTensor._op_dispatcher
        installed = dispatcher._propagate_op_sharding_dispatch_slow_path
        self.assertIsInstance(installed, replicated_fallback.ReplicatedFallback)
        replicated_fallback.install()
        self.assertIs(
            dispatcher._propagate_op_sharding_dispatch_slow_path, installed
        )
