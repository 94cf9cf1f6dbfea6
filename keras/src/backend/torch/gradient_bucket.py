"""One bucket of gradients, reduced by one asynchronous all-reduce.

As a bucket of DDP's `Reducer`: gradients that share a mesh, a dtype and
a partial-sum reduction (`bucket_assignment`) are added to a `Bucket`
(`add`), flattened into one buffer and all-reduced asynchronously over
the bucket's first partial mesh axis (`launch`), then waited for and
handed back to their parameters (`finish`), each as a view of the reduced
buffer laid out as its parameter. Values riding along with the
gradients (`bucket_riders`) are flattened after them and handed back to
their riders.

The gradients' placements on the mesh axes they are not reduced over may
differ: each one is handed back with its own parameter's placements.

Asynchronous buffers: every buffer an async collective uses stays alive
and unmodified until its work is waited for. A bucket's flat buffer is a
new tensor (a `cat` of copies), which the bucket holds and nothing
writes until its work is waited for (`finish`, or `abandon` after a
backward pass that raised); the gradients it was copied from may be
freed at once.

Collectives: one asynchronous all-reduce per bucket over its first
partial mesh axis, then one blocking all-reduce per further partial
axis, in the order the reducer launches and finishes its buckets.
"""

import torch
import torch.distributed as dist

from keras.src.backend.torch import parameter_gradients
from keras.src.backend.torch import torch_internals

# The reductions a bucket's all-reduce performs, by partial-sum reduce op
# (an average is a sum divided after it).
REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class Bucket:
    """Gradients that share one mesh, dtype and partial-sum reduction.

    Args:
        mesh: the gradients' `DeviceMesh`.
        partial_dims: the mesh dims the gradients are partial over.
        reduce_op: their partial reduce op, a key of `REDUCE_OPS`.
        layouts: the `parameter_gradients.GradientLayouts` that lays the
            reduced gradients out as their parameters.
    """

    def __init__(self, mesh, partial_dims, reduce_op, layouts):
        self.mesh = mesh
        self.partial_dims = partial_dims
        self.reduce_op = reduce_op
        self.layouts = layouts
        # (parameter, local gradient), then (parameter, its shape) once
        # launched.
        self.entries = []
        # id(parameter) -> index of its entry.
        self.index = {}
        self.nbytes = 0
        self.flat = None
        self.work = None
        self.riders = ()

    def add(self, parameter, local):
        """Adds a local gradient, summed with the parameter's earlier one."""
        index = self.index.get(id(parameter))
        if index is not None:
            self.entries[index] = (parameter, self.entries[index][1] + local)
            return
        self.index[id(parameter)] = len(self.entries)
        self.entries.append((parameter, local))
        self.nbytes += local.numel() * local.element_size()

    def launch(self, riders=()):
        """Flattens the bucket, with the local values of `riders`
        (`bucket_riders.Rider`) after the gradients, and starts reducing
        it over its first axis."""
        self.riders = riders
        # A new tensor, held until the work is waited for.
        self.flat = torch.cat(
            [entry[-1].reshape(-1) for entry in self.entries]
            + [rider.local.reshape(-1) for rider in riders]
        )
        # Keep only the shapes: the unreduced gradients can be freed.
        self.entries = [
            (parameter, local.shape) for parameter, local in self.entries
        ]
        self.index = None
        self.work = dist.all_reduce(
            self.flat,
            op=REDUCE_OPS[self.reduce_op],
            group=self.mesh.get_group(self.partial_dims[0]),
            async_op=True,
        )

    def abandon(self):
        """Waits for the reduction of a backward pass that raised, whose
        result is not read: gloo reads and writes `flat` until then. A
        failed wait (a process gone) leaves the step's own error to be
        raised."""
        try:
            self.work.wait()
        except RuntimeError:
            pass

    def finish(self, assigned):
        """Waits for the reduction and hands each parameter its gradient.

        A parameter in `assigned` (the ids of those given a gradient by an
        earlier bucket of this backward pass) has this one added to it.
        """
        self.work.wait()
        for mesh_dim in self.partial_dims[1:]:
            dist.all_reduce(
                self.flat,
                op=REDUCE_OPS[self.reduce_op],
                group=self.mesh.get_group(mesh_dim),
            )
        if self.reduce_op == "avg":
            self.flat /= _group_size(self.mesh, self.partial_dims)
        offset = self._hand_back_gradients(assigned)
        for rider in self.riders:
            numel = rider.local.numel()
            rider.finish(self.flat.as_strided((numel,), (1,), offset))
            offset += numel

    def _hand_back_gradients(self, assigned):
        """Gives each parameter its view of the reduced `flat`; returns
        the offset of the riders' values after the gradients."""
        layouts = self.layouts
        offset = self.flat.storage_offset()
        for parameter, local_shape in self.entries:
            # One `as_strided` costs a third of a slice and a `view`.
            local = self.flat.as_strided(
                local_shape, layouts.contiguous_strides(local_shape), offset
            )
            offset += local_shape.numel()
            if id(parameter) in assigned:
                torch_internals.local_tensor(parameter.grad).add_(local)
                continue
            if parameter.grad is not None:
                local = parameter_gradients.accumulated(parameter, local)
            parameter.grad = layouts.like_parameter(local, parameter)
            assigned.add(id(parameter))
        return offset


def _group_size(mesh, mesh_dims):
    size = 1
    for mesh_dim in mesh_dims:
        size *= mesh.size(mesh_dim)
    return size
