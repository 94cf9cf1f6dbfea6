"""Gradients split where their parameters are whole, gathered together.

A replicated parameter can receive its gradient split along a mesh axis:
keras-hub's LoRA factors are replicated, while the sharded kernels they
add to split their products' gradients along the heads, and DTensor
hands each factor a gradient split the same way. Gathered one by one as
each is accumulated, they cost one all-gather each (two LoRA factors per
attention projection). Like the all-reduce buckets of `gradient_bucket`,
such gradients wait in a `GatherBucket` per mesh axis and dtype, and are
gathered by one all-gather when backward ends (`reducer`), each then
laid out as its parameter.

Handled (`gathered_dim`): a gradient whose placements equal its
parameter's on every mesh axis of several processes but one, where the
gradient is `Shard(d)` of a dimension the axis divides evenly and the
parameter `Replicate` (on an axis of one process, any placement holds
the whole: a partial sum there is whole).
Others are redistributed by DTensor (`parameter_gradients`).

Asynchronous buffers: the flat input and output buffers are new tensors
the bucket holds, unmodified, until its work is waited for (`finish`, or
`abandon` after a backward pass that raised).

Collectives: one asynchronous all-gather per bucket, launched when
backward ends, in the order the reducer keeps its buckets (the order
their first gradients arrived, the same on every process).
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src.backend.torch import parameter_gradients
from keras.src.backend.torch import torch_internals

# torch 2.13 deprecates `all_gather_into_tensor` (a FutureWarning on every
# call) for `all_gather_single`, which torch 2.11 does not have.
_ALL_GATHER_SINGLE = getattr(
    dist, "all_gather_single", dist.all_gather_into_tensor
)


def gathered_dim(grad_spec, parameter_spec):
    """`(mesh axis, tensor dim)` where the gradient must be gathered to
    reach its parameter's placements, or None when that is not all
    (see the module docstring)."""
    found = None
    mesh = grad_spec.mesh
    pairs = zip(grad_spec.placements, parameter_spec.placements)
    for axis, (grad_placement, placement) in enumerate(pairs):
        size = mesh.size(axis)
        # On an axis of one process, every placement holds the whole.
        if grad_placement == placement or size == 1:
            continue
        if found is not None or placement != Replicate():
            return None
        if type(grad_placement) is not Shard:
            return None
        if grad_spec.tensor_meta.shape[grad_placement.dim] % size:
            return None
        found = (axis, grad_placement.dim)
    return found


class GatherBucket:
    """Local gradients split along one mesh axis, gathered together.

    Args:
        mesh: the gradients' `DeviceMesh`.
        axis: the mesh axis they are gathered over.
        layouts: the `parameter_gradients.GradientLayouts` that lays the
            gathered gradients out as their parameters.
    """

    def __init__(self, mesh, axis, layouts):
        self.mesh = mesh
        self.axis = axis
        self.layouts = layouts
        # (parameter, local gradient, split dim), by id(parameter).
        self.entries = {}
        self.flat = None
        self.gathered = None
        self.work = None

    def add(self, parameter, local, dim):
        """Adds a local gradient, summed with the parameter's earlier one
        of this backward pass."""
        entry = self.entries.get(id(parameter))
        if entry is not None:
            local = entry[1] + local
        self.entries[id(parameter)] = (parameter, local, dim)

    def launch(self):
        """Flattens the local gradients and starts gathering them."""
        locals_ = [entry[1].reshape(-1) for entry in self.entries.values()]
        # New tensors, held until the work is waited for.
        self.flat = torch.cat(locals_)
        size = self.mesh.size(self.axis)
        self.gathered = self.flat.new_empty(size * self.flat.numel())
        self.work = _ALL_GATHER_SINGLE(
            self.gathered,
            self.flat,
            group=self.mesh.get_group(self.axis),
            async_op=True,
        )

    def abandon(self):
        """Waits for the gather of a backward pass that raised; a failed
        wait (a process gone) leaves the step's own error to be raised."""
        try:
            self.work.wait()
        except RuntimeError:
            pass

    def finish(self, assigned):
        """Waits for the gather and hands each parameter its gradient.

        A parameter in `assigned` (given a gradient by an earlier bucket
        of this backward pass) has this one added to it.
        """
        self.work.wait()
        size = self.mesh.size(self.axis)
        # Row r holds the flat local gradients of the r-th process along
        # the axis, whose shards come r-th along each split dimension.
        rows = self.gathered.view(size, -1)
        offset = 0
        for parameter, local, dim in self.entries.values():
            numel = local.numel()
            parts = rows[:, offset : offset + numel].reshape(size, *local.shape)
            offset += numel
            whole = torch.cat(parts.unbind(0), dim=dim)
            self._hand_back(parameter, whole, assigned)
        self.flat = self.gathered = None

    def _hand_back(self, parameter, local, assigned):
        if id(parameter) in assigned:
            torch_internals.local_tensor(parameter.grad).add_(local)
            return
        if parameter.grad is not None:
            local = parameter_gradients.accumulated(parameter, local)
        parameter.grad = self.layouts.like_parameter(local, parameter)
        assigned.add(id(parameter))
