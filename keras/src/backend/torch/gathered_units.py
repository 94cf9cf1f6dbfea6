"""Fully sharded variables gathered unit by unit, one collective each.

A local layer call (`batch_local`) reads each variable that is sharded
over the batch axes whole. Gathering them one by one costs one all-gather
per variable in forward and one reduce-scatter per variable in backward.
As FSDP does for its units, the sharded variables of one sublayer of the
local call's layer (a transformer block, say) are gathered together here:
their local shards are flattened into one buffer, all-gathered in one
collective, and cut back into full values; in backward, their gradients
(partial sums over the batch axis) are packed the same way and
reduce-scattered in one collective back to each variable's shards.

Which variables form a unit (`units_of`): those of each direct sublayer
of the layer that runs locally, and those the layer holds itself; all of
them when the layer is recomputed whole (`remat_layers`). Consecutive
small units are then joined (`join_small_units`), as DDP fills a bucket:
while the joined unit's gathered bytes stay within
`KERAS_DTENSOR_UNIT_CAP_MB` (25 by default; 0 joins nothing), so that a
flat model of many small layers is not gathered one layer at a time. A
sublayer recomputed in backward stays a unit of its own. A unit
is gathered in one collective when all its variables are split evenly
along one dimension over the same single mesh axis, replicated on the
others, and share a dtype, and when that axis is the only one that splits
the batch (`unit_plan`); otherwise each variable is gathered alone, by
DTensor.

Collectives: a unit's gather is issued at the first read of one of its
variables in the call, unless it was issued ahead: when a unit is
gathered in forward, the gather of the next unit (in the order of
`owned_units`) is issued before the current unit's values are waited for
and used, as FSDP2 prefetches, so that it overlaps the current unit's
compute. A prefetched unit that the call never reads is waited for when
the call ends. A unit's reduce-scatter is issued when autograd reaches
it. The same program on the same global shapes gives the same order on
every process.
"""

import os

import torch
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import Shard

from keras.src.backend.torch import dtensor_layouts

UNIT_CAP_ENV_VAR = "KERAS_DTENSOR_UNIT_CAP_MB"
DEFAULT_UNIT_CAP_MB = 25


class UnitPlan:
    """How one collective gathers the values of a unit's variables.

    Attributes:
        group: the process group of the mesh axis that shards them.
        world: its size.
        dims: per value, the tensor dimension split over that axis.
        local_shapes: per value, the shape of each process's shard.
        specs: per value, its DTensor spec (their gradients take it).
    """

    def __init__(self, values, mesh_dim):
        mesh = values[0].device_mesh
        self.group = mesh.get_group(mesh_dim)
        self.world = mesh.size(mesh_dim)
        self.dims = [value.placements[mesh_dim].dim for value in values]
        self.local_shapes = [value._local_tensor.shape for value in values]
        self.numels = [shape.numel() for shape in self.local_shapes]
        self.specs = [value._spec for value in values]
        self.device = values[0]._local_tensor.device

    def gather(self, shards):
        """The full values of local `shards`, by one all-gather."""
        return self.finish_gather(self.start_gather(shards))

    def start_gather(self, shards):
        """Issues the all-gather of local `shards`, without waiting.

        Returns the gathered rows, to be handed to `finish_gather`.
        """
        flat = torch.cat([shard.reshape(-1) for shard in shards])
        return funcol.all_gather_tensor(flat, gather_dim=0, group=self.group)

    def finish_gather(self, started):
        """The full values, from the result of `start_gather`."""
        rows = _wait(started).view(self.world, -1)
        fulls = []
        pieces = rows.split(self.numels, dim=1)
        for piece, shape, dim in zip(pieces, self.local_shapes, self.dims):
            pieces_of_value = piece.reshape(self.world, *shape).unbind(0)
            fulls.append(torch.cat(pieces_of_value, dim=dim))
        return fulls

    def reduce_scatter(self, grads):
        """This process's shards of the sums of full `grads` over the axis."""
        rows = []
        for grad, dim in zip(grads, self.dims):
            chunks = grad.chunk(self.world, dim=dim)
            rows.append(torch.stack([chunk.reshape(-1) for chunk in chunks]))
        flat = torch.cat(rows, dim=1).reshape(-1)
        summed = _wait(
            funcol.reduce_scatter_tensor(
                flat, "sum", scatter_dim=0, group=self.group
            )
        )
        return [
            part.view(shape)
            for part, shape in zip(summed.split(self.numels), self.local_shapes)
        ]


def _wait(tensor):
    """The result of a functional collective, waited for."""
    if isinstance(tensor, funcol.AsyncCollectiveTensor):
        return tensor.wait()
    return tensor


