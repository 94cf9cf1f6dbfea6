"""Autograd functions between DTensors and the tensors of local calls.

A local call (`batch_local`) crosses between DTensors and plain local
tensors twice, each time with a spec made once, not on every call:

- `LocalView`: the local tensor of a DTensor variable value, as
  `DTensor.to_local(grad_placements=...)`; its gradient joins the
  gradient buckets, or goes back to the value as a DTensor.
- `FromLocal`: a local call's output as a DTensor with its first call's
  spec, as `DTensor.from_local(local, mesh, placements, shape=...,
  stride=...)`.

Contract: neither issues a collective in forward. In backward,
`FromLocal` redistributes a gradient whose placements are not the
expected ones, and `LocalView` hands its gradient to `local_gradients`
where they reduce it.
"""

import torch

from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import local_gradients
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import TensorMeta


def tensor_spec(mesh, placements, tensor):
    """A spec of `tensor`'s shape, stride and dtype (global = local here)."""
    return DTensorSpec(
        mesh,
        placements,
        tensor_meta=TensorMeta(tensor.shape, tensor.stride(), tensor.dtype),
    )


class FromLocal(torch.autograd.Function):
    """A local call's output as a DTensor with the first call's spec.

    As `DTensor.from_local(local, mesh, placements, shape=..., stride=...)`
    with the spec made once per plan output rather than once per call.
    Its gradient is the local tensor of the output's gradient, brought
    first to `gradient_placements` (the output's, `Replicate` where they
    are `Partial`, as `from_local`'s) where it has others.
    """

    @staticmethod
    def forward(ctx, local, spec, gradient_placements):
        ctx.placements = gradient_placements
        ctx.set_materialize_grads(False)
        # Around a new tensor object sharing `local`'s storage, as
        # `from_local`; autograd makes the DTensor this function's output.
        return dtensor_layouts.dtensor_from_spec(
            local.detach(), dtensor_layouts.copy_spec(spec)
        )

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None
        if torch_internals.spec_of(grad).placements != ctx.placements:
            grad = grad.redistribute(grad.device_mesh, ctx.placements)
        if torch.is_grad_enabled():
            # Backward builds a graph: the gradient stays differentiable.
            return grad.to_local(), None, None
        return torch_internals.local_tensor(grad), None, None


class LocalView(torch.autograd.Function):
    """The local tensor of a replicated DTensor variable, for a local call.

    As `DTensor.to_local(grad_placements=...)`, with the gradient's spec
    made once per variable rather than twice per backward pass.
    """

    @staticmethod
    def forward(ctx, value, gradient_spec):
        ctx.gradient_spec = gradient_spec
        ctx.set_materialize_grads(False)
        # A new tensor object, which autograd makes the output, sharing
        # the local tensor's storage and version counter. Not a view in
        # autograd's sense, so that the optimizer's in-place updates of
        # the local tensor leave it this function's output (the views a
        # plan caches from step to step, `local_variables`).
        return torch_internals.local_tensor(value).detach()

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None
        spec = ctx.gradient_spec
        if local_gradients.reduce_local_gradient(
            ctx.next_functions[0][0], grad, spec.placements
        ):
            return None, None
        if grad.stride() == spec.tensor_meta.stride:
            # A copy, as DTensor does: specs are not shared between tensors.
            spec = dtensor_layouts.copy_spec(spec)
        elif any(p.is_shard() for p in spec.placements):
            # A shard of a split gradient (`training_local_calls`): its
            # strides are its own, the spec's the whole tensor's, made
            # contiguous.
            grad = grad.contiguous()
            spec = dtensor_layouts.copy_spec(spec)
        else:
            spec = tensor_spec(spec.mesh, spec.placements, grad)
        return dtensor_layouts.dtensor_from_spec(grad, spec), None
