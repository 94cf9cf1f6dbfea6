"""Keras layouts as DTensor placements.

A Keras `TensorLayout` names, for each tensor dimension, the mesh axes
that split it. Its torch form, `DTensorLayout`, holds the torch mesh and
one DTensor placement per mesh axis. Layouts are checked with the shared
validator (`keras.src.distribution.layout_validation`) before they are
converted. Nothing here communicates, except `relayout`, which
redistributes a DTensor (a collective every process must run).
"""

import collections
import math

from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src.backend.torch import torch_internals
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import StridedShard

# The backend form of a `TensorLayout`: the torch mesh, one placement per
# mesh axis, and the Keras axes and mesh it came from (for error messages).
DTensorLayout = collections.namedtuple(
    "DTensorLayout", ["mesh", "placements", "axes", "keras_mesh"]
)


def axes_to_placements(axes, device_mesh):
    """Maps Keras layout axes to one DTensor placement per mesh axis.

    A mesh axis that splits a dimension is `Shard(dim)`, and `Replicate()`
    otherwise. On an axis of size 1 a `Shard` holds the whole dimension,
    as JAX's absent axis does; views that DTensor's own rule refuses there
    take its `reshape` rule (`sharding_rules`), which costs nothing on
    such an axis. A dimension may be split over several mesh axes; the first
    one named is the major one, as in JAX's `PartitionSpec`.

    Args:
        axes: the layout axes, one entry per tensor dimension (`None`, an
            axis name, or a tuple of axis names).
        device_mesh: the Keras `DeviceMesh`.

    Returns:
        A tuple of placements, one per mesh axis.

    Raises:
        ValueError: for an axis that is not a mesh axis, or one used twice.
    """
    from keras.src.distribution import layout_validation

    layout_validation.check_layout(None, None, axes, device_mesh, "tensor")
    axis_names = list(device_mesh.axis_names)
    mesh_shape = tuple(device_mesh.shape)
    placements = [Replicate() for _ in axis_names]
    for tensor_dim, entry in enumerate(axes):
        mesh_dims = [
            axis_names.index(name)
            for name in layout_validation.axis_names_of(entry)
        ]
        for position, mesh_dim in enumerate(mesh_dims):
            # Mesh axes named earlier are the major ones. DTensor splits in
            # mesh-axis order, so an axis that follows a major axis in the
            # mesh must be split with the major axes' size as a stride.
            split_factor = math.prod(
                mesh_shape[d] for d in mesh_dims[:position] if d > mesh_dim
            )
            if split_factor == 1 or mesh_shape[mesh_dim] == 1:
                placements[mesh_dim] = Shard(tensor_dim)
            else:
                placements[mesh_dim] = StridedShard(
                    tensor_dim, split_factor=split_factor
                )
    return tuple(placements)


def replicated_on_unit_axes(layout):
    """`layout` (a `DTensorLayout`) with `Replicate()` on each mesh axis of
    one process, on a mesh of several processes.

    A split over one process holds the whole dimension: the same local
    tensor as replicated. A variable laid out this way leaves DTensor's
    rules free to follow the other operand on that axis; kept as a
    `Shard`, the contraction of keras-hub's `(model, batch, None)` kernels
    with a batch split along the same axis made DTensor gather kernels
    over the model axis, or reduce partial sums over the batch axis. On a
    mesh of one process nothing is communicated whatever the placements,
    and the layout's own are kept.
    """
    if layout.mesh.size() == 1:
        return layout
    sizes = layout.mesh.shape
    placements = tuple(
        Replicate() if sizes[mesh_dim] == 1 else placement
        for mesh_dim, placement in enumerate(layout.placements)
    )
    if placements == tuple(layout.placements):
        return layout
    return layout._replace(placements=placements)


def backend_layout(layout):
    """Returns the `DTensorLayout` of a `TensorLayout` or backend layout."""
    if isinstance(layout, DTensorLayout):
        return layout
    return layout.backend_layout


