"""Fully sharded variables gathered unit by unit, one collective each.

A local layer call (`batch_local`) reads each variable that is sharded
over the batch axes whole. Gathering them one by one costs one all-gather
per variable in forward and one reduce-scatter per variable in backward.
As FSDP does for its units, the sharded variables of one sublayer of the
local call's layer (a transformer block, say) are gathered together here.

This module says which variables form a unit (`block_units`; without
repeated blocks, `owned_units` and `join_small_units`), whether one
collective can gather a unit (`unit_plan`; otherwise each variable is
gathered alone, by DTensor), and gathers it (`UnitPlan`, `StartedGather`,
`gather_unit`). `unit_gathering` calls it for each local call.

Collectives: per unit, one all-gather in forward, issued at the first
read of one of its variables in the call unless it was issued ahead (a
prefetch, one gather in flight at a time), and one reduce-scatter in
backward, issued when autograd reaches it. The same program on the same
global shapes gives the same order on every process. A prefetch the call
never reads is waited for when the call ends, raised or not.
"""

import os

import torch
from torch.distributed.tensor import Shard

from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import torch_internals

# Consecutive small units are joined (`join_small_units`), as DDP fills a
# bucket, while the joined unit's gathered bytes stay within this many MB
# (25 by default; 0 joins nothing).
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
        self.local_shapes = [
            torch_internals.local_tensor(value).shape for value in values
        ]
        self.numels = [shape.numel() for shape in self.local_shapes]
        self.specs = [torch_internals.spec_of(value) for value in values]

    def gather(self, shards):
        """The full values of local `shards`, by one all-gather."""
        return self.unpack(self.finish_gather(self.start_gather(shards)))

    def start_gather(self, shards):
        """Issues the all-gather of local `shards`, without waiting.

        Returns the gathered rows, to be handed to `finish_gather`.
        """
        # The local shards are flattened into one buffer, all-gathered in
        # one collective (and cut back into full values by `unpack`). For
        # an asynchronous gather, this input is a new flat copy of the
        # shards.
        flat = torch.cat([shard.reshape(-1) for shard in shards])
        return torch_internals.all_gather_single(
            flat, gather_dim=0, group=self.group
        )

    def finish_gather(self, started):
        """The gathered rows, one per process, from `start_gather`'s
        result, waited for."""
        # The output of an asynchronous gather is read only after the
        # gather is waited for.
        return torch_internals.waited(started).view(self.world, -1)

    def unpack(self, rows):
        """The full values in gathered `rows`.

        Differentiable: autograd packs the values' gradients back into
        rows, each process's chunks in its row (the layout that
        `reduce_scatter` takes), freeing each value's gradient as it goes.
        """
        fulls = []
        pieces = rows.split(self.numels, dim=1)
        for piece, shape, dim in zip(pieces, self.local_shapes, self.dims):
            pieces_of_value = piece.reshape(self.world, *shape).unbind(0)
            fulls.append(torch.cat(pieces_of_value, dim=dim))
        return fulls

    def reduce_scatter(self, rows):
        """This process's shards of the sums of packed gradient `rows`
        (as `unpack`'s gradient packs them) over the axis."""
        # The gradients (partial sums over the batch axis) are packed as
        # the values were, and reduce-scattered in one collective back to
        # each variable's shards.
        summed = torch_internals.waited(
            torch_internals.reduce_scatter_single(
                rows.reshape(-1), "sum", scatter_dim=0, group=self.group
            )
        )
        return [
            part.view(shape)
            for part, shape in zip(summed.split(self.numels), self.local_shapes)
        ]


# When a unit is gathered in forward, the gather of the next unit (in the
# order of the units' first segments) is issued as soon as the current
# unit's gather is done, before its values are used, as FSDP2 prefetches,
# so that it overlaps the current unit's compute while one gather at a
# time is in flight (`unit_gathering`).
class StartedGather:
    """The all-gather of a unit's values, issued ahead of their first read.

    Attributes:
        values: the sharded DTensor values gathered.
        rows: the result of `UnitPlan.start_gather`.
    """

    def __init__(self, plan, values):
        self.values = values
        self.rows = plan.start_gather(
            [torch_internals.local_tensor(value) for value in values]
        )

    def wait(self):
        """Waits for the gather (of a prefetch that was never read)."""
        # A prefetched unit that the call never reads is waited for when
        # the call ends, raised or not.
        torch_internals.waited(self.rows)