class StartedGather:
    """The all-gather of a unit's values, issued ahead of their first read.

    Attributes:
        values: the sharded DTensor values gathered.
        rows: the result of `UnitPlan.start_gather`.
    """

    def __init__(self, plan, values):
        self.values = values
        self.rows = plan.start_gather([value._local_tensor for value in values])

    def wait(self):
        """Waits for the gather (of a prefetch that was never read)."""
        _wait(self.rows)


class GatherUnit(torch.autograd.Function):
    """The full local values of a unit's sharded DTensor values.

    `started` is the unit's `StartedGather` when it was issued ahead
    (prefetched), else None: forward issues it. Backward reduce-scatters
    the gradients of the full values (partial sums over the plan's axis)
    to DTensor gradients laid out like the values.
    """

    @staticmethod
    def forward(ctx, plan, started, *values):
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        if started is None:
            started = StartedGather(plan, values)
        return tuple(plan.finish_gather(started.rows))

    @staticmethod
    def backward(ctx, *grads):
        plan = ctx.plan
        grads = [
            torch.zeros(
                spec.shape, dtype=spec.tensor_meta.dtype, device=plan.device
            )
            if grad is None
            else grad
            for grad, spec in zip(grads, plan.specs)
        ]
        shards = plan.reduce_scatter(grads)
        return (None, None) + tuple(
            dtensor_layouts.dtensor_from_spec(
                shard, dtensor_layouts.copy_spec(spec)
            )
            for shard, spec in zip(shards, plan.specs)
        )


def unit_plan(values, gradient_placements):
    """A `UnitPlan` for `values`, or None where one collective can't do.

    Args:
        values: the DTensor values of a unit's sharded variables.
        gradient_placements: the placements of the gradients of the local
            call's variable views: `Partial` on the axes that split the
            batch.
    """
    batch_dims = [
        dim for dim, p in enumerate(gradient_placements) if p.is_partial()
    ]
    if len(batch_dims) != 1:
        return None
    (mesh_dim,) = batch_dims
    first = values[0]
    for value in values:
        if value.device_mesh != first.device_mesh or (
            value.dtype != first.dtype
        ):
            return None
        for dim, placement in enumerate(value.placements):
            if dim == mesh_dim:
                if type(placement) is not Shard:
                    return None
                size = value.device_mesh.size(dim)
                if value.shape[placement.dim] % size:
                    return None
            elif not placement.is_replicate():
                return None
    return UnitPlan(values, mesh_dim)


def units_of(layer, sharded, whole=False):
    """The units of a layer that runs locally, by variable.

    Args:
        layer: the layer.
        sharded: a predicate telling the sharded variables to gather.
        whole: whether the layer is one unit (a layer recomputed whole,
            whose gathered values its recomputation gathers again).

    Returns:
        A dict from `id(variable)` to the variables of its unit (a tuple),
        for each sharded variable, as `owned_units` groups them.
    """
    return {
        id(v): group
        for _, group in owned_units(layer, sharded, whole)
        for v in group
    }


def owned_units(layer, sharded, whole=False):
    """The units of a layer that runs locally, in order, with their owners.

    Args:
        layer: the layer.
        sharded: a predicate telling the sharded variables to gather.
        whole: whether the layer is one unit.

    Returns:
        A list of `(owner, variables)`: the sharded variables (a tuple) of
        each direct sublayer (the owner), then those the layer holds
        itself (owner None). A variable shared by several sublayers
        belongs to the first one's unit.
    """
    groups = []
    flatten = getattr(layer, "_flatten_layers", None)
    children = () if flatten is None or whole else flatten(False, False)
    seen = set()
    for owner in (*children, None):
        variables = layer.variables if owner is None else owner.variables
        group = []
        for variable in variables:
            if id(variable) not in seen and sharded(variable):
                seen.add(id(variable))
                group.append(variable)
        if group:
            groups.append((owner, tuple(group)))
    return groups


def join_small_units(units, cap_bytes):
    """Joins consecutive units while the joined one stays within a cap.

    Args:
        units: a list of `(key, nbytes, variables)`: `key` tells which
            units may be gathered together (equal keys), None for a unit
            that joins no other; `nbytes` is the unit's gathered size.
        cap_bytes: the largest gathered size of a joined unit.

    Returns:
        The list of joined units' variables (tuples), in order.
    """
    joined = []
    last_key, last_bytes = None, 0
    for key, nbytes, variables in units:
        if (
            joined
            and key is not None
            and key == last_key
            and last_bytes + nbytes <= cap_bytes
        ):
            joined[-1] = joined[-1] + variables
            last_bytes += nbytes
            continue
        joined.append(variables)
        last_key, last_bytes = key, nbytes
    return joined


def unit_cap_bytes():
    """The gathered size up to which consecutive units are joined."""
    megabytes = float(os.environ.get(UNIT_CAP_ENV_VAR, DEFAULT_UNIT_CAP_MB))
    return int(megabytes * 2**20)
