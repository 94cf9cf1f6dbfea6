"""A parameter's reduced gradient, laid out as the parameter.

The gradient of a DTensor parameter has the parameter's mesh, placements,
global shape and dtype. `GradientLayouts.like_parameter` wraps a reduced
local gradient so, from a spec computed once per parameter spec;
`accumulated` adds it to a gradient an earlier backward pass left, as
autograd accumulates; `redistribute_gradient` brings a gradient that
needs more than an all-reduce to its parameter's placements with
DTensor.

State: a `GradientLayouts` keeps, per parameter (by identity, dropped
with the parameter, `ParameterCache`), the spec its gradients copy, and
the contiguous strides of each local shape; nothing is stored on the
parameters. No collectives here but DTensor's own in
`redistribute_gradient`.
"""

from torch.distributed.tensor import DTensor

from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import local_call_state
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import TensorMeta


class ParameterCache(local_call_state.WeakIdMap):
    """Values kept per parameter, by identity, while it lives: the local
    calls' `WeakIdMap` (a parameter compares elementwise, so it cannot key
    a `WeakKeyDictionary`)."""

    def set(self, parameter, value):
        """Keeps `value` for `parameter` while the parameter lives."""
        self[parameter] = value


class GradientLayouts:
    """Lays reduced local gradients out as their parameters."""

    def __init__(self):
        # parameter -> (its spec, the spec its reduced gradients copy).
        self._specs = ParameterCache()
        # torch.Size -> its contiguous strides.
        self._strides = {}

    def like_parameter(self, local, parameter):
        """A DTensor of `local` (contiguous) laid out as `parameter`.

        Its spec is a copy (DTensors do not share specs) of the
        parameter's, or of one with contiguous strides where the
        parameter's are not, computed once per parameter spec.
        """
        kept = self._specs.get(parameter)
        spec = torch_internals.spec_of(parameter)
        if kept is None or kept[0] is not spec:
            kept = (spec, _contiguous_spec(spec))
            self._specs.set(parameter, kept)
        return dtensor_layouts.dtensor_from_spec(
            local, dtensor_layouts.copy_spec(kept[1])
        )

    def contiguous_strides(self, shape):
        """The strides of a contiguous tensor of `shape`, computed once per
        shape."""
        strides = self._strides.get(shape)
        if strides is None:
            strides = dtensor_layouts.contiguous_strides(shape)
            self._strides[shape] = strides
        return strides


def accumulated(parameter, local):
    """The local part of the parameter's gradient once its reduced
    `local` gradient is in.

    A gradient the parameter holds from an earlier backward pass (not
    reset since) is laid out like it, and `local` is added to it, as
    autograd accumulates. A partial gradient it holds is this pass's, and
    is in `local` already: it is replaced.
    """
    grad = parameter.grad
    if (
        isinstance(grad, DTensor)
        and torch_internals.spec_of(grad).placements
        == torch_internals.spec_of(parameter).placements
    ):
        return torch_internals.local_tensor(grad) + local
    return local


def redistribute_gradient(grad, parameter):
    """Redistributes one gradient to its parameter's placements.

    A shard cut out of a larger buffer is copied, so that the full buffer
    is not kept alive by the gradient.
    """
    grad = grad.redistribute(parameter.device_mesh, parameter.placements)
    local = grad.to_local()
    if local.untyped_storage().nbytes() > local.numel() * local.element_size():
        grad = dtensor_layouts.rewrapped(grad, local.clone())
    return grad


def _contiguous_spec(spec):
    """`spec`, or a copy of it with contiguous global strides."""
    meta = spec.tensor_meta
    strides = dtensor_layouts.contiguous_strides(meta.shape)
    if meta.stride == strides:
        return spec
    return DTensorSpec(
        spec.mesh,
        spec.placements,
        tensor_meta=TensorMeta(meta.shape, strides, meta.dtype),
    )
