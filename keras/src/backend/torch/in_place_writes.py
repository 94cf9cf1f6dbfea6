"""In-place writes into a DTensor keep the target's layout.

DTensor refuses an in-place op whose sharding strategy would change its
target's placements ("in-place operations that require placement changes
are not supported"). Keras's `slice_update` writes into a clone of its
input with `index_put_` (tensor start indices) or a slice assignment
(`copy_`, Python start indices), and keras-hub's KV caches are updated
that way during `generate()`: the cache laid out one way, the new keys and
values (a head-split projection, a batch-split input) another. The writes
here lay out what is written to fit the target first, so the target
keeps its layout and is never gathered:

- `copy_` (and a slice assignment, which is a view's `copy_`): the source
  takes the target's placements, its dimensions matched from the right
  as broadcasting matches them, and `Replicate` where it broadcasts.
- `index_put_` and `index_put` into a target split along a dimension
  they index (a batch-split prompt the sampler writes into): each process
  writes the elements it owns into its shard, at local indices, where
  DTensor's rule would gather the target.
  Where each process holds, of values split along one mesh axis,
  exactly the elements it owns, in order (the flattened keys of one
  token, split by heads, written into a head-split cache), it writes its
  own values and nothing is gathered (`_held_as_owned`).
- Any other `index_put_`: on every mesh axis where the target is
  replicated, the indices and values are replicated too (the layout
  DTensor's rule needs there); on the other axes DTensor decides.
- A fresh clone takes the split of what is first written into it: a
  slice assignment into the result of the torch call just before, a
  `clone` of a replicated DTensor, lays the clone out split along each
  dimension that the value is split along, whole, on a mesh axis where
  the clone is replicated (`_split_like_value`: its local chunk, nothing
  moved), instead of gathering the value. Keras's `slice_update` writes
  so, and keras-hub's cache is seeded so from the prompt's keys and
  values: the KV cache made replicated (`ops.zeros`) becomes split by
  heads (or by the batch) at its first write, and every later token's
  write is local.

What is written is usually small (one token's keys and values), so where
it is gathered it costs a small all-gather. The handlers run in the
step's torch function mode (`created_tensors`), on every process alike:
each decision reads only placements, shapes and replicated values.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src.backend.torch import local_call_checks
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch.torch_internals import (
    compute_local_shape_and_global_offset,
)


def _source_placements(target, source):
    """The placements of `source` that fit a `copy_` into `target`."""
    offset = target.ndim - source.ndim
    placements = []
    for placement in target.placements:
        dim = placement.dim - offset if placement.is_shard() else None
        if dim is None or dim < 0 or source.shape[dim] == 1:
            placements.append(Replicate())
        else:
            placements.append(type(placement)(dim))
    return placements


def _fit(value, placements):
    """`value` redistributed to `placements` (a DTensor), else as it is."""
    if not isinstance(value, DTensor) or list(value.placements) == list(
        placements
    ):
        return value
    return value.redistribute(value.device_mesh, placements)


def _copy(mode, func, args, kwargs):
    """`Tensor.copy_(target, source)` with the source laid out to fit."""
    target, source = args[0], args[1] if len(args) > 1 else kwargs["src"]
    if not (isinstance(target, DTensor) and isinstance(source, DTensor)):
        return func(*args, **kwargs)
    if any(p.is_partial() for p in target.placements):
        return func(*args, **kwargs)
    source = _fit(source, _source_placements(target, source))
    kwargs = {k: v for k, v in kwargs.items() if k != "src"}
    return func(target, source, *args[2:], **kwargs)


def _set_item(mode, func, args, kwargs):
    """`target[index] = value` with the value laid out to fit the target.

    The value goes where the target's view at `index` lies: as for
    `_copy`, into that view (basic indexing keeps the target's layout on
    the dimensions it keeps; DTensor lays the view out).
    """
    target, index, value = args
    if not (isinstance(target, DTensor) and isinstance(value, DTensor)):
        return func(*args, **kwargs)
    if _is_basic_index(index):
        if mode.just_cloned is target:
            _split_like_value(target, index, value)
        view = target[index]
        if isinstance(view, DTensor) and not any(
            p.is_partial() for p in view.placements
        ):
            value = _fit(value, _source_placements(view, value))
            return func(target, index, value)
    return func(target, index, _replicated_where(target, value))


def _is_basic_index(index):
    """Whether `index` holds only ints, slices, None and Ellipsis."""
    items = index if isinstance(index, tuple) else (index,)
    return all(
        item is None or item is Ellipsis or isinstance(item, (int, slice))
        for item in items
    )


def _clone(mode, func, args, kwargs):
    """`clone`, its DTensor result noted as fresh for the next torch
    call (`mode.just_cloned`, read by `_set_item`)."""
    value = func(*args, **kwargs)
    if (
        type(value) is DTensor
        and not value.requires_grad
        and not torch.compiler.is_compiling()
    ):
        mode.fresh_clone = value
    return value


def _split_like_value(target, index, value):
    """Lays `target`, a fresh clone, out split where `value`, written at
    `index` (basic), is split and `target` replicated: along the
    target's dimension that the value's split dimension fills whole (on
    a mesh axis of one process too, where it moves nothing and spares
    the operators that meet both a relayout). The clone's local tensor
    becomes its chunk, in place (nothing else has read the clone yet).
    """
    target_dims = _target_dims(index, target.ndim)
    if target_dims is None:
        return
    mesh = target.device_mesh
    offset = len(target_dims) - value.ndim
    placements = list(target.placements)
    split = {p.dim for p in placements if p.is_shard()}
    for axis, (mine, theirs) in enumerate(
        zip(target.placements, value.placements)
    ):
        if (
            not mine.is_replicate()
            or type(theirs) is not Shard
            or theirs.dim + offset < 0
        ):
            continue
        dim = target_dims[theirs.dim + offset]
        if (
            dim is None
            or dim in split
            or target.shape[dim] != value.shape[theirs.dim]
        ):
            continue
        placements[axis] = Shard(dim)
        split.add(dim)
    if placements != list(target.placements):
        torch_internals.take_layout(
            target, target.redistribute(mesh, placements)
        )
        # A relayout in place that a call on local tensors would not make.
        local_call_checks.note_effect()


def _target_dims(index, ndim):
    """Per dimension of `target[index]` (a basic index), the target's
    dimension it views (None where `None` adds one); None for an index
    with a bool or more than one Ellipsis."""
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(item, bool) for item in items):
        return None
    if sum(item is Ellipsis for item in items) > 1:
        return None
    consumed = sum(isinstance(item, (int, slice)) for item in items)
    dims, dim = [], 0
    for item in items:
        if item is None:
            dims.append(None)
        elif item is Ellipsis:
            dims.extend(range(dim, dim + ndim - consumed))
            dim += ndim - consumed
        elif isinstance(item, slice):
            dims.append(dim)
            dim += 1
        else:
            dim += 1
    return dims + list(range(dim, ndim))


def _replicated_where(target, value):
    """`value` replicated on every mesh axis where `target` is."""
    if not isinstance(value, DTensor):
        return value
    placements = [
        Replicate() if t.is_replicate() else p
        for t, p in zip(target.placements, value.placements)
    ]
    return _fit(value, placements)


def _index_put(mode, func, args, kwargs):
    """`index_put(_)(target, indices, values, accumulate)` in the target's
    layout: written where the target is split along an indexed dimension
    (`_put_owned_elements`), else with the indices and values replicated
    where the target is."""
    target = args[0]
    if not isinstance(target, DTensor):
        return func(*args, **kwargs)
    kwargs = dict(kwargs)
    indices = args[1] if len(args) > 1 else kwargs.pop("indices")
    values = args[2] if len(args) > 2 else kwargs.pop("values")
    accumulate = args[3] if len(args) > 3 else kwargs.pop("accumulate", False)
    if _writes_owned_elements(target, indices, values):
        if func is not torch.Tensor.index_put_:
            target = target.clone()
        return _put_owned_elements(target, indices, values, accumulate)
    indices = type(indices)(_replicated_where(target, i) for i in indices)
    values = _replicated_where(target, values)
    return func(target, indices, values, accumulate)


def _writes_owned_elements(target, indices, values):
    """Whether `_put_owned_elements` writes this `index_put`: the target is
    split along dimensions it indexes (DTensor would gather it), indexes
    a leading run of dimensions without `None`, is split along no other
    one, holds no partial sum, and no gradient is being recorded."""
    split = {p.dim for p in target.placements if p.is_shard()}
    if not split or any(p.is_partial() for p in target.placements):
        return False
    if any(index is None for index in indices) or not split <= set(
        range(len(indices))
    ):
        return False
    recorded = (target, values, *indices)
    return not (
        torch.is_grad_enabled()
        and any(getattr(t, "requires_grad", False) for t in recorded)
    )


def _put_owned_elements(target, indices, values, accumulate):
    """Writes into each process's shard the elements it owns.

    Every process takes all indices and values (gathered where split:
    what is written is small next to the target), keeps the elements
    whose indices fall in its shard, and writes them into its local
    tensor at indices made local. Each element is written by the one
    process that owns it, so the result is exact, with and without
    `accumulate`; the target keeps its layout and is never gathered.
    """
    local = target.to_local()
    local_shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    indices = torch.broadcast_tensors(
        *(_whole(index).to(torch.long) for index in indices)
    )
    owned_values = _held_as_owned(target, indices, values)
    if owned_values is None:
        # Values gathered, written at local indices: a call on local
        # tensors would not.
        local_call_checks.note_effect()
        values = _whole(values).to(local.dtype)
        values = values.broadcast_to(
            (*indices[0].shape, *target.shape[len(indices) :])
        )
    else:
        # Each process writes the values it holds (a token's keys, split
        # by heads, into a head-split cache): a call on local tensors
        # that computes its indices from its local shapes writes the
        # same elements, which `inference_local_calls` checks bit for bit.
        local_call_checks.note_owned_write()
    owned = torch.ones(indices[0].shape, dtype=torch.bool, device=local.device)
    local_indices = []
    for dim, index in enumerate(indices):
        index = index % target.shape[dim]
        start, size = offset[dim], local_shape[dim]
        owned &= (index >= start) & (index < start + size)
        local_indices.append(index - start)
    if owned_values is None:
        owned_values = values[owned]
    local.index_put_(
        tuple(index[owned] for index in local_indices),
        owned_values.to(local.dtype),
        accumulate=accumulate,
    )
    return target


def _held_as_owned(target, indices, values):
    """This process's values, flattened, where on every process they are
    exactly the values of the elements it owns, in order; else None.

    Only for values split along one mesh axis of more than one process
    (a `Shard` or `StridedShard`), where the target is split along an
    indexed dimension, replicated with it on every other such axis, and
    one index per value (no broadcasting). Every process computes the
    answer for every coordinate on that axis, from the placements and
    the (replicated) indices: all take the same path.
    """
    if not isinstance(values, DTensor) or len(indices) != target.ndim:
        return None
    if tuple(values.shape) != tuple(indices[0].shape):
        return None
    mesh = target.device_mesh
    axes = [a for a in range(mesh.ndim) if mesh.size(a) > 1]
    split = [a for a in axes if not values.placements[a].is_replicate()]
    if len(split) != 1 or any(
        not target.placements[a].is_replicate() for a in axes if a != split[0]
    ):
        return None
    (axis,) = split
    mine, theirs = target.placements[axis], values.placements[axis]
    if type(mine) is not Shard or type(theirs) not in (
        Shard,
        torch_internals.StridedShard,
    ):
        return None
    size, count = target.shape[mine.dim], mesh.size(axis)
    positions = torch.arange(values.numel()).view(values.shape)
    held = torch_internals.placement_chunks(theirs, positions, count)
    bounds = torch_internals.placement_chunks(
        Shard(0), torch.arange(size), count
    )
    index = (indices[mine.dim] % size).reshape(-1).cpu()
    for chunk, rows in zip(held, bounds):
        start, stop = (rows[0], rows[-1] + 1) if len(rows) else (0, 0)
        owned = torch.nonzero((index >= start) & (index < stop)).flatten()
        if not torch.equal(owned, chunk.reshape(-1)):
            return None
    return torch_internals.local_tensor(values).reshape(-1)


def _whole(value):
    """The whole value of `value` as a plain tensor (gathered if split;
    a replicated one's local tensor, without a dispatch)."""
    if not isinstance(value, DTensor):
        return value
    if all(p.is_replicate() for p in value.placements):
        return torch_internals.local_tensor(value)
    return value.full_tensor()


# Torch function -> handler(mode, func, args, kwargs), for
# `created_tensors`'s table.
HANDLERS = {
    torch.clone: _clone,
    torch.Tensor.clone: _clone,
    torch.Tensor.copy_: _copy,
    torch.Tensor.__setitem__: _set_item,
    torch.Tensor.index_put_: _index_put,
    torch.Tensor.index_put: _index_put,
    torch.index_put: _index_put,
}
