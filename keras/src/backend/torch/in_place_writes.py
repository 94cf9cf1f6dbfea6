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
- Any other `index_put_`: on every mesh axis where the target is
  replicated, the indices and values are replicated too (the layout
  DTensor's rule needs there); on the other axes DTensor decides.

What is written is usually small (one token's keys and values), so its
redistribution costs a small all-gather. The handlers run in the step's
torch function mode (`created_tensors`), on every process alike.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

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
    values = _whole(values).to(local.dtype)
    values = values.broadcast_to(
        (*indices[0].shape, *target.shape[len(indices) :])
    )
    owned = torch.ones(indices[0].shape, dtype=torch.bool, device=local.device)
    local_indices = []
    for dim, index in enumerate(indices):
        index = index % target.shape[dim]
        start, size = offset[dim], local_shape[dim]
        owned &= (index >= start) & (index < start + size)
        local_indices.append(index - start)
    local.index_put_(
        tuple(index[owned] for index in local_indices),
        values[owned],
        accumulate=accumulate,
    )
    return target


def _whole(value):
    """The whole value of `value` as a plain tensor (gathered if split)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value


# Torch function -> handler(mode, func, args, kwargs), for
# `created_tensors`'s table.
HANDLERS = {
    torch.Tensor.copy_: _copy,
    torch.Tensor.__setitem__: _set_item,
    torch.Tensor.index_put_: _index_put,
    torch.Tensor.index_put: _index_put,
    torch.index_put: _index_put,
}