class GatherUnit(torch.autograd.Function):
    """The gathered rows of a unit's sharded DTensor values.

    `started` is the unit's `StartedGather` when it was issued ahead
    (prefetched), else None: forward issues it. Backward reduce-scatters
    the rows' gradient (partial sums over the plan's axis) to DTensor
    gradients laid out like the values.
    """

    @staticmethod
    def forward(ctx, plan, started, *values):
        ctx.plan = plan
        if started is None:
            started = StartedGather(plan, values)
        rows = plan.finish_gather(started.rows)
        # Held by the rows' views alone: freed once they are unpacked.
        started.rows = None
        return rows

    @staticmethod
    def backward(ctx, rows):
        plan = ctx.plan
        shards = plan.reduce_scatter(rows)
        return (None, None) + tuple(
            dtensor_layouts.dtensor_from_spec(
                shard, dtensor_layouts.copy_spec(spec)
            )
            for shard, spec in zip(shards, plan.specs)
        )


def gather_unit(plan, started, values):
    """The full local values of a unit's sharded DTensor `values`.

    One all-gather (issued ahead when `started` is a `StartedGather`);
    in backward, autograd packs the full values' gradients into rows as
    they come (a value without a gradient packs zeros), and one
    reduce-scatter sends each process its shards (`GatherUnit`). As
    FSDP2 does, no full gradient outlives its packing.
    """
    return plan.unpack(GatherUnit.apply(plan, started, *values))


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
    # One collective gathers a unit when all its variables are split
    # evenly along one dimension over the same single mesh axis, replicated
    # on the others, and share a dtype, and when that axis is the only one
    # that splits the batch; otherwise each variable is gathered alone, by
    # DTensor.
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
    # A layer recomputed whole (`remat_layers`) is one unit of all its
    # sharded variables.
    children = () if flatten is None or whole else flatten(False, False)
    seen = set()
    for owner in (*children, None):
        found = _sharded_of([layer if owner is None else owner], sharded, seen)
        if found:
            groups.append((owner, tuple(variable for _, variable in found)))
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


def segments_of(layer):
    """The operations a layer calls, in order, cut into segments.

    A functional model's graph is cut after each node that leaves exactly
    one tensor live (made so far and read later, the model's outputs
    included): the residual stream between two blocks, whatever the
    blocks' layers are. Any other layer's direct sublayers are one
    segment each.

    Args:
        layer: the layer that runs locally.

    Returns:
        A list of segments, each a list of operations (layers or ops).
    """
    # Cutting a functional model where a single tensor is live gathers a
    # flat model, every Dense a direct layer of it, block by block.
    nodes_by_depth = getattr(layer, "_nodes_by_depth", None)
    if nodes_by_depth is None:
        flatten = getattr(layer, "_flatten_layers", None)
        children = () if flatten is None else flatten(False, False)
        return [[child] for child in children]
    nodes = [
        node
        for depth in sorted(nodes_by_depth, reverse=True)
        for node in nodes_by_depth[depth]
        if node.operation is not None and not node.is_input
    ]
    live = _live_tensors_after(layer, nodes)
    segments = [[]]
    for position, node in enumerate(nodes):
        segments[-1].append(node.operation)
        if live[position] == 1 and position < len(nodes) - 1:
            segments.append([])
    return segments


def _live_tensors_after(layer, nodes):
    """Per node (in call order), how many tensors are live after it."""
    end = len(nodes)
    made = {id(tensor): -1 for tensor in layer._inputs}
    last_read = {id(tensor): end for tensor in layer._outputs}
    for position, node in enumerate(nodes):
        for tensor in node.input_tensors:
            last_read[id(tensor)] = max(last_read.get(id(tensor), -1), position)
        for tensor in node.outputs:
            made.setdefault(id(tensor), position)
    # A tensor is live after each node from the one that makes it to the
    # one before its last reader.
    change = [0] * (end + 1)
    for key, first in made.items():
        last = last_read.get(key, -1)
        if last > first:
            change[max(first, 0)] += 1
            change[last] -= 1
    live, count = [], 0
    for position in range(end):
        count += change[position]
        live.append(count)
    return live


