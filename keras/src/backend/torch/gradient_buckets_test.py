"""Single-process tests of bucketed gradient reduction.

A one-process mesh still produces partial-sum gradients for replicated
parameters used with batch-sharded inputs, so the bucketing logic runs in
full here; values across processes are checked by the integration tests.
"""

import contextlib
import copy
import os
import sys
from unittest import mock

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Partial

from keras.src import testing
from keras.src.backend.torch import batch_local
from keras.src.backend.torch import distribution_lib
from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import gradient_buckets
from keras.src.distribution import distribution_lib as distribution_api


def one_process_mesh():
    mesh = distribution_api.DeviceMesh((1,), ("batch",), ["cpu:0"])
    return distribution_lib._to_backend_mesh(mesh)


def pretend_mesh_dims_of_size_two(test_case):
    """Plans reductions as if every mesh dim had 2 processes, in one test.

    Reductions planned under the pretence are dropped afterwards.
    """
    for patcher in (
        mock.patch.object(
            gradient_buckets, "_mesh_dim_size", lambda mesh, dim: 2
        ),
        mock.patch.dict(gradient_buckets._REDUCTIONS, clear=True),
    ):
        patcher.start()
        test_case.addCleanup(patcher.stop)


def counting_all_reduce():
    """Patches `torch.distributed.all_reduce` to count its calls."""
    return mock.patch.object(
        torch.distributed, "all_reduce", wraps=torch.distributed.all_reduce
    )


