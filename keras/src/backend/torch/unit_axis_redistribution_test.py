"""Redistributions in a step skip mesh axes of one process (a one-process
mesh, the process group of the root conftest)."""

from unittest import mock

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src import testing
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import sharding_rules
from keras.src.backend.torch import torch_internals
from keras.src.distribution import distribution_lib as distribution_api


def _installed():
    from torch.distributed.tensor import _dispatch

    return _dispatch.redistribute_local_tensor


class UnitAxisRedistributionTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        self.mesh = distribution_api.DeviceMesh((1,), ("batch",), ["cpu:0"])
        sharding_rules.register()
        self.local = torch.arange(6.0).reshape(2, 3)

    def partial_sum(self):
        return DTensor.from_local(
            self.local, self.mesh.backend_mesh, [Partial()]
        )

    def test_installed_once_in_front_of_torchs_function(self):
        sharding_rules.register()
        function = _installed()
        self.assertTrue(function.keras_skips_unit_axes)
        self.assertFalse(
            getattr(function.__wrapped__, "keras_skips_unit_axes", False)
        )

    def test_in_a_step_values_move_exactly(self):
        value = self.partial_sum()
        other = self.partial_sum()
        # The step's context alone (its torch function mode would make the
        # test's own tensors DTensors).
        with mock.patch.object(
            created_tensors, "in_step_context", return_value=True
        ):
            replicated = value.redistribute(placements=[Replicate()])
            sharded = replicated.redistribute(placements=[Shard(1)])
            # Through DTensor's dispatch: a partial sum into an op that
            # needs its sum.
            exp = torch.exp(other)
        self.assertEqual(tuple(replicated.placements), (Replicate(),))
        self.assertEqual(tuple(sharded.placements), (Shard(1),))
        self.assertAllClose(sharded.to_local(), self.local)
        self.assertAllClose(exp.to_local(), torch.exp(self.local))

    def test_the_wrapper_returns_local_tensors_without_calling_torch(self):
        from keras.src.backend.torch import unit_axis_redistribution

        calls = []

        def torch_function(local, current, target, **kwargs):
            calls.append((current.placements, target.placements))
            return local

        wrapped = unit_axis_redistribution.skipping_unit_axes(torch_function)
        spec = torch_internals.spec_of(self.partial_sum())
        target = torch_internals.spec_of(
            DTensor.from_local(
                self.local, self.mesh.backend_mesh, [Replicate()]
            )
        )
        with mock.patch.object(
            created_tensors, "in_step_context", return_value=True
        ):
            self.assertIs(wrapped(self.local, spec, target), self.local)
        self.assertEqual(calls, [])
        # Outside a step, torch's function decides.
        self.assertIs(wrapped(self.local, spec, target), self.local)
        self.assertEqual(calls, [((Partial(),), (Replicate(),))])


class OtherPartialsReducedTest(testing.TestCase):
    """Which mesh axes a partial value is reduced on before it becomes a
    partial value of another reduce op (spec logic; the values are
    checked on 2 processes by `integration_tests/step_handlers_test`)."""

    def spec(self, placements):
        mesh = distribution_api.DeviceMesh(
            (1, 1), ("batch", "model"), ["cpu:0"]
        ).backend_mesh
        return torch_internals.DTensorSpec(mesh, tuple(placements))

    def test_reduced_where_the_reduce_ops_differ(self):
        from keras.src.backend.torch import unit_axis_redistribution as uar

        avg, total = Partial("avg"), Partial()
        cases = [
            ((avg, avg), (total, avg), (Replicate(), avg)),
            ((avg, Shard(0)), (total, Shard(0)), (Replicate(), Shard(0))),
        ]
        for current, target, expected in cases:
            reduced = uar._other_partials_reduced(
                self.spec(current), self.spec(target)
            )
            self.assertEqual(reduced.placements, expected)
        # Nothing to convert: the same spec back.
        for current, target in (
            ((total, avg), (total, avg)),
            ((avg, Replicate()), (Replicate(), Replicate())),
            ((Shard(0), avg), (Replicate(), avg)),
        ):
            spec = self.spec(current)
            self.assertIs(
                uar._other_partials_reduced(spec, self.spec(target)), spec
            )
