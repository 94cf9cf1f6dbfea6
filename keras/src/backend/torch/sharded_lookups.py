"""Embedding lookups into tables sharded along the looked-up dimension.

A lookup into a table whose rows are split (an embedding with a
vocabulary-sharded table) gives a `_MaskPartial` DTensor: each process
holds the rows it owns. Two parts, both used by `created_tensors`'s mode:

- `HANDLERS`: the embedding handler of its table, which replicates the
  indices where the table is split before DTensor looks them up.
- `reduce_lookup_result`: the mode reduces every lookup result once, as
  it is made, and the lookup's gradient goes back through
  `_ReducedLookup`.

Collectives: the indices' redistribution and the result's all-reduce
(and their gradients'), inside the step, on every process alike.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras.src.backend.torch.torch_internals import MaskPartial


def reduce_lookup_result(value):
    """Reduces a lookup result once, as it is made.

    DTensor frees a `_MaskPartial` value's mask at the first reduction,
    so a second consumer of the same value fails. The value is reduced
    (all-reduced) once, as it is made, instead. Nothing plain is
    involved, so `implicit_replication` does not apply.
    """
    placements = tuple(
        Replicate() if type(p) is MaskPartial else p for p in value.placements
    )
    return _ReducedLookup.apply(value, placements)


class _ReducedLookup(torch.autograd.Function):
    """`value.redistribute(mesh, placements)` of a lookup result, with the
    gradient DTensor's own redistribution gives, except for a gradient
    that is a partial sum where the lookup was masked: it is all-reduced
    (the lookup's part of a sum is the whole gradient, as for a replicated
    one). DTensor would ask for a partial-to-masked-partial redistribution
    there, which torch 2.11 refuses ("Redistribution from one partial
    type (P(sum)) to another (MaskP(...)) is unsupported"; keras-hub's
    Gemma on a (2, 2) mesh).
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
    target takes `Replicate` (as DTensor's backward redistribution does
    for a gradient that is not a partial sum, and for any gradient where
    the target is a masked lookup)."""
    if target.is_partial() and (
        type(target) is MaskPartial or not current.is_partial()
    ):
        return Replicate()
    return target


def _embedding(mode, func, args, kwargs):
    """Embedding lookups with indices replicated where the table is split.

    DTensor needs the indices replicated on the mesh axes that shard the
    table's rows. Redistributing them first avoids a DTensor ordering
    problem: with indices split on an axis that splits the rows on another
    axis, the lookup's mask was taken from the unreduced indices and did
    not fit the result. The indices are DTensors already, so
    `implicit_replication` does not apply.
    """
    return func(*_replicate_lookup_indices(*args), **kwargs)


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
