"""Single-process tests of the reducer of each backward pass.

A one-process mesh still produces partial-sum gradients for replicated
parameters used with batch-sharded inputs, so the bucketing logic runs in
full here; values across processes are checked by the integration tests.
The helpers here are shared by the tests of the reducer's other modules.
"""

import os
import threading
from unittest import mock

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Partial

from keras.src import testing
from keras.src.backend.torch import bucket_assignment
from keras.src.backend.torch import distribution_lib
from keras.src.backend.torch import reducer
from keras.src.distribution import distribution_lib as distribution_api


def one_process_mesh():
    mesh = distribution_api.DeviceMesh((1,), ("batch",), ["cpu:0"])
    return distribution_lib._to_backend_mesh(mesh)


def pretend_mesh_dims_of_size_two(test_case):
    """Plans reductions as if every mesh dim had 2 processes, in one test.

    Reductions planned under the pretence are dropped afterwards: the
    reducer's context keeps a fresh `BucketAssignment` meanwhile.
    """
    for patcher in (
        mock.patch.object(
            bucket_assignment, "mesh_dim_size", lambda mesh, dim: 2
        ),
        mock.patch.object(
            reducer.context(),
            "assignment",
            bucket_assignment.BucketAssignment(),
        ),
    ):
        patcher.start()
        test_case.addCleanup(patcher.stop)


def counting_all_reduce():
    """Patches `torch.distributed.all_reduce` to count its calls."""
    return mock.patch.object(
        torch.distributed, "all_reduce", wraps=torch.distributed.all_reduce
    )


