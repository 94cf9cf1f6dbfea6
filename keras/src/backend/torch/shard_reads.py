"""A distributed variable loaded from a saved array reads only its shard.

Under a distribution, Keras's weights stores hand out saved arrays unread
(`keras.src.saving.dataset_views.DatasetView`). When such a view is
assigned to a variable whose value is a DTensor, each process reads from
the file only the blocks of its own local tensor, and writes them into
the variable's local tensor a chunk of rows at a time: no process reads,
holds or sends the full value of a sharded variable, and a load holds
one chunk beside the variables. A replicated variable is read
whole on each process (its local tensor is the whole value).

Which elements a process holds is DTensor's answer, not ours: each
dimension's global positions are laid out with the variable's placements
on that dimension (`distribute_tensor` on a range of positions, which
splits locally and communicates nothing), so uneven splits, dimensions
split over several mesh axes and strided splits read what DTensor keeps.
A process's local tensor is the product of its positions along each
dimension; a dimension's positions form one or more runs of consecutive
indices, and each combination of runs is one block read from the file.

No collective is issued.
"""

import itertools
import math

import ml_dtypes
import numpy as np
import torch
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src.backend.torch import deferred_initialization
from keras.src.backend.torch import local_call_checks
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch.core import convert_to_tensor
from keras.src.backend.torch.torch_internals import StridedShard

# Bytes of one chunk of rows read from a file: the load's working buffer.
CHUNK_BYTES = 16 * 1024 * 1024


def assign_from_view(parameter, view, dtype):
    """Writes this process's part of a saved array into `parameter`.

    The blocks of the local tensor are read in chunks of rows of at most
    `CHUNK_BYTES` and copied into the local tensor as they come, so a
    load holds one chunk beside the variable, whatever its size.

    Args:
        parameter: the variable's DTensor value.
        view: the saved array (a `DatasetView`: `shape`, `read_blocks`),
            of `parameter`'s shape.
        dtype: the variable's Keras dtype.
    """
    local_call_checks.note_effect()
    spec = torch_internals.spec_of(parameter)
    positions = local_positions(
        tuple(parameter.shape), spec.mesh, spec.placements
    )
    local = torch_internals.local_tensor(parameter)
    with torch.no_grad():
        write_blocks(local, positions, view, dtype)
    # A variable a load creates and then writes needs no initial values.
    deferred_initialization.note_written(local)


def write_blocks(local, positions, view, dtype):
    """Reads the elements at `positions` (per dimension, in local order)
    from `view` into the tensor `local`, chunk by chunk."""
    for block in itertools.product(*[runs_of(p) for p in positions]):
        for source, target in _chunks(block, view.dtype.itemsize):
            (value,) = view.read_blocks([source])
            local[target].copy_(_as_tensor(value, dtype))


def _as_tensor(value, dtype):
    """A chunk read from a file as a tensor of the variable's dtype."""
    if value.dtype == ml_dtypes.bfloat16 and dtype == "bfloat16":
        # The same bits, no copy: `convert_to_tensor` goes through float32,
        # three times the chunk's bytes.
        bits = torch.from_numpy(np.ascontiguousarray(value).view(np.int16))
        return bits.view(torch.bfloat16)
    return convert_to_tensor(value, dtype=dtype)


def _chunks(block, itemsize):
    """A block's `(source, target)` slices, cut into chunks of rows."""
    source = tuple(slice(start, stop) for start, stop, _ in block)
    target = tuple(
        slice(offset, offset + stop - start) for start, stop, offset in block
    )
    if not block:
        return [(source, target)]
    row_bytes = itemsize * math.prod(s.stop - s.start for s in source[1:])
    rows = max(1, CHUNK_BYTES // max(row_bytes, 1))
    (first, stop, offset) = block[0]
    return [
        (
            (slice(start, min(start + rows, stop)), *source[1:]),
            (
                slice(
                    offset + start - first,
                    offset + min(start + rows, stop) - first,
                ),
                *target[1:],
            ),
        )
        for start in range(first, max(stop, first + 1), rows)
    ]


def local_positions(shape, mesh, placements):
    """Per dimension, the global indices this process holds, in the order
    of its local tensor.

    Args:
        shape: the global shape.
        mesh: the torch `DeviceMesh`.
        placements: one placement per mesh axis.

    Returns:
        A list of 1-D numpy integer arrays, one per dimension.
    """
    positions = []
    for dim, size in enumerate(shape):
        on_dim = tuple(_placement_on_dim(p, dim) for p in placements)
        every = torch.arange(size, dtype=torch.int64)
        if all(isinstance(p, Replicate) for p in on_dim):
            positions.append(every.numpy())
            continue
        local = distribute_tensor(every, mesh, on_dim, src_data_rank=None)
        positions.append(local.to_local().cpu().numpy())
    return positions


def _placement_on_dim(placement, dim):
    """A placement's effect on dimension `dim`, as a placement of a 1-D
    tensor of that dimension's positions."""
    if isinstance(placement, Partial):
        raise ValueError(
            f"A variable cannot be loaded into placements {placement}: a "
            "variable's layout shards or replicates its values."
        )
    if isinstance(placement, StridedShard):
        if placement.dim != dim:
            return Replicate()
        return StridedShard(0, split_factor=placement.split_factor)
    if isinstance(placement, Shard):
        return Shard(0) if placement.dim == dim else Replicate()
    return Replicate()


def runs_of(positions):
    """Indices as runs `(start, stop, local offset)` of consecutive ones;
    an empty dimension is one empty run."""
    if len(positions) == 0:
        return [(0, 0, 0)]
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(positions)]])
    return [
        (int(positions[a]), int(positions[b - 1]) + 1, int(a))
        for a, b in zip(starts, stops)
    ]
