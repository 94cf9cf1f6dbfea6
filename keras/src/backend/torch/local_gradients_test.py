"""Gradients of local views of parameters join the reducer's buckets."""

import contextlib
import os
import sys
from unittest import mock

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Partial

from keras.src import testing
from keras.src.backend.torch import bucket_assignment
from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import local_gradients
from keras.src.backend.torch import reducer
from keras.src.backend.torch import reducer_test
from keras.src.backend.torch import torch_internals


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


class _LocalView(torch.autograd.Function):
    """A local call's view of a parameter, as `batch_local` makes one:
    its gradient joins the buckets, else reaches autograd as a partial
    DTensor."""

    @staticmethod
    def forward(ctx, value, mesh):
        ctx.mesh = mesh
        return torch_internals.local_tensor(value).detach()

    @staticmethod
    def backward(ctx, grad):
        placements = (Partial(),)
        if local_gradients.reduce_local_gradient(
            ctx.next_functions[0][0], grad, placements
        ):
            return None, None
        return DTensor.from_local(grad, ctx.mesh, placements), None


def local_view(parameter, mesh):
    """A local call's view of `parameter`."""
    return _LocalView.apply(parameter, mesh)


def gradient_leaf(parameter):
    """A local call's view of `parameter` in a step that accumulates."""
    return local_gradients.gradient_leaf(
        parameter, (Partial(),), torch_internals.local_tensor(parameter)
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
        for p in reducer_test.replicated_parameters(mesh, [(8, 8), (8, 3)])
    ]
    x = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 48.0
    h = x
    for _ in reads:
        h = torch.tanh(h @ weight)
    ((h @ other) ** 2).sum().backward()
    return weight.grad.numpy(), other.grad.numpy()


def weight_and_other(mesh):
    return reducer_test.replicated_parameters(mesh, [(8, 8), (8, 3)])


class LocalViewGradientTest(testing.TestCase):
    """Gradients of local views join the buckets without a DTensor."""

    def setUp(self):
        super().setUp()
        self.mesh = reducer_test.one_process_mesh()
        reducer_test.pretend_mesh_dims_of_size_two(self)

    def assert_gradients(self, parameters, reads, scale=1, atol=1e-6):
        for parameter, expected in zip(
            parameters, expected_gradients(self.mesh, reads)
        ):
            self.assertEqual(tuple(parameter.grad.placements), (Replicate(),))
            self.assertAllClose(
                parameter.grad.full_tensor().numpy(),
                scale * expected,
                atol=atol,
            )

    def check(self, reads, cap_mb, all_reduces):
        weight, other = weight_and_other(self.mesh)
        with (
            mock.patch.dict(os.environ, {reducer.BUCKET_CAP_ENV_VAR: cap_mb}),
            reducer_test.counting_all_reduce() as all_reduce,
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
        self.assert_gradients((weight, other), reads)
        self.assertEqual(reducer.current().open, {})

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
        weight, other = weight_and_other(self.mesh)
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

        def sent(*args, **kwargs):
            order.append("sent")
            return torch.distributed.distributed_c10d.all_reduce(
                *args, **kwargs
            )

        for views, expected in (
            (old_views, ["first layer", "sent", "sent"]),
            (leaves, ["sent", "first layer", "sent"]),
        ):
            order.clear()
            weight.grad = other.grad = None
            with (
                mock.patch.dict(os.environ, {reducer.BUCKET_CAP_ENV_VAR: "0"}),
                mock.patch.object(
                    torch.distributed, "all_reduce", side_effect=sent
                ),
            ):
                loss(*views).backward()
            self.assertEqual(order, expected)
            self.assertIsNone(leaves[0].grad)
            self.assertIsNone(leaves[1].grad)
            self.assert_gradients((weight, other), ["local"])

    def test_gradient_leaf_refuses_a_graph_of_its_gradient(self):
        weight, other = weight_and_other(self.mesh)
        loss = shared_weight_loss(weight, other, self.mesh, ["leaf"])
        with self.assertRaisesRegex(RuntimeError, "create_graph"):
            loss.backward(create_graph=True)
        reducer.discard_pending()

    def test_no_gradient_leaf_without_an_all_reduce(self):
        # A parameter whose gradients the buckets do not reduce, or whose
        # batch axes hold one process, is read through a local view.
        (plain,) = reducer_test.replicated_parameters(self.mesh, [(8, 8)])
        plain._post_accumulate_grad_hooks.clear()
        self.assertIsNone(gradient_leaf(plain))
        with (
            mock.patch.object(
                reducer.context(),
                "assignment",
                bucket_assignment.BucketAssignment(),
            ),
            mock.patch.object(
                bucket_assignment, "mesh_dim_size", lambda mesh, dim: 1
            ),
        ):
            (one,) = reducer_test.replicated_parameters(self.mesh, [(8, 8)])
            self.assertIsNone(gradient_leaf(one))

    def test_local_and_dtensor_reads_are_summed(self):
        weight, other = weight_and_other(self.mesh)
        reads = ["local", "dtensor", "local"]
        shared_weight_loss(weight, other, self.mesh, reads).backward()
        self.assert_gradients((weight, other), reads)

    def test_a_second_backward_accumulates(self):
        # Without resetting the gradients, a second backward pass adds to
        # them, as autograd does: through local views alone, and through
        # local views and DTensor reads together.
        for reads in (["local"], ["local", "dtensor", "local"]):
            weight, other = weight_and_other(self.mesh)
            for _ in range(2):
                shared_weight_loss(weight, other, self.mesh, reads).backward()
            self.assert_gradients((weight, other), reads, scale=2, atol=1e-5)

    def test_autograd_grad_gets_partial_dtensors(self):
        # `torch.autograd.grad` accumulates into no parameter: the views
        # hand autograd their gradients as partial-sum DTensors.
        weight, other = weight_and_other(self.mesh)
        loss = shared_weight_loss(weight, other, self.mesh, ["local"])
        grads = torch.autograd.grad(loss, [weight, other])
        for grad, expected in zip(
            grads, expected_gradients(self.mesh, ["local"])
        ):
            self.assertEqual(tuple(grad.placements), (Partial(),))
            self.assertAllClose(grad.to_local().numpy(), expected, atol=1e-6)
        self.assertIsNone(weight.grad)
        self.assertEqual(reducer.current().open, {})

    def test_backward_to_other_inputs_leaves_parameters_alone(self):
        weight, other = weight_and_other(self.mesh)
        loss = shared_weight_loss(weight, other, self.mesh, ["local"])
        loss.backward(inputs=[other])
        self.assertIsNone(weight.grad)
        self.assertEqual(tuple(other.grad.placements), (Replicate(),))


class SizeOneMeshAxisTest(testing.TestCase):
    def test_local_view_gradients_go_to_their_parameters_at_once(self):
        mesh = reducer_test.one_process_mesh()
        for reads in (["local"], ["local", "local"], ["local", "dtensor"]):
            with self.subTest(reads=reads):
                weight, other = weight_and_other(mesh)
                with (
                    reducer_test.counting_all_reduce() as all_reduce,
                    mock.patch.object(
                        reducer.Reducer,
                        "add",
                        autospec=True,
                        side_effect=reducer.Reducer.add,
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
