"""Redistributions inside Keras steps skip mesh axes of one process.

Contract: inside a Keras step on this thread
(`created_tensors.in_step_context`), a DTensor redistribution takes the
placement on each mesh axis of one process straight to the target's: that
one process's local tensor is the target's already (a shard of one
process is the whole dimension; a partial sum over one process is the
sum). Torch communicates nothing there either, but plans the axis with
the others: each such redistribution pays DTensor's Python planning, and
a value partial over that axis and another is announced as "2 sequential
all_reduce operations" (a warning) where one runs. A redistribution left
with nothing to move returns the local tensor as it is. Plain shards,
replication and partial sums are taken over; any other placement
(`_StridedShard`, `_MaskPartial`, whose reduction also frees its mask) is
left to torch. Outside a step torch's function runs unchanged.

Inside a step, too, a partial value of one reduce op asked for as a
partial value of another (a MoE router's auxiliary loss, a mean over the
split batch, `Partial("avg")`, added to the training loss, a
`Partial("sum")`) is reduced on those axes first, then taken to the
target: torch refuses to move between partial types ("Redistribution
from one partial type (P(avg)) to another (P(sum)) is unsupported";
keras-hub's Qwen-MoE `fit` under DataParallel). One all-reduce per such
axis, on every process alike.

`register()` installs both once; `torch_workarounds` lists the gaps.
"""

import functools

from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import local_replays
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch.torch_internals import DTensorSpec

# The placements whose local tensor on an axis of one process is the
# whole value, whatever the other axes hold.
_PLAIN = (Shard, Replicate, Partial)


@functools.cache
def register():
    """Puts `skipping_unit_axes` in front of DTensor's redistribution;
    once, whatever the number of calls."""
    torch_internals.wrap_local_redistribution(skipping_unit_axes)


def skipping_unit_axes(redistribute):
    """`redistribute` (DTensor's `redistribute_local_tensor`), with the
    placements on mesh axes of one process taken over in a step."""

    @functools.wraps(redistribute)
    def redistribute_local_tensor(local, current, target, **kwargs):
        if created_tensors.in_step_context():
            current = _unit_axes_as_target(current, target)
            if current.placements == target.placements:
                return local
            reduced = _other_partials_reduced(current, target)
            if reduced is not current:
                local = redistribute(local, current, reduced, **kwargs)
                current = reduced
            if local_replays.recordings_open():
                local_replays.note_redistribution(
                    local, current, target, created_tensors.current_call()
                )
        return redistribute(local, current, target, **kwargs)

    redistribute_local_tensor.keras_skips_unit_axes = True
    return redistribute_local_tensor


def _unit_axes_as_target(current, target):
    """`current` with the target's placement on each mesh axis of one
    process where both are plain (`_PLAIN`)."""
    mesh = current.mesh
    placements = list(current.placements)
    changed = False
    for mesh_dim, (have, want) in enumerate(
        zip(current.placements, target.placements)
    ):
        if have == want or mesh.size(mesh_dim) != 1:
            continue
        if type(have) in _PLAIN and type(want) in _PLAIN:
            placements[mesh_dim] = want
            changed = True
    if not changed:
        return current
    return DTensorSpec(mesh, tuple(placements), tensor_meta=current.tensor_meta)


def _other_partials_reduced(current, target):
    """`current` with `Replicate` on each mesh axis where it is partial
    and the target is partial with another reduce op (or `current` as it
    is: nothing to convert)."""
    placements = list(current.placements)
    changed = False
    for mesh_dim, (have, want) in enumerate(
        zip(current.placements, target.placements)
    ):
        if (
            type(have) is Partial
            and type(want) is Partial
            and have.reduce_op != want.reduce_op
        ):
            placements[mesh_dim] = Replicate()
            changed = True
    if not changed:
        return current
    return DTensorSpec(
        current.mesh, tuple(placements), tensor_meta=current.tensor_meta
    )