def validate_layout(shape, layout, path=None, require_divisible=True):
    """Checks that a `DTensorLayout` fits a tensor shape on its mesh.

    Args:
        shape: the tensor shape.
        layout: a `DTensorLayout`.
        path: name of the variable, for the error message (`None` for an
            unnamed tensor).
        require_divisible: whether every sharded dimension must divide by
            the product of its mesh axis sizes (variables must; data batches
            may be split unevenly).

    Raises:
        ValueError: naming the path, shape, layout, mesh and offending axis.
    """
    if layout.axes is None:
        return
    from keras.src.distribution import layout_validation

    layout_validation.check_layout(
        path,
        tuple(shape),
        layout.axes,
        layout.keras_mesh,
        kind="variable" if path is not None else "tensor",
        require_divisible=require_divisible,
    )


def relayout(value, layout):
    """Redistributes a DTensor to `layout` (differentiably).

    On another mesh, the full value is gathered and each process keeps its
    part of it.
    """
    if value.device_mesh == layout.mesh:
        if tuple(value.placements) == tuple(layout.placements):
            return value
        return value.redistribute(layout.mesh, layout.placements)
    return distribute_tensor(
        value.full_tensor(), layout.mesh, layout.placements, src_data_rank=None
    )


def rewrapped(value, local):
    """A DTensor over `local` laid out as the DTensor `value` (its mesh,
    placements, global shape and strides), made by `from_local`, so
    differentiable; `local` must be such a layout's local tensor."""
    return DTensor.from_local(
        local,
        value.device_mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def contiguous_strides(shape):
    """The strides of a contiguous tensor of `shape`."""
    strides = []
    running = 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def dtensor_from_spec(local, spec):
    """A DTensor of `local` with `spec`, made without autograd.

    As `DTensor(local, spec, requires_grad=False)` (what `from_local` and
    DTensor's own operators end with), minus the Python `__init__`, which
    only wraps `Tensor.__init__` for Dynamo and export: the C++
    constructor does the work. For eager code on hot paths (a gradient
    per parameter per step); `parameter_gradients_test` checks that both ways
    make the same DTensor.

    Args:
        local: the local tensor (not requiring gradients).
        spec: a `DTensorSpec` for it, not shared with another DTensor.
    """
    return torch_internals.make_dtensor(local, spec)


def waited_local_tensor(value):
    """A DTensor's local tensor, as a plain tensor.

    A local tensor that is the result of a functional collective (an
    `AsyncCollectiveTensor`, as the loss's all-reduce in
    `batch_reductions`) is waited for here, once, and its plain result
    returned: operators reading it then run without the wrapper's Python
    dispatch, each of which would check it again.
    """
    return torch_internals.waited(torch_internals.local_tensor(value))


def copy_spec(spec):
    """A shallow copy of a `DTensorSpec`, as `copy.copy` makes it.

    The same attributes (the cached hash included, which stays valid for
    equal fields), without `copy`'s generic protocol.
    """
    copied = object.__new__(type(spec))
    copied.__dict__.update(spec.__dict__)
    return copied


def additive_partial_dims(spec):
    """`(partial mesh dims, averaged mesh dims)` of a partial DTensor.

    The whole value of a DTensor whose placements are `Replicate`,
    `Partial("sum")` and `Partial("avg")` is the sum of the processes'
    local values over its partial mesh dims, divided by the number of
    processes of the averaged ones (a subset). None where some placement
    is another one, or none is partial.
    """
    partial = []
    averaged = []
    for mesh_dim, placement in enumerate(spec.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Partial or placement.reduce_op not in (
            "sum",
            "avg",
        ):
            return None
        partial.append(mesh_dim)
        if placement.reduce_op == "avg":
            averaged.append(mesh_dim)
    if not partial:
        return None
    return tuple(partial), tuple(averaged)


def replicated_like(local, spec):
    """A replicated DTensor of `local` (the whole value, not requiring
    gradients), with `spec`'s mesh and global metadata."""
    replicated = (Replicate(),) * spec.mesh.ndim
    return dtensor_from_spec(
        local, DTensorSpec(spec.mesh, replicated, tensor_meta=spec.tensor_meta)
    )
