"""Tests of `created_tensors`' scopes on a one-process mesh."""

import threading

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src import testing
from keras.src.backend.torch import created_tensors
from keras.src.distribution import distribution_lib as distribution_api


class OneProcessMeshTestCase(testing.TestCase):
    """A test case with a one-process ("batch",) mesh."""

    def setUp(self):
        super().setUp()
        self.mesh = distribution_api.DeviceMesh((1,), ("batch",), ["cpu:0"])
        self.backend_mesh = self.mesh.backend_mesh


class ReplicateCreatedTensorsTest(OneProcessMeshTestCase):
    """The step's context and its suspension."""

    def test_outside_the_context_nothing_changes(self):
        self.assertNotIsInstance(torch.arange(6), DTensor)

    def test_random_draws_are_counted_per_thread(self):
        before = created_tensors.draw_count()
        with created_tensors.replicate_created_tensors(self.mesh):
            torch.rand(2)
            torch.nn.functional.dropout(torch.ones(2), p=0.5)
            torch.ones(2)
        self.assertEqual(created_tensors.draw_count(), before + 2)
        counts = []
        thread = threading.Thread(
            target=lambda: counts.append(created_tensors.draw_count())
        )
        thread.start()
        thread.join()
        self.assertEqual(counts, [0])

    def test_suspended_takes_the_mode_off_and_puts_it_back(self):
        with created_tensors.replicate_created_tensors(self.mesh):
            mode = created_tensors.current_mode()
            self.assertIsNotNone(mode)
            with created_tensors.suspended():
                self.assertFalse(created_tensors.replicating_created_tensors())
                self.assertIsNone(created_tensors.current_mode())
                plain = torch.arange(3)
            self.assertIs(created_tensors.current_mode(), mode)
            with self.assertRaisesRegex(ValueError, "inside"):
                with created_tensors.suspended():
                    raise ValueError("inside")
            # Back after an error too.
            self.assertIs(created_tensors.current_mode(), mode)
            replicated = torch.arange(3)
        self.assertNotIsInstance(plain, DTensor)
        self.assertIsInstance(replicated, DTensor)
        self.assertIsNone(torch.overrides._get_current_function_mode())


class ReplicateBuiltTensorsTest(OneProcessMeshTestCase):
    """A layer's build replicates the tensors it makes from Python values;
    variables are made as outside it."""

    def test_factories_replicate_and_variables_stay_plain(self):
        with created_tensors.replicate_built_tensors(self.mesh):
            constant = torch.as_tensor(np.ones(3, dtype="float32"))
            self.assertFalse(created_tensors.replicating_created_tensors())
            with created_tensors.creating_variable():
                initial = torch.zeros(3)
            after = torch.arange(3)
        self.assertIsInstance(constant, DTensor)
        self.assertEqual(tuple(constant.placements), (Replicate(),))
        self.assertNotIsInstance(initial, DTensor)
        self.assertIsInstance(after, DTensor)
        self.assertNotIsInstance(torch.arange(3), DTensor)

    def test_inside_a_step_the_steps_mode_stays(self):
        with created_tensors.replicate_created_tensors(self.mesh):
            step_mode = created_tensors.current_mode()
            with created_tensors.replicate_built_tensors(self.mesh):
                self.assertIs(created_tensors.current_mode(), step_mode)
                with created_tensors.creating_variable():
                    # Variables made inside a step keep the step's mode.
                    self.assertIs(created_tensors.current_mode(), step_mode)


class CompiledModeTest(OneProcessMeshTestCase):
    """The mode around a compiled step lets Dynamo trace DTensor code."""

    def test_dtensor_code_compiles_into_one_graph(self):
        inputs = DTensor.from_local(
            torch.arange(12.0).reshape(4, 3),
            self.backend_mesh,
            [Shard(0)],
            run_check=False,
        )

        def step(x):
            # Each result is a DTensor the mode looks at.
            return (x * 2.0 + 1.0).sum(dim=1)

        with created_tensors.replicate_created_tensors(self.mesh):
            expected = step(inputs)
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="eager", fullgraph=True)
        with created_tensors.replicate_created_tensors(
            self.mesh, compiled=True
        ):
            value = compiled(inputs)
        torch._dynamo.reset()
        self.assertEqual(tuple(value.placements), (Shard(0),))
        self.assertAllClose(
            value.full_tensor().numpy(), expected.full_tensor().numpy()
        )

    def test_lookup_results_are_reduced_as_in_the_eager_mode(self):
        table = DTensor.from_local(
            torch.arange(20.0).reshape(5, 4),
            self.backend_mesh,
            [Shard(0)],
            run_check=False,
        )
        ids = DTensor.from_local(
            torch.tensor([[0, 4], [2, 2]]),
            self.backend_mesh,
            [Replicate()],
            run_check=False,
        )
        results = []
        for compiled in (False, True):
            with created_tensors.replicate_created_tensors(
                self.mesh, compiled=compiled
            ):
                results.append(torch.nn.functional.embedding(ids, table))
        for result in results:
            self.assertEqual(tuple(result.placements), (Replicate(),))
            self.assertAllClose(
                result.full_tensor().numpy(),
                torch.arange(20.0).reshape(5, 4)[ids.to_local()].numpy(),
            )