def replicated_parameters(mesh, shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    parameters = []
    for shape in shapes:
        value = torch.randn(shape, generator=generator)
        parameter = torch.nn.Parameter(
            distribute_tensor(value, mesh, [Replicate()])
        )
        parameter.register_post_accumulate_grad_hook(
            reducer.reduce_gradient_when_ready
        )
        parameters.append(parameter)
    return parameters


def mlp_loss(parameters, mesh, observe=None):
    """A chain of matmuls on a batch-sharded input; returns the loss."""
    x = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 48.0
    h = distribute_tensor(x, mesh, [Shard(0)])
    for i, weight in enumerate(parameters):
        h = torch.tanh(h @ weight)
        if i == 0 and observe is not None:
            h.register_hook(observe)
    return (h**2).sum()


def reference_gradients(mesh, shapes):
    """The gradients of `mlp_loss`'s parameters, without DTensors."""
    parameters = [
        torch.nn.Parameter(p.detach().full_tensor())
        for p in replicated_parameters(mesh, shapes)
    ]
    x = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 48.0
    h = x
    for weight in parameters:
        h = torch.tanh(h @ weight)
    (h**2).sum().backward()
    return [p.grad.numpy() for p in parameters]


class ReducerTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        self.mesh = one_process_mesh()
        self.shapes = [(8, 16), (16, 16), (16, 4)]
        # Reduce over the one-process mesh axis as if it were larger; an
        # all-reduce over one process leaves the values as they are.
        pretend_mesh_dims_of_size_two(self)

    def assert_reference_gradients(self, parameters):
        for parameter, expected in zip(
            parameters, reference_gradients(self.mesh, self.shapes)
        ):
            self.assertIsInstance(parameter.grad, DTensor)
            self.assertEqual(tuple(parameter.grad.placements), (Replicate(),))
            self.assertAllClose(
                parameter.grad.full_tensor().numpy(), expected, atol=1e-6
            )

    def test_gradients_are_reduced_to_parameter_placements(self):
        parameters = replicated_parameters(self.mesh, self.shapes)
        mlp_loss(parameters, self.mesh).backward()
        self.assert_reference_gradients(parameters)

    def test_each_backward_pass_has_a_reducer_of_its_own(self):
        parameters = replicated_parameters(self.mesh, self.shapes)
        before = reducer.current()
        mlp_loss(parameters, self.mesh).backward()
        # The finished pass's reducer was replaced by an empty one.
        after = reducer.current()
        self.assertIsNot(after, before)
        self.assertEqual(after.open, {})
        self.assertEqual(after.launched, [])
        self.assertFalse(after.finalizer_queued)
        self.assertIs(after.layouts, reducer.context().layouts)

    def test_hooks_on_another_thread_reach_the_same_reducer(self):
        # As autograd runs a CUDA parameter's hooks on a device thread:
        # the thread running backward fills the reducer the step's thread
        # reaches.
        parameters = replicated_parameters(self.mesh, self.shapes)
        loss = mlp_loss(parameters, self.mesh)
        pending = reducer.current()
        queued = []
        with mock.patch.object(
            reducer, "_finish_backward", lambda: queued.append(True)
        ):
            worker = threading.Thread(target=loss.backward)
            worker.start()
            worker.join()
        self.assertEqual(queued, [True])
        self.assertIs(reducer.current(), pending)
        self.assertEqual(len(pending.open), 1)
        reducer.discard_pending()

    def test_small_cap_sends_buckets_during_backward(self):
        parameters = replicated_parameters(self.mesh, self.shapes)
        launched_before_end = []

        def observe(grad):
            # Runs when backward reaches the first layer's output, before
            # the first layer's gradient exists.
            launched_before_end.append(len(reducer.current().launched))

        with mock.patch.dict(os.environ, {reducer.BUCKET_CAP_ENV_VAR: "0"}):
            with counting_all_reduce() as all_reduce:
                mlp_loss(parameters, self.mesh, observe=observe).backward()
        self.assertEqual(all_reduce.call_count, len(parameters))
        self.assertEqual(launched_before_end, [2])
        self.assert_reference_gradients(parameters)

    def test_first_bucket_of_a_cpu_mesh_is_not_cut_small(self):
        # 1.02 MiB of gradients: a 1 MiB first bucket, as DDP's, sends the
        # last two layers' in one bucket and the first layer's in another;
        # on a CPU mesh all three make one bucket, sent when backward ends.
        shapes = [(8, 512), (512, 512), (512, 4)]
        for first_cap_mb, all_reduces in ((None, 1), ("1", 2)):
            parameters = replicated_parameters(self.mesh, shapes)
            env = {}
            if first_cap_mb is not None:
                env[reducer.FIRST_BUCKET_CAP_ENV_VAR] = first_cap_mb
            with mock.patch.dict(os.environ, env):
                with counting_all_reduce() as all_reduce:
                    mlp_loss(parameters, self.mesh).backward()
            self.assertEqual(all_reduce.call_count, all_reduces)
            sizes = [c.args[0].numel() for c in all_reduce.call_args_list]
            self.assertEqual(sum(sizes), sum(np.prod(s) for s in shapes))

    def test_first_bucket_cap_by_mesh_device(self):
        cuda_mesh = mock.Mock(device_type="cuda")
        self.assertEqual(self.mesh.device_type, "cpu")
        self.assertEqual(
            reducer.first_bucket_cap_bytes(self.mesh), float("inf")
        )
        self.assertEqual(reducer.first_bucket_cap_bytes(cuda_mesh), 2**20)
        with mock.patch.dict(
            os.environ, {reducer.FIRST_BUCKET_CAP_ENV_VAR: "0.5"}
        ):
            for mesh in (self.mesh, cuda_mesh):
                self.assertEqual(reducer.first_bucket_cap_bytes(mesh), 2**19)
        # Later buckets take the full cap, and the first never exceeds it.
        with mock.patch.dict(os.environ, {reducer.BUCKET_CAP_ENV_VAR: "2"}):
            for mesh in (self.mesh, cuda_mesh):
                self.assertEqual(
                    reducer.bucket_cap_bytes(mesh, False), 2 * 2**20
                )
            self.assertEqual(
                reducer.bucket_cap_bytes(self.mesh, True), 2 * 2**20
            )
            self.assertEqual(reducer.bucket_cap_bytes(cuda_mesh, True), 2**20)

    def test_discarding_a_failed_backwards_buckets(self):
        parameters = replicated_parameters(self.mesh, self.shapes)

        def fail(grad):
            # Backward reaches the first layer's output after the later
            # layers' gradients joined their bucket.
            raise RuntimeError("backward failed")

        with self.assertRaisesRegex(RuntimeError, "backward failed"):
            mlp_loss(parameters, self.mesh, observe=fail).backward()
        # Autograd ran no finalizer: the buckets are left behind.
        self.assertTrue(reducer.current().finalizer_queued)
        self.assertNotEqual(reducer.current().open, {})
        reducer.discard_pending()
        for parameter in parameters:
            parameter.grad = None
        mlp_loss(parameters, self.mesh).backward()
        self.assert_reference_gradients(parameters)
        self.assertFalse(reducer.current().finalizer_queued)

    def test_discarding_waits_for_launched_buckets(self):
        parameters = replicated_parameters(self.mesh, self.shapes)

        def fail(grad):
            raise RuntimeError("backward failed")

        with mock.patch.dict(os.environ, {reducer.BUCKET_CAP_ENV_VAR: "0"}):
            with self.assertRaisesRegex(RuntimeError, "backward failed"):
                mlp_loss(parameters, self.mesh, observe=fail).backward()
        launched = reducer.current().launched
        self.assertEqual(len(launched), 2)
        with mock.patch(
            "keras.src.backend.torch.gradient_bucket.Bucket.abandon",
            autospec=True,
        ) as abandon:
            reducer.discard_pending()
        self.assertEqual(
            [call.args[0] for call in abandon.call_args_list], launched
        )
        for bucket in launched:
            bucket.work.wait()

    def test_gradient_outside_backward_is_redistributed_at_once(self):
        (parameter,) = replicated_parameters(self.mesh, [(4,)])
        parameter.grad = DTensor.from_local(
            torch.full((4,), 3.0), self.mesh, [Partial()], run_check=False
        )
        reducer.reduce_gradient_when_ready(parameter)
        self.assertEqual(tuple(parameter.grad.placements), (Replicate(),))
        self.assertAllClose(parameter.grad.to_local().numpy(), np.full(4, 3.0))
        self.assertEqual(reducer.current().open, {})

    def test_only_parameters_with_the_hook_are_reduced_by_buckets(self):
        (parameter,) = replicated_parameters(self.mesh, [(4,)])
        self.assertTrue(reducer.reduced_by_buckets(parameter))
        parameter._post_accumulate_grad_hooks.clear()
        self.assertFalse(reducer.reduced_by_buckets(parameter))
        plain = torch.nn.Parameter(torch.zeros(4))
        self.assertFalse(reducer.reduced_by_buckets(plain))


class SizeOneMeshAxisTest(testing.TestCase):
    def test_partial_sum_over_one_process_is_relabelled(self):
        mesh = one_process_mesh()
        parameters = replicated_parameters(mesh, [(8, 4)])
        with counting_all_reduce() as all_reduce:
            mlp_loss(parameters, mesh).backward()
        self.assertEqual(all_reduce.call_count, 0)
        self.assertEqual(tuple(parameters[0].grad.placements), (Replicate(),))
