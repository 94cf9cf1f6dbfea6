"""Tests of `local_views` (the crossings between DTensors and the local
tensors of local calls) on a one-process mesh."""

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import testing
from keras.src.backend.torch import local_views
from keras.src.backend.torch import torch_internals
from keras.src.distribution import distribution_lib as distribution_api


class LocalViewsTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        self.mesh = distribution_api.DeviceMesh(
            (1,), ("batch",), ["cpu:0"]
        ).backend_mesh

    def test_outputs_are_laid_out_and_differentiated_as_from_local(self):
        mesh = self.mesh
        values = torch.arange(12.0).reshape(4, 3)
        reference = DTensor.from_local(values, mesh, [Shard(0)])
        spec = torch_internals.spec_of(reference)
        for gradient_placement in (Shard(0), Replicate()):
            grads = []
            for make in (
                lambda local: local_views.FromLocal.apply(
                    local, spec, (Shard(0),)
                ),
                lambda local: DTensor.from_local(local, mesh, [Shard(0)]),
            ):
                local = values.clone().requires_grad_()
                out = make(local)
                self.assertIsInstance(out, DTensor)
                self.assertEqual(out.placements, (Shard(0),))
                self.assertEqual(out.shape, reference.shape)
                self.assertEqual(out.stride(), reference.stride())
                self.assertIsNot(torch_internals.spec_of(out), spec)
                # The output's gradient arrives with these placements.
                out.backward(
                    distribute_tensor(
                        torch.arange(12.0).reshape(4, 3) - 5.0,
                        mesh,
                        [gradient_placement],
                    )
                )
                grads.append(local.grad)
            self.assertNotIsInstance(grads[0], DTensor)
            np.testing.assert_array_equal(grads[0].numpy(), grads[1].numpy())
        # A partial output's gradient comes back replicated, as
        # `from_local`'s.
        local = torch.ones(3, requires_grad=True)
        partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
        out = local_views.FromLocal.apply(
            local, torch_internals.spec_of(partial), (Replicate(),)
        )
        out.sum().backward()
        np.testing.assert_array_equal(local.grad.numpy(), np.ones(3))
        # Where backward builds a graph, the gradient stays differentiable.
        local = values.clone().requires_grad_()
        out = local_views.FromLocal.apply(local, spec, (Shard(0),))
        (grad,) = torch.autograd.grad(
            (out * out).sum(), local, create_graph=True
        )
        self.assertTrue(grad.requires_grad)
        np.testing.assert_array_equal(grad.detach().numpy(), 2 * values)

    def test_local_view_shares_the_local_tensor_and_sends_back_a_dtensor(
        self,
    ):
        value = distribute_tensor(
            torch.arange(6.0).reshape(2, 3), self.mesh, [Replicate()]
        ).requires_grad_(True)
        spec = local_views.tensor_spec(
            self.mesh, (Partial(),), torch_internals.local_tensor(value)
        )
        view = local_views.LocalView.apply(value, spec)
        self.assertNotIsInstance(view, DTensor)
        self.assertEqual(
            view.untyped_storage().data_ptr(),
            torch_internals.local_tensor(value).untyped_storage().data_ptr(),
        )
        # The version counter is shared: in-place updates show.
        version = view._version
        with torch.no_grad():
            torch_internals.local_tensor(value).add_(1.0)
        self.assertEqual(view._version, version + 1)
        (gradient,) = torch.autograd.grad((view * 2.0).sum(), value)
        self.assertEqual(tuple(gradient.placements), (Partial(),))
        np.testing.assert_array_equal(
            gradient.to_local().numpy(), np.full((2, 3), 2.0)
        )

    def test_tensor_spec_holds_the_tensor_metadata(self):
        tensor = torch.zeros((4, 3)).t()
        spec = local_views.tensor_spec(self.mesh, (Replicate(),), tensor)
        self.assertEqual(spec.placements, (Replicate(),))
        self.assertEqual(tuple(spec.tensor_meta.shape), (3, 4))
        self.assertEqual(spec.tensor_meta.stride, (1, 3))
        self.assertEqual(spec.tensor_meta.dtype, torch.float32)
