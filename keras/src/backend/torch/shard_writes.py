"""A sharded variable saved a chunk at a time: no process gathers it whole.

Saving a Keras file under a distribution runs on every process, and only
process 0 writes (`keras.src.saving.distributed_saving`). Gathering a
sharded variable's full value to write it holds the whole value on every
process, and DTensor's gather holds it twice while it runs. Here each
process sends process 0 its local tensor a chunk of rows at a time
(`torch.distributed.gather`), and process 0 writes each chunk into the
file where its elements belong, then drops it: process 0 holds one chunk
from each process, the others one chunk, whatever the variable's size.

Where each chunk belongs is DTensor's answer (`shard_reads.local_positions`,
on every process); processes that hold the same elements (replicas along
a mesh axis the variable is replicated on) send theirs once, from the
first coordinate of that axis.

Collectives in lockstep: every process calls `write_by_chunks` for the
same variables in the same order (the save's order), and issues the same
collectives: one exchange of the processes' positions, then one gather per
chunk, their number computed from what every process knows.
"""

import math

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

from keras.src.backend.torch import shard_reads
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch.core import convert_to_numpy

# Bytes of one process's chunk of rows (process 0 receives one from each
# process). Small, as the C heap keeps what larger chunks leave behind:
# a 1 GiB model's save raised process 0's memory by 307 MiB with chunks
# of 16 MiB, 87 MiB with chunks of 4 MiB (2 processes).
CHUNK_BYTES = 4 * 1024 * 1024


def write_by_chunks(parameter, write):
    """Gathers the DTensor `parameter` to process 0 a chunk at a time.

    Args:
        parameter: a variable's DTensor value.
        write: on process 0, called as `write(selection, values)` for each
            block of the full value received (`selection` a tuple of
            slices of the full value, `values` a numpy array); never
            called on the other processes.
    """
    spec = torch_internals.spec_of(parameter)
    local = torch_internals.local_tensor(parameter).detach()
    shape = tuple(parameter.shape)
    positions = shard_reads.local_positions(shape, spec.mesh, spec.placements)
    sends = _holds_first_replica(spec)
    shapes = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, (sends, tuple(local.shape), positions))
    senders = [rank for rank, (s, _, _) in enumerate(shapes) if s]
    widest = [
        max(shapes[r][1][d] for r in senders) for d in range(1, len(shape))
    ]
    row_bytes = local.element_size() * math.prod(widest)
    rows = max(1, CHUNK_BYTES // max(row_bytes, 1))
    count = math.ceil(max(shapes[r][1][0] for r in senders) / rows)
    is_writer = dist.get_rank() == 0
    # The buffers serve every chunk: chunks allocated and freed one after
    # another grow the C heap (glibc raises its threshold for returning
    # memory to the system to the size of the blocks it frees), and the
    # process's resident memory with it.
    piece = torch.zeros((rows, *widest), dtype=local.dtype, device=local.device)
    received = [torch.empty_like(piece) for _ in shapes] if is_writer else None
    for chunk in range(count):
        start = chunk * rows
        if sends:
            mine = local[start : start + rows]
            piece[tuple(slice(0, n) for n in mine.shape)] = mine
        dist.gather(piece, received, dst=0)
        if not is_writer:
            continue
        for rank in senders:
            _write_piece(write, received[rank], shapes[rank], start, rows)


def _holds_first_replica(spec):
    """Whether this process is the first of its replicas: at coordinate 0
    of every mesh axis the value is replicated on."""
    coordinate = spec.mesh.get_coordinate()
    return all(
        coordinate[dim] == 0
        for dim, placement in enumerate(spec.placements)
        if isinstance(placement, Replicate)
    )


def _write_piece(write, piece, sender, start, rows):
    """Writes the rows `[start, start + rows)` of a sender's local tensor,
    received padded in `piece`, where they belong in the full value."""
    _, local_shape, positions = sender
    stop = min(start + rows, local_shape[0])
    if stop <= start:
        return
    values = _numpy_view(piece)
    positions = [positions[0][start:stop], *positions[1:]]
    runs = [shard_reads.runs_of(p) for p in positions]
    for block in _product(runs):
        selection = tuple(slice(s, e) for s, e, _ in block)
        local = tuple(slice(o, o + e - s) for s, e, o in block)
        write(selection, np.ascontiguousarray(values[local]))


def _numpy_view(piece):
    """`piece` as a numpy array: on CPU a view, no copy (bfloat16's bits
    viewed as `ml_dtypes.bfloat16`, which torch's `numpy` refuses)."""
    if piece.device.type != "cpu":
        return convert_to_numpy(piece)
    if piece.dtype == torch.bfloat16:
        return piece.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return piece.numpy()


def _product(runs):
    blocks = [()]
    for dim_runs in runs:
        blocks = [block + (run,) for block in blocks for run in dim_runs]
    return blocks
