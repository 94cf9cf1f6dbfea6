"""Which bucket a gradient joins: its partial-sum reduction and key.

As DDP's bucket assignment, decided per gradient from placements alone
(the same on every process): a gradient that differs from its
parameter's placements only by partial sums over mesh axes where the
parameter is replicated needs one all-reduce (`partial_sum_reduction`),
and joins the bucket of its mesh, reduction and dtype (`bucket_key`).
Gradients that need the same all-reduce share a bucket whatever their
placements on the other mesh axes: on a ("batch", "model") mesh, a
column-sharded and a replicated kernel are reduced together over
"batch" (processes of one "batch" group hold shards of equal shapes).
Anything else (a reduce-scatter to a sharded parameter) is left to
DTensor.

Mesh axes of one process need no reduction: a partial sum over one
process is the whole sum. A reduction whose partial mesh dims are empty
marks a gradient that differs from its parameter's placements only on
such axes; the reducer hands it over at once, without a bucket.

State: a `BucketAssignment` keeps each reduction computed (per mesh
shape and placements) and each parameter's plan for its local views'
gradients (`ParameterCache`, by identity; nothing is stored on the
parameters). No collectives here.
"""

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import Partial

from keras.src.backend.torch import gradient_bucket
from keras.src.backend.torch import parameter_gradients
from keras.src.backend.torch import torch_internals


class BucketAssignment:
    """The reductions and bucket keys of gradients, kept once computed."""

    def __init__(self):
        # (mesh shape, gradient placements, parameter placements) -> the
        # result of `partial_sum_reduction`.
        self._reductions = {}
        # parameter -> (its spec, the placements of its local views'
        # gradients, their reduction, their bucket key).
        self._local_plans = parameter_gradients.ParameterCache()

    def reduction(self, mesh, current, placements):
        """`partial_sum_reduction`, computed once per mesh shape and
        placements."""
        key = (mesh.shape, current, placements)
        reductions = self._reductions
        if key not in reductions:
            reductions[key] = partial_sum_reduction(mesh, current, placements)
        return reductions[key]

    def gradient_plan(self, parameter, grad):
        """How a DTensor gradient reaches its parameter's placements.

        Returns None if it has them already, else `(reduction, bucket
        key)`: the `partial_sum_reduction` (None if an all-reduce does
        not suffice) and the key of the bucket it joins.
        """
        target = torch_internals.spec_of(parameter).placements
        grad_spec = torch_internals.spec_of(grad)
        if grad_spec.placements == target:
            return None
        mesh = grad_spec.mesh
        reduction = self.reduction(mesh, grad_spec.placements, target)
        return reduction, bucket_key(mesh, reduction, grad.dtype)

    def local_plan(self, parameter, placements, local):
        """`(spec, placements, reduction, bucket key)` of the gradient of
        a local view of `parameter`, whose gradients as DTensors have
        `placements`; `local` is the parameter's local tensor.

        Planned once per parameter spec and gradient placements.
        """
        kept = self._local_plans.get(parameter)
        if (
            kept is not None
            and kept[0] is torch_internals.spec_of(parameter)
            and kept[1] is placements
        ):
            return kept
        spec = torch_internals.spec_of(parameter)
        reduction = self.reduction(spec.mesh, placements, spec.placements)
        kept = (
            spec,
            placements,
            reduction,
            bucket_key(spec.mesh, reduction, local.dtype),
        )
        self._local_plans.set(parameter, kept)
        return kept


def bucket_key(mesh, reduction, dtype):
    """The key of the bucket of gradients of this mesh, partial-sum
    reduction and dtype: `(mesh, (id(mesh), reduction, dtype))`.

    Buckets are looked up by the second part, which hashes without Python
    code (a `DeviceMesh` hashes in Python).
    """
    return (mesh, (id(mesh), reduction, dtype))


def partial_sum_reduction(mesh, current_placements, placements):
    """Returns `(partial mesh dims, reduce op)` if an all-reduce suffices.

    That is the case when, on every mesh axis, the gradient's placement is
    its parameter's, or a partial sum where the parameter is replicated.
    Mesh axes of size 1 need no communication whatever the placements; when
    only those differ, the partial mesh dims are empty. Returns None when an
    all-reduce does not suffice.
    """
    partial_dims = []
    reduce_ops = set()
    for mesh_dim, (current, target) in enumerate(
        zip(current_placements, placements)
    ):
        if current == target or mesh_dim_size(mesh, mesh_dim) == 1:
            continue
        if type(current) is not Partial or not isinstance(target, Replicate):
            return None
        partial_dims.append(mesh_dim)
        reduce_ops.add(current.reduce_op)
    if not partial_dims:
        return (), None
    if len(reduce_ops) != 1:
        return None
    (reduce_op,) = reduce_ops
    if reduce_op not in gradient_bucket.REDUCE_OPS:
        return None
    return tuple(partial_dims), reduce_op


def mesh_dim_size(mesh, mesh_dim):
    """The number of processes along one mesh axis (tests pretend more)."""
    return mesh.size(mesh_dim)