def repeated_runs(signatures, weights, start=0, stop=None):
    """The runs of consecutive repeated segments, as a model's blocks.

    The run kept is the one whose repetitions hold the most weight (a
    segment's weight: its sharded variables), then the shortest period,
    then the first; the segments before and after it are searched the
    same way.

    Args:
        signatures: per segment, a hashable description of it.
        weights: per segment, its weight; a repetition must hold some.
        start: the first segment searched.
        stop: the end of the segments searched (None: all of them).

    Returns:
        A list of `(start, period, count)`, in order: `count` repetitions
        of the `period` segments from `start`.
    """
    stop = len(signatures) if stop is None else stop
    # held[i]: the weight of the segments before segment i.
    held = [0]
    for weight in weights:
        held.append(held[-1] + weight)
    best, best_key = None, None
    for period in range(1, (stop - start) // 2 + 1):
        first = start
        while first + 2 * period <= stop:
            # Segments from `first` to `end` repeat with this period.
            end = first + period
            while end < stop and signatures[end] == signatures[end - period]:
                end += 1
            for offset in range(first, min(first + period, end - period)):
                count = (end - offset) // period
                if count < 2 or held[offset + period] == held[offset]:
                    continue
                key = (held[offset] - held[offset + count * period], period)
                key += (offset,)
                if best_key is None or key < best_key:
                    best, best_key = (offset, period, count), key
            first = end - period + 1
    if best is None:
        return []
    first, period, count = best
    return (
        repeated_runs(signatures, weights, start, first)
        + [best]
        + repeated_runs(signatures, weights, first + count * period, stop)
    )


def block_units(layer, sharded):
    """The units of a layer of repeated blocks, as FSDP wraps blocks.

    Each repetition of a run of repeated segments (`segments_of`,
    `repeated_runs`) is a block, and its sharded variables a unit; the
    sharded variables outside every block (embeddings, a head, and those
    the layer holds itself) are the root unit, which is kept gathered
    from its first read to the end of backward (FSDP's root is not
    resharded after forward). A sublayer recomputed in backward is a unit
    of its own (its recomputation gathers it again). A variable shared by
    several operations belongs to the first one's unit.

    Args:
        layer: the layer that runs locally.
        sharded: a predicate telling the sharded variables to gather.

    Returns:
        None where no segment repeats; else a list of `(variables, kept)`
        in the order of their first segment: the variables (a tuple), and
        whether the unit is the root, kept gathered.
    """
    segments = segments_of(layer)
    seen = set()
    owned = [_sharded_of(segment, sharded, seen) for segment in segments]
    signatures = [_signature_of(segment) for segment in segments]
    weights = [len(own) for own in owned]
    runs = repeated_runs(signatures, weights)
    if not runs:
        # A layer with no repeated segments takes the units of its direct
        # sublayers, and those it holds itself (`owned_units`).
        return None
    in_block = {}
    for first, period, count in runs:
        for repetition in range(count):
            start = first + repetition * period
            in_block.update((i, start) for i in range(start, start + period))
    blocks, root, root_at = {}, [], len(segments)
    for index, own in enumerate(owned):
        if index in in_block:
            blocks.setdefault(in_block[index], []).extend(own)
        elif own:
            root.extend(own)
            root_at = min(root_at, index)
    # The layer's own (those of no operation) last.
    root.extend(_sharded_of([layer], sharded, seen))
    units = [
        (start, variables, False)
        for start, block in blocks.items()
        for variables, _ in _recomputed_apart(block)
    ]
    units.extend(
        (root_at, variables, not recomputed)
        for variables, recomputed in _recomputed_apart(root)
    )
    units.sort(key=lambda unit: unit[0])
    return [(variables, kept) for _, variables, kept in units]


def _recomputed_apart(owned):
    """Groups `(operation, variable)` pairs: one group per recomputed
    operation, then one of the others; `(variables, recomputed)` each."""
    groups, rest = {}, []
    for operation, variable in owned:
        if getattr(operation, "_remat_mode", None) is None:
            rest.append(variable)
        else:
            groups.setdefault(id(operation), []).append(variable)
    found = [(tuple(group), True) for group in groups.values()]
    if rest:
        found.append((tuple(rest), False))
    return found


def _signature_of(operations):
    """What makes segments repetitions of one another: their operations'
    classes and variable shapes, in order."""
    return tuple(
        (
            type(operation).__name__,
            tuple(
                tuple(variable.shape)
                for variable in getattr(operation, "variables", ())
            ),
        )
        for operation in operations
    )


def _sharded_of(operations, sharded, seen):
    """`(operation, variable)` for the sharded variables of operations."""
    found = []
    for operation in operations:
        for variable in getattr(operation, "variables", ()):
            if id(variable) not in seen and sharded(variable):
                seen.add(id(variable))
                found.append((operation, variable))
    return found
