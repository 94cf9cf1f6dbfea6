"""Embedding lookups into tables sharded along the looked-up dimension.

A lookup into a table whose rows are split (an embedding with a
vocabulary-sharded table) is computed here on each process's rows: the
indices outside them are masked, the local table looked up, the masked
rows zeroed, and the partial sums all-reduced once, as the result is made.
DTensor's own lookup (its `_MaskPartial` placement) does the same, but
keeps the mask in the placement until the first reduction: a second
consumer of the value fails, and under `torch.compile` the mask is lost
between the traced lookup and its reduction (an `AssertionError` in
`_MaskPartial._reduce_value`, torch 2.13). Two parts, both used by
`created_tensors`'s mode:

- `HANDLERS`: the embedding handler, which replicates the indices where
  the table is split, then looks them up as above (tables split along
  their rows by one mesh axis, and not along their columns); other
  lookups go to DTensor.
- `reduce_lookup_result`: reduces a lookup result once, as it is made
  (this module's, and a `_MaskPartial` one DTensor made elsewhere); the
  gradient goes back through `_ReducedLookup`.

Collectives: the indices' redistribution and the result's all-reduce
(and their gradients'), inside the step, on every process alike.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src.backend.torch import dtensor_layouts


def reduce_lookup_result(value):
    """Reduces a lookup result once, as it is made.

    Every partial placement of a lookup result is a masked lookup's (a
    `_MaskPartial`, or `Partial` from `_local_lookup`); it is all-reduced
    once, as the value is made, rather than by each consumer (DTensor frees
    a `_MaskPartial` value's mask at the first reduction, so a second
    consumer would fail). Nothing plain is involved, so
    `implicit_replication` does not apply.
    """
    placements = tuple(
        Replicate() if p.is_partial() else p for p in value.placements
    )
    return _ReducedLookup.apply(value, placements)


class _ReducedLookup(torch.autograd.Function):
    """`value.redistribute(mesh, placements)` of a lookup result, with the
    gradient DTensor's own redistribution gives, except where the lookup
    was masked (a partial placement): there the gradient is replicated,
    all-reduced if it is a partial sum (each process's masked part of the
    sum takes the whole gradient). DTensor would ask for a
    partial-to-masked-partial redistribution there, which torch 2.11
    refuses ("Redistribution from one partial type (P(sum)) to another
    (MaskP(...)) is unsupported"; keras-hub's Gemma on a (2, 2) mesh), or
    keep a partial gradient partial, which `from_local` in torch 2.11
    passes on as the local gradient of each part.
    """

    @staticmethod
    def forward(ctx, value, placements):
        ctx.placements = value.placements
        return value.redistribute(value.device_mesh, placements)

    @staticmethod
    def backward(ctx, grad):
        placements = tuple(
            _lookup_gradient_placement(current, target)
            for current, target in zip(grad.placements, ctx.placements)
        )
        return grad.redistribute(grad.device_mesh, placements), None


def _lookup_gradient_placement(current, target):
    """Where a lookup's gradient, laid out as `current`, goes back to a
    lookup result laid out as `target`: `target`, except that a partial
    target (a masked lookup) takes `Replicate`."""
    return Replicate() if target.is_partial() else target


def _embedding(mode, func, args, kwargs):
    """Embedding lookups with indices replicated where the table is split,
    looked up on each process's rows (`_local_lookup`) where it can be.

    The indices are DTensors already, so `implicit_replication` does not
    apply.
    """
    args = _replicate_lookup_indices(*args)
    axis = _row_axis(*args, **kwargs)
    if axis is None:
        return func(*args, **kwargs)
    return reduce_lookup_result(_local_lookup(*args, axis))


# `embedding`'s options, with the values that leave a lookup plain (eager
# calls pass every option to the mode; a compiled call only those given).
_PLAIN_OPTIONS = (
    ("padding_idx", None),
    ("max_norm", None),
    ("norm_type", 2.0),
    ("scale_grad_by_freq", False),
    ("sparse", False),
)


def _plain(args, kwargs):
    """Whether `embedding`'s options in `args` and `kwargs` are plain."""
    names = [name for name, _ in _PLAIN_OPTIONS]
    options = {**dict(zip(names, args)), **kwargs}
    return (
        len(args) <= len(names)
        and all(
            options.get(name, plain) == plain for name, plain in _PLAIN_OPTIONS
        )
        and set(options) <= set(names)
    )


def _row_axis(indices, table, *args, **kwargs):
    """The mesh axis that alone splits `table`'s rows, or `None` where
    the lookup goes to DTensor: a table not split along its rows, or split
    along its columns or on several axes (of more than one process),
    plain indices, or options of `embedding` (`padding_idx`,
    `max_norm`...)."""
    if not _plain(args, kwargs) or not isinstance(indices, DTensor):
        return None
    if not isinstance(table, DTensor):
        return None
    # A mesh axis of one process splits nothing (keras-hub's maps split the
    # table's columns over "batch", of size 1 on a (1, N) mesh).
    mesh = table.device_mesh
    axes = [
        i
        for i, p in enumerate(table.placements)
        if not p.is_replicate() and mesh.size(i) > 1
    ]
    if len(axes) != 1:
        return None
    placement = table.placements[axes[0]]
    # Not a `_StridedShard`, whose rows are not torch's plain chunks.
    if type(placement) is not Shard or placement.dim != 0:
        return None
    return axes[0]


def _local_lookup(indices, table, axis):
    """The lookup of `indices` in the rows of `table` this process holds
    (split on mesh axis `axis`): zeros for the others, a partial sum on
    that axis, laid out as the indices on the other axes.

    The rows are torch's chunks of the table (`Shard(0)`): this process's
    first row is its coordinate on `axis` times the rounded-up chunk size.
    """
    mesh = table.device_mesh
    # Where the indices are split and the table is not (the batch axes),
    # each process's rows of the table's gradient are a partial sum.
    local_table = table.to_local(
        grad_placements=[
            Partial() if index.is_shard() and kept.is_replicate() else kept
            for index, kept in zip(indices.placements, table.placements)
        ]
    )
    chunk = -(-table.shape[0] // mesh.size(axis))
    first = min(mesh.get_local_rank(axis) * chunk, table.shape[0])
    local_indices = indices.to_local() - first
    outside = (local_indices < 0) | (local_indices >= local_table.shape[0])
    local_indices = torch.where(outside, 0, local_indices)
    rows = torch.nn.functional.embedding(local_indices, local_table)
    rows = rows.masked_fill(outside.unsqueeze(-1), 0)
    placements = list(indices.placements)
    placements[axis] = Partial()
    return DTensor.from_local(
        rows,
        mesh,
        placements,
        run_check=False,
        shape=(*indices.shape, table.shape[1]),
        stride=dtensor_layouts.contiguous_strides(
            (*indices.shape, table.shape[1])
        ),
    )


def _replicate_lookup_indices(indices, table, *args):
    """Replicates embedding indices on the mesh axes that shard the table.

    DTensor needs the indices replicated there anyway. Redistributing them
    first avoids a DTensor ordering problem: when the indices are split on
    an axis that splits the table's rows on another axis, the lookup's
    mask was taken from the unreduced indices and did not fit the result.
    """
    if not (isinstance(indices, DTensor) and isinstance(table, DTensor)):
        return (indices, table, *args)
    placements = [
        Replicate() if table_placement.is_shard() else placement
        for placement, table_placement in zip(
            indices.placements, table.placements
        )
    ]
    if placements != list(indices.placements):
        indices = indices.redistribute(indices.device_mesh, placements)
    return (indices, table, *args)


# Torch function -> handler(mode, func, args, kwargs), for
# `created_tensors`'s table.
HANDLERS = {
    torch.nn.functional.embedding: _embedding,
}