@contextlib.contextmanager
def calls_from_outside_torch(owner, name):
    """Records the callers of the static method `owner.name` that are not
    torch's own code, while the block runs."""
    upstream = getattr(owner, name)
    torch_dir = os.path.dirname(torch.__file__)
    callers = []

    def recorded(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if not caller.startswith(torch_dir):
            callers.append(caller)
        return upstream(*args, **kwargs)

    with mock.patch.object(owner, name, staticmethod(recorded)):
        yield callers


def replicated_parameters(mesh, shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    parameters = []
    for shape in shapes:
        value = torch.randn(shape, generator=generator)
        parameter = torch.nn.Parameter(
            distribute_tensor(value, mesh, [Replicate()])
        )
        parameter.register_post_accumulate_grad_hook(
            gradient_buckets.reduce_gradient_when_ready
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


class GradientBucketsTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        self.mesh = one_process_mesh()
        self.shapes = [(8, 16), (16, 16), (16, 4)]
        # Reduce over the one-process mesh axis as if it were larger; an
        # all-reduce over one process leaves the values as they are.
        pretend_mesh_dims_of_size_two(self)

    def reference_gradients(self):
        parameters = [
            torch.nn.Parameter(p.detach().full_tensor())
            for p in replicated_parameters(self.mesh, self.shapes)
        ]
        x = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 48.0
        h = x
        for weight in parameters:
            h = torch.tanh(h @ weight)
        (h**2).sum().backward()
        return [p.grad.numpy() for p in parameters]

    def test_gradients_are_reduced_to_parameter_placements(self):
        parameters = replicated_parameters(self.mesh, self.shapes)
        mlp_loss(parameters, self.mesh).backward()
        for parameter, expected in zip(parameters, self.reference_gradients()):
            self.assertIsInstance(parameter.grad, DTensor)
            self.assertEqual(tuple(parameter.grad.placements), (Replicate(),))
            self.assertAllClose(
                parameter.grad.full_tensor().numpy(), expected, atol=1e-6
            )

    def test_one_bucket_holds_every_small_gradient(self):
        parameters = replicated_parameters(self.mesh, self.shapes)
        with counting_all_reduce() as all_reduce:
            mlp_loss(parameters, self.mesh).backward()
        self.assertEqual(all_reduce.call_count, 1)
        flat = all_reduce.call_args.args[0]
        self.assertEqual(flat.numel(), sum(np.prod(s) for s in self.shapes))
        # Gradients are views of the reduced bucket: no extra copies.
        for parameter in parameters:
            self.assertEqual(
                parameter.grad.to_local().untyped_storage().data_ptr(),
                flat.untyped_storage().data_ptr(),
            )

    def test_small_cap_sends_buckets_during_backward(self):
        parameters = replicated_parameters(self.mesh, self.shapes)
        launched_before_end = []

        def observe(grad):
            # Runs when backward reaches the first layer's output, before
            # the first layer's gradient exists.
            launched_before_end.append(len(gradient_buckets._PENDING.launched))

        with mock.patch.dict(
            os.environ, {gradient_buckets.BUCKET_CAP_ENV_VAR: "0"}
        ):
            with counting_all_reduce() as all_reduce:
                mlp_loss(parameters, self.mesh, observe=observe).backward()
        self.assertEqual(all_reduce.call_count, len(parameters))
        self.assertEqual(launched_before_end, [2])
        for parameter, expected in zip(parameters, self.reference_gradients()):
            self.assertAllClose(
                parameter.grad.full_tensor().numpy(), expected, atol=1e-6
            )

    def test_first_bucket_of_a_cpu_mesh_is_not_cut_small(self):
        # 1.02 MiB of gradients: a 1 MiB first bucket, as DDP's, sends the
        # last two layers' in one bucket and the first layer's in another;
        # on a CPU mesh all three make one bucket, sent when backward ends.
        shapes = [(8, 512), (512, 512), (512, 4)]
        for first_cap_mb, all_reduces in ((None, 1), ("1", 2)):
            parameters = replicated_parameters(self.mesh, shapes)
            env = {}
            if first_cap_mb is not None:
                env[gradient_buckets.FIRST_BUCKET_CAP_ENV_VAR] = first_cap_mb
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
            gradient_buckets._first_bucket_cap_bytes(self.mesh), float("inf")
        )
        self.assertEqual(
            gradient_buckets._first_bucket_cap_bytes(cuda_mesh), 2**20
        )
        with mock.patch.dict(
            os.environ, {gradient_buckets.FIRST_BUCKET_CAP_ENV_VAR: "0.5"}
        ):
            for mesh in (self.mesh, cuda_mesh):
                self.assertEqual(
                    gradient_buckets._first_bucket_cap_bytes(mesh), 2**19
                )
        # Later buckets take the full cap, and the first never exceeds it.
        with mock.patch.dict(
            os.environ, {gradient_buckets.BUCKET_CAP_ENV_VAR: "2"}
        ):
            self.assertEqual(
                gradient_buckets._bucket_cap_bytes(self.mesh), 2 * 2**20
            )
            self.assertEqual(
                gradient_buckets._bucket_cap_bytes(cuda_mesh), 2**20
            )

    def test_discarding_a_failed_backwards_buckets(self):
        parameters = replicated_parameters(self.mesh, self.shapes)

        def fail(grad):
            # Backward reaches the first layer's output after the later
            # layers' gradients joined their bucket.
            raise RuntimeError("backward failed")

        with self.assertRaisesRegex(RuntimeError, "backward failed"):
            mlp_loss(parameters, self.mesh, observe=fail).backward()
        # Autograd ran no finalizer: the buckets are left behind.
        self.assertTrue(gradient_buckets._PENDING.finalizer_queued)
        self.assertNotEqual(gradient_buckets._PENDING.open, {})
        gradient_buckets.discard_pending()
        for parameter in parameters:
            parameter.grad = None
        mlp_loss(parameters, self.mesh).backward()
        for parameter, expected in zip(parameters, self.reference_gradients()):
            self.assertAllClose(
                parameter.grad.full_tensor().numpy(), expected, atol=1e-6
            )
        self.assertFalse(gradient_buckets._PENDING.finalizer_queued)

    def partial_scalar(self, value, reduce_op="avg", dtype=torch.float32):
        return DTensor.from_local(
            torch.tensor(value, dtype=dtype),
            self.mesh,
            [Partial(reduce_op)],
            run_check=False,
        )

    def test_a_partial_value_rides_the_last_bucket(self):
        parameters = replicated_parameters(self.mesh, self.shapes)
        loss = self.partial_scalar(3.0)
        with counting_all_reduce() as all_reduce:
            with gradient_buckets.reduced_with_gradients(loss) as rider:
                mlp_loss(parameters, self.mesh).backward()
        # One collective: the gradients' bucket, one element longer.
        self.assertEqual(all_reduce.call_count, 1)
        flat = all_reduce.call_args.args[0]
        self.assertEqual(flat.numel(), sum(np.prod(s) for s in self.shapes) + 1)
        value = rider.value()
        self.assertIsInstance(value, DTensor)
        self.assertEqual(tuple(value.placements), (Replicate(),))
        self.assertEqual(value.shape, ())
        # The sum over the (pretended) 2 processes, averaged: over this one
        # process the all-reduce leaves 3.0, divided by 2.
        self.assertEqual(value.to_local().item(), 1.5)
        for parameter, expected in zip(parameters, self.reference_gradients()):
            self.assertAllClose(
                parameter.grad.full_tensor().numpy(), expected, atol=1e-6
            )
        self.assertEqual(gradient_buckets._PENDING.riders, [])

    def test_a_partial_sum_rides_undivided(self):
        parameters = replicated_parameters(self.mesh, self.shapes)
        loss = self.partial_scalar(3.0, reduce_op="sum")
        with gradient_buckets.reduced_with_gradients(loss) as rider:
            mlp_loss(parameters, self.mesh).backward()
        self.assertEqual(rider.value().to_local().item(), 3.0)

    def test_values_that_cannot_ride_are_left_as_they_are(self):
        replicated = distribute_tensor(
            torch.tensor(2.0), self.mesh, [Replicate()]
        )
        cases = {
            "replicated": replicated,
            "plain": torch.tensor(2.0),
            "other dtype": self.partial_scalar(2.0, dtype=torch.float64),
            "max": self.partial_scalar(2.0, reduce_op="max"),
        }
        for name, value in cases.items():
            with self.subTest(name):
                parameters = replicated_parameters(self.mesh, self.shapes)
                with counting_all_reduce() as all_reduce:
                    with gradient_buckets.reduced_with_gradients(
                        value
                    ) as rider:
                        mlp_loss(parameters, self.mesh).backward()
                self.assertIs(rider.value(), value)
                flat = all_reduce.call_args.args[0]
                self.assertEqual(
                    flat.numel(), sum(np.prod(s) for s in self.shapes)
                )

    def test_no_open_bucket_at_the_end_leaves_the_value_alone(self):
        parameters = replicated_parameters(self.mesh, self.shapes)
        loss = self.partial_scalar(3.0)
        with mock.patch.dict(
            os.environ, {gradient_buckets.BUCKET_CAP_ENV_VAR: "0"}
        ):
            with gradient_buckets.reduced_with_gradients(loss) as rider:
                mlp_loss(parameters, self.mesh).backward()
        self.assertIs(rider.value(), loss)

    def test_a_value_given_without_backward_does_not_ride_later(self):
        loss = self.partial_scalar(3.0)
        with gradient_buckets.reduced_with_gradients(loss) as rider:
            self.assertEqual(gradient_buckets._PENDING.riders, [rider])
        self.assertEqual(gradient_buckets._PENDING.riders, [])
        parameters = replicated_parameters(self.mesh, self.shapes)
        with counting_all_reduce() as all_reduce:
            mlp_loss(parameters, self.mesh).backward()
        flat = all_reduce.call_args.args[0]
        self.assertEqual(flat.numel(), sum(np.prod(s) for s in self.shapes))
        self.assertIs(rider.value(), loss)

    def test_partial_sum_reduction_plans(self):
        partial = (Partial(),)
        self.assertEqual(
            gradient_buckets._partial_sum_reduction(
                self.mesh, partial, (Replicate(),)
            ),
            ((0,), "sum"),
        )
        # A reduce-scatter to a sharded parameter is left to DTensor.
        self.assertIsNone(
            gradient_buckets._partial_sum_reduction(
                self.mesh, partial, (Shard(0),)
            )
        )

    def test_gradient_outside_backward_is_redistributed_at_once(self):
        (parameter,) = replicated_parameters(self.mesh, [(4,)])
        parameter.grad = DTensor.from_local(
            torch.full((4,), 3.0), self.mesh, [Partial()], run_check=False
        )
        gradient_buckets.reduce_gradient_when_ready(parameter)
        self.assertEqual(tuple(parameter.grad.placements), (Replicate(),))
        self.assertAllClose(parameter.grad.to_local().numpy(), np.full(4, 3.0))
        self.assertEqual(gradient_buckets._PENDING.open, {})

    def test_sharded_gradient_does_not_keep_the_full_buffer(self):
        parameter = torch.nn.Parameter(
            distribute_tensor(torch.zeros(8, 4), self.mesh, [Shard(0)])
        )
        # The local gradient is a slice of a buffer twice its size.
        buffer = torch.arange(64, dtype=torch.float32).reshape(16, 4)
        grad = DTensor.from_local(
            buffer[:8], self.mesh, [Replicate()], run_check=False
        )
        lean = gradient_buckets._redistribute_gradient(grad, parameter)
        local = lean.to_local()
        self.assertEqual(
            local.untyped_storage().nbytes(),
            local.numel() * local.element_size(),
        )
        self.assertAllClose(lean.full_tensor().numpy(), buffer[:8].numpy())


class TwoDimensionalMeshTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        mesh = distribution_api.DeviceMesh(
            (1, 1), ("batch", "model"), ["cpu:0"]
        )
        self.mesh = distribution_lib._to_backend_mesh(mesh)
        pretend_mesh_dims_of_size_two(self)

    def test_placements_sharing_a_reduction_share_a_bucket(self):
        # Column-, bias- and row-sharded parameters on "model": their
        # gradients differ in placement on "model" and are all partial
        # sums over "batch", so one all-reduce over "batch" serves them.
        generator = torch.Generator().manual_seed(0)
        values = [
            torch.randn(shape, generator=generator)
            for shape in [(8, 16), (16,), (16, 4)]
        ]
        placements = [
            [Replicate(), Shard(1)],
            [Replicate(), Shard(0)],
            [Replicate(), Shard(0)],
        ]
        parameters = []
        for value, placement in zip(values, placements):
            parameter = torch.nn.Parameter(
                distribute_tensor(value, self.mesh, placement)
            )
            parameter.register_post_accumulate_grad_hook(
                gradient_buckets.reduce_gradient_when_ready
            )
            parameters.append(parameter)
        x = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 48.0
        inputs = distribute_tensor(x, self.mesh, [Shard(0), Replicate()])
        with counting_all_reduce() as all_reduce:
            kernel_up, bias_up, kernel_down = parameters
            hidden = torch.tanh(inputs @ kernel_up + bias_up)
            ((hidden @ kernel_down) ** 2).sum().backward()
        self.assertEqual(all_reduce.call_count, 1)

        reference = [torch.nn.Parameter(v.clone()) for v in values]
        hidden = torch.tanh(x @ reference[0] + reference[1])
        ((hidden @ reference[2]) ** 2).sum().backward()
        for parameter, placement, expected in zip(
            parameters, placements, reference
        ):
            self.assertEqual(list(parameter.grad.placements), placement)
            self.assertAllClose(
                parameter.grad.full_tensor().numpy(),
                expected.grad.numpy(),
                atol=1e-5,
            )


def local_view(parameter, mesh):
    """A local call's view of `parameter` (see `batch_local`)."""
    spec = batch_local._spec(mesh, (Partial(),), parameter._local_tensor)
    return batch_local._LocalView.apply(parameter, spec)


def gradient_leaf(parameter):
    """A local call's view of `parameter` in a step that accumulates."""
    return gradient_buckets.gradient_leaf(
        parameter, (Partial(),), parameter._local_tensor
    )


def shared_weight_loss(weight, other, mesh, reads):
    """A loss reading `weight` once per item of `reads`, plus `other`.

    Each read is "local" (a local view, as a layer running on local
    tensors makes), "leaf" (a gradient leaf, as it makes in Keras's train
    step) or "dtensor" (the DTensor itself).
    """
    x = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 48.0
    h = distribute_tensor(x, mesh, [Shard(0)]).to_local()
    for read in reads:
        if read == "local":
            h = torch.tanh(h @ local_view(weight, mesh))
        elif read == "leaf":
            h = torch.tanh(h @ gradient_leaf(weight))
        else:
            h = DTensor.from_local(h, mesh, [Shard(0)], run_check=False)
            h = torch.tanh(h @ weight).to_local()
    h = h @ local_view(other, mesh)
    return (h**2).sum()


def expected_gradients(mesh, reads):
    """The gradients of `shared_weight_loss`'s parameters, without
    DTensors."""
    weight, other = [
        torch.nn.Parameter(p.detach().full_tensor())
        for p in replicated_parameters(mesh, [(8, 8), (8, 3)])
    ]
    x = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 48.0
    h = x
    for _ in reads:
        h = torch.tanh(h @ weight)
    ((h @ other) ** 2).sum().backward()
    return weight.grad.numpy(), other.grad.numpy()


class LocalViewGradientTest(testing.TestCase):
    """Gradients of local views join the buckets without a DTensor."""

    def setUp(self):
        super().setUp()
        self.mesh = one_process_mesh()
        pretend_mesh_dims_of_size_two(self)

    def check(self, reads, cap_mb, all_reduces):
        weight, other = replicated_parameters(self.mesh, [(8, 8), (8, 3)])
        with (
            mock.patch.dict(
                os.environ, {gradient_buckets.BUCKET_CAP_ENV_VAR: cap_mb}
            ),
            counting_all_reduce() as all_reduce,
            mock.patch.object(
                dtensor_layouts,
                "dtensor_from_spec",
                wraps=dtensor_layouts.dtensor_from_spec,
            ) as from_spec,
        ):
            shared_weight_loss(weight, other, self.mesh, reads).backward()
        self.assertEqual(all_reduce.call_count, all_reduces)
        # Only the reduced gradients are DTensors built from specs: one per
        # parameter, however often it was read.
        self.assertEqual(from_spec.call_count, 2)
        for parameter, expected in zip(
            (weight, other), expected_gradients(self.mesh, reads)
        ):
            self.assertEqual(tuple(parameter.grad.placements), (Replicate(),))
            self.assertAllClose(
                parameter.grad.full_tensor().numpy(), expected, atol=1e-6
            )
        self.assertEqual(gradient_buckets._PENDING.open, {})

    def test_one_read(self):
        self.check(["local"], "25", all_reduces=1)

    def test_two_reads_summed_in_an_open_bucket(self):
        self.check(["local", "local"], "25", all_reduces=1)

    def test_two_reads_summed_after_sent_buckets(self):
        # Every gradient sends its bucket: the weight's two reads reach
        # two buckets, and the second is added to the first's result.
        self.check(["local", "local"], "0", all_reduces=3)

    def test_gradient_leaf_reads(self):
        self.check(["leaf"], "25", all_reduces=1)
        self.check(["leaf", "local"], "25", all_reduces=1)
        # The DTensor read's partial gradient joins the same bucket.
        self.check(["leaf", "dtensor", "leaf"], "25", all_reduces=1)
        # Every gradient sends its bucket: each read's gradient is reduced
        # by itself and the weight's are added up after.
        self.check(["leaf", "leaf"], "0", all_reduces=3)

    def test_gradient_leaves_send_buckets_as_gradients_complete(self):
        # Views kept from an earlier step run after every operator made
        # since; a leaf's gradient joins its bucket as soon as it is
        # complete. With a bucket per gradient, `other` (the last layer)
        # is sent before the first layer's operators run backward.
        weight, other = replicated_parameters(self.mesh, [(8, 8), (8, 3)])
        old_views = [
            local_view(weight, self.mesh),
            local_view(other, self.mesh),
        ]
        leaves = [gradient_leaf(weight), gradient_leaf(other)]
        x = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 48.0
        order = []

        def loss(first, second):
            h = torch.tanh(x @ first)
            h.register_hook(lambda grad: order.append("first layer"))
            return ((h @ second) ** 2).sum()

        for views, expected in (
            (old_views, ["first layer", "sent", "sent"]),
            (leaves, ["sent", "first layer", "sent"]),
        ):
            order.clear()
            weight.grad = other.grad = None
            with (
                mock.patch.dict(
                    os.environ, {gradient_buckets.BUCKET_CAP_ENV_VAR: "0"}
                ),
                mock.patch.object(
                    torch.distributed,
                    "all_reduce",
                    side_effect=lambda *a, **k: (
                        order.append("sent")
                        or torch.distributed.distributed_c10d.all_reduce(
                            *a, **k
                        )
                    ),
                ),
            ):
                loss(*views).backward()
            self.assertEqual(order, expected)
            self.assertIsNone(leaves[0].grad)
            self.assertIsNone(leaves[1].grad)
            for parameter, want in zip(
                (weight, other), expected_gradients(self.mesh, ["local"])
            ):
                self.assertAllClose(
                    parameter.grad.full_tensor().numpy(), want, atol=1e-6
                )

    def test_gradient_leaf_refuses_a_graph_of_its_gradient(self):
        weight, other = replicated_parameters(self.mesh, [(8, 8), (8, 3)])
        loss = shared_weight_loss(weight, other, self.mesh, ["leaf"])
        with self.assertRaisesRegex(RuntimeError, "create_graph"):
            loss.backward(create_graph=True)
        gradient_buckets._PENDING = gradient_buckets._PendingReduction()

    def test_no_gradient_leaf_without_an_all_reduce(self):
        # A parameter whose gradients the buckets do not reduce, or whose
        # batch axes hold one process, is read through `_LocalView`.
        (plain,) = replicated_parameters(self.mesh, [(8, 8)])
        plain._post_accumulate_grad_hooks.clear()
        self.assertIsNone(gradient_leaf(plain))
        with mock.patch.dict(gradient_buckets._REDUCTIONS, clear=True):
            with mock.patch.object(
                gradient_buckets, "_mesh_dim_size", lambda mesh, dim: 1
            ):
                (one,) = replicated_parameters(self.mesh, [(8, 8)])
                self.assertIsNone(gradient_leaf(one))

    def test_local_and_dtensor_reads_are_summed(self):
        weight, other = replicated_parameters(self.mesh, [(8, 8), (8, 3)])
        shared_weight_loss(
            weight, other, self.mesh, ["local", "dtensor", "local"]
        ).backward()
        for parameter, expected in zip(
            (weight, other),
            expected_gradients(self.mesh, ["local", "dtensor", "local"]),
        ):
            self.assertEqual(tuple(parameter.grad.placements), (Replicate(),))
            self.assertAllClose(
                parameter.grad.full_tensor().numpy(), expected, atol=1e-6
            )

    def test_a_second_backward_accumulates(self):
        # Without resetting the gradients, a second backward pass adds to
        # them, as autograd does: through local views alone, and through
        # local views and DTensor reads together.
        for reads in (["local"], ["local", "dtensor", "local"]):
            weight, other = replicated_parameters(self.mesh, [(8, 8), (8, 3)])
            for _ in range(2):
                shared_weight_loss(weight, other, self.mesh, reads).backward()
            for parameter, expected in zip(
                (weight, other), expected_gradients(self.mesh, reads)
            ):
                self.assertEqual(
                    tuple(parameter.grad.placements), (Replicate(),)
                )
                self.assertAllClose(
                    parameter.grad.full_tensor().numpy(),
                    2 * expected,
                    atol=1e-5,
                )

    def test_autograd_grad_gets_partial_dtensors(self):
        # `torch.autograd.grad` accumulates into no parameter: the views
        # hand autograd their gradients as partial-sum DTensors.
        weight, other = replicated_parameters(self.mesh, [(8, 8), (8, 3)])
        loss = shared_weight_loss(weight, other, self.mesh, ["local"])
        grads = torch.autograd.grad(loss, [weight, other])
        for grad, expected in zip(
            grads, expected_gradients(self.mesh, ["local"])
        ):
            self.assertEqual(tuple(grad.placements), (Partial(),))
            self.assertAllClose(grad.to_local().numpy(), expected, atol=1e-6)
        self.assertIsNone(weight.grad)
        self.assertEqual(gradient_buckets._PENDING.open, {})

    def test_backward_to_other_inputs_leaves_parameters_alone(self):
        weight, other = replicated_parameters(self.mesh, [(8, 8), (8, 3)])
        loss = shared_weight_loss(weight, other, self.mesh, ["local"])
        loss.backward(inputs=[other])
        self.assertIsNone(weight.grad)
        self.assertEqual(tuple(other.grad.placements), (Replicate(),))


class SizeOneMeshAxisTest(testing.TestCase):
    def test_partial_sum_over_one_process_is_relabelled(self):
        mesh = one_process_mesh()
        parameters = replicated_parameters(mesh, [(8, 4)])
        with counting_all_reduce() as all_reduce:
            mlp_loss(parameters, mesh).backward()
        self.assertEqual(all_reduce.call_count, 0)
        self.assertEqual(tuple(parameters[0].grad.placements), (Replicate(),))

    def test_local_view_gradients_go_to_their_parameters_at_once(self):
        mesh = one_process_mesh()
        for reads in (["local"], ["local", "local"], ["local", "dtensor"]):
            with self.subTest(reads=reads):
                weight, other = replicated_parameters(mesh, [(8, 8), (8, 3)])
                with (
                    counting_all_reduce() as all_reduce,
                    mock.patch.object(
                        gradient_buckets, "_add", wraps=gradient_buckets._add
                    ) as bucketed,
                    calls_from_outside_torch(DTensor, "from_local") as calls,
                ):
                    loss = shared_weight_loss(weight, other, mesh, reads)
                    loss.backward()
                self.assertEqual(all_reduce.call_count, 0)
                self.assertEqual(bucketed.call_count, 0)
                # No gradient was made a DTensor but from its parameter's
                # spec: `from_local` is called only by the loss's own
                # DTensor read, in forward (torch's calls, as in
                # `to_local`'s backward, vary with its version).
                self.assertEqual(len(calls), reads.count("dtensor"))
                for parameter, expected in zip(
                    (weight, other), expected_gradients(mesh, reads)
                ):
                    self.assertEqual(
                        tuple(parameter.grad.placements), (Replicate(),)
                    )
                    self.assertAllClose(
                        parameter.grad.full_tensor().numpy(),
                        expected,
                        atol=1e-6,
                    )


class DTensorFromSpecTest(testing.TestCase):
    def test_same_dtensor_as_the_constructor(self):
        mesh = one_process_mesh()
        (parameter,) = replicated_parameters(mesh, [(8, 4)])
        local = torch.arange(32, dtype=torch.float32).reshape(8, 4)
        made = dtensor_layouts.dtensor_from_spec(
            local, copy.copy(parameter._spec)
        )
        constructed = DTensor(
            local, copy.copy(parameter._spec), requires_grad=False
        )
        for dtensor in (made, constructed):
            self.assertIs(type(dtensor), DTensor)
            self.assertIs(dtensor._local_tensor, local)
            self.assertFalse(dtensor.requires_grad)
            self.assertIsNone(dtensor.grad_fn)
        # A spec copy is `copy.copy`'s.
        spec = parameter._spec
        copied = dtensor_layouts.copy_spec(spec)
        self.assertIsNot(copied, spec)
        self.assertEqual(vars(copied), vars(copy.copy(spec)))
        self.assertEqual(hash(copied), hash(spec))
        # Whatever `DTensor.__init__` sets, the helper must set too.
        self.assertEqual(set(vars(made)), set(vars(constructed)))
        self.assertEqual(made._spec, constructed._spec)
        self.assertEqual(made.shape, constructed.shape)
        self.assertEqual(made.stride(), constructed.stride())
        self.assertAllClose((made * 2).full_tensor().numpy(), 2 * local.numpy())
