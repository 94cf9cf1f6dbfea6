"""What a layer's local run replays of its first call on DTensors.

A layer split over a model axis runs on local tensors where its first
call's check, run on DTensors and locally, gives the same local outputs
(`inference_local_calls`), and with gradients the same gradients too
(`training_local_calls`; `shard_local_checks`). Three things the DTensor call
does, a run on plain tensors would not:

- **Reshapes by a global size.** keras-hub's attention layers reshape
  their queries to `(batch, length, num_key_value_heads, groups,
  head_dim)` and their results to `(batch, length, num_query_heads,
  head_dim)`: whole head counts, where each process holds some heads.
  DTensor maps the global shape onto the shards; a local tensor cannot
  take it.
- **The all-reduces at its sublayers' ends.** A row-parallel sublayer's
  output is all-reduced where the sublayer ends
  (`batch_local.partial_sums_reduced`): an attention layer's output
  projection, a decoder block's MLP.
- **Replicated operands cut to a split one's shard.** An operation of a
  split tensor and a replicated one takes the replicated one's chunk
  that matches this process's shard, without a collective: a LoRA
  layer's kernel, split by heads, plus the product of its replicated
  factors. An operation of a partial sum and a replicated tensor takes
  the replicated one's share, its value divided by the number of
  processes: a row-parallel layer's replicated bias, added to its
  partial sum once in total.

While the first call runs on DTensors (`recording`), all three are
noted in a `Record`: each reshape of a DTensor, by its local input shape
and the shape asked for, with the local shape DTensor gave; at each
layer end (`layer_end`), which outputs were reduced over which mesh
axes; and each argument of a torch call that DTensor cut from replicated
to split or to partial sums (`note_redistribution`), by the call and its
arguments' local shapes, with the `Cut` it made. The local runs then
replay them (`replaying`): a reshape with a noted key asks for the noted
local shape, a call with a noted key cuts its arguments as noted (a key
noted with two results is not replayed), and at the n-th layer end the
outputs reduced at the first call's n-th layer end are all-reduced over
the same axes, on the local tensors, with the gradient DTensor gives
such a reduction (`_ReducedSum`). Whether a local run computes exactly
the DTensor call's local outputs is checked as before: the notes only
let it try.

Contract: recording issues no collective and changes no value. A replay
issues, at each layer end of the local run, the all-reduces the first
call issued at that layer end, on the same groups, in the same order:
every process runs the same program, so they stay in lockstep.
"""

import math
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Shard
from torch.overrides import TorchFunctionMode

from keras.src.backend.torch import local_call_state
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import torch_runtime
from keras.src.backend.torch.torch_internals import (
    compute_local_shape_and_global_offset,
)

# A reshape noted with two different local results (never translated).
_AMBIGUOUS = None


class Record:
    """The notes of one first call on DTensors.

    Attributes:
        shapes: (local input shape, requested shape) -> the local shape
            of the result, or `_AMBIGUOUS`.
        ends: the number of layer ends so far.
        reductions: layer end number -> ((output index, mesh, axes), ...)
            for the outputs reduced there.
        cuts: (torch function, its arguments' local shapes) -> argument
            index -> the `Cut` DTensor made of it, or `_AMBIGUOUS`.
    """

    def __init__(self):
        self.shapes = {}
        self.ends = 0
        self.reductions = {}
        self.cuts = {}

    def note_shape(self, key, local_shape):
        noted = self.shapes.get(key, local_shape)
        self.shapes[key] = local_shape if noted == local_shape else _AMBIGUOUS

    def note_cut(self, key, index, cut):
        """Notes that the call of `key` cut its argument `index` as `cut`
        (a `Cut`)."""
        cuts = self.cuts.get(key, {})
        if cuts is _AMBIGUOUS:
            return
        if cuts.get(index, cut) != cut:
            self.cuts[key] = _AMBIGUOUS
            return
        cuts[index] = cut
        self.cuts[key] = cuts

    def note_end(self, reductions):
        if reductions:
            self.reductions[self.ends] = reductions
        self.ends += 1

    def translations(self):
        """The reshapes a local run changes: keys noted once, whose local
        result is not the requested shape."""
        return {
            key: shape
            for key, shape in self.shapes.items()
            if shape is not _AMBIGUOUS and shape != key[1]
        }


class Cut(NamedTuple):
    """How a local run takes a replicated argument as DTensor took it.

    Attributes:
        slices: the chunk, ((dim, start, length), ...).
        share: the number of processes over which DTensor made it
            partial sums (a replicated value v is v / n on each, as
            `Partial` partitions a sum); 1 where it made none.
    """

    slices: tuple
    share: int = 1


class ReplayPlan:
    """What the local runs of a first call replay, made once from its
    `Record`: the reshapes and cuts to take (noted once), and the
    reductions at layer ends."""

    def __init__(self, record):
        self.shapes = record.translations()
        self.cuts = {
            key: cuts
            for key, cuts in record.cuts.items()
            if cuts is not _AMBIGUOUS
        }
        self.cut_functions = frozenset(key[0] for key in self.cuts)
        self.reductions = record.reductions


class Replay:
    """One local run's replay of a `ReplayPlan`: the plan, and how many
    layer ends the run has reached."""

    def __init__(self, plan):
        self.plan = plan
        self.ends = 0


class recording:
    """The context of a first call on DTensors: yields its `Record`.

    Recordings nest (a sublayer's first call inside its layer's): each
    notes what happens inside it. A check's local run (`paused`) notes
    nothing in the recordings around it.
    """

    def __enter__(self):
        self.record = Record()
        local_call_state.step_state().recordings.append(self.record)
        return self.record

    def __exit__(self, *exc_info):
        # The innermost recording is this one.
        local_call_state.step_state().recordings.pop()


class paused:
    """A context where the open recordings note nothing: a first call's
    check runs the layer a second time, which its callers' local runs
    will not."""

    def __enter__(self):
        state = local_call_state.step_state()
        self.recordings, state.recordings = state.recordings, []

    def __exit__(self, *exc_info):
        local_call_state.step_state().recordings = self.recordings


class replaying:
    """The context of a local run: layer ends (`layer_end`) take the
    replay's reductions and, where it has any, reshapes its local
    shapes."""

    def __init__(self, replay):
        self.replay = replay
        plan = replay.plan
        self.mode = _LocalRun(plan) if plan.shapes or plan.cuts else None

    def __enter__(self):
        local_call_state.step_state().replays.append(self.replay)
        if self.mode is not None:
            self.mode.__enter__()

    def __exit__(self, *exc_info):
        if self.mode is not None:
            self.mode.__exit__(*exc_info)
        local_call_state.step_state().replays.pop()


class _LocalRun(TorchFunctionMode):
    """Reshapes whose (input shape, requested shape) is in the plan's
    `shapes` ask for its local shape instead; calls whose key is in its
    `cuts` take the noted slices of their arguments; every other call
    runs as it is."""

    def __init__(self, plan):
        super().__init__()
        self.plan = plan

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plan = self.plan
        if func in plan.cut_functions:
            cuts = plan.cuts.get((func, _local_shapes(args)))
            if cuts is not None:
                args = _cut(args, cuts)
        if func in HANDLERS and plan.shapes and args:
            requested = _requested_shape(args, kwargs)
            shape = plan.shapes.get((tuple(args[0].shape), requested))
            if shape is not None:
                return func(args[0], shape)
        return func(*args, **kwargs)


def _local_shapes(args):
    """The local shape of each tensor argument (None for the others)."""
    return tuple(
        tuple(torch_internals.local_tensor(arg).shape)
        if type(arg) is DTensor
        else (tuple(arg.shape) if isinstance(arg, torch.Tensor) else None)
        for arg in args
    )


def _cut(args, cuts):
    args = list(args)
    for index, cut in cuts.items():
        value = args[index]
        for dim, start, length in cut.slices:
            value = value.narrow(dim, start, length)
        if cut.share != 1:
            value = _Share.apply(value, cut.share)
        args[index] = value
    return tuple(args)


class _Share(torch.autograd.Function):
    """A replicated value's share of a partial sum, `value / share` (as
    `Partial` partitions a sum), whose gradient is the value's whole
    gradient, as DTensor gives it: the value is replicated, and so is
    the gradient of the sum it joins, reduced where the layer ends
    (`_ReducedSum`); each process's share adds the value once to that
    sum in total, so the value's gradient is the sum's, unscaled, on
    every process."""

    @staticmethod
    def forward(ctx, value, share):
        return value / share

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def note_redistribution(local, current, target, call):
    """Notes, in the open recordings, a redistribution that cuts `local`
    from replicated to split or to partial sums (on every mesh axis it
    changes), as an argument of `call`, the torch call the step runs
    (`(func, args)`)."""
    records = local_call_state.step_state().recordings
    if not records or call is None:
        return
    cut = _cut_of(current, target)
    if cut is None:
        return
    func, args = call
    for index, arg in enumerate(args):
        if type(arg) is DTensor and torch_internals.local_tensor(arg) is local:
            key = (func, _local_shapes(args))
            for record in records:
                record.note_cut(key, index, cut)
            return


def _cut_of(current, target):
    """The `Cut` that takes the local tensor of `current` to that of
    `target`, where every changed mesh axis goes from replicated to a
    plain shard or a partial sum; else None."""
    changed = [
        (axis, have, want)
        for axis, (have, want) in enumerate(
            zip(current.placements, target.placements)
        )
        if have != want
    ]
    if not changed or not all(
        have.is_replicate() and type(want) in (Shard, Partial)
        for _, have, want in changed
    ):
        return None
    if any(
        type(want) is Partial and not want.is_partial("sum")
        for _, _, want in changed
    ):
        return None
    shape = current.tensor_meta.shape
    mesh = current.mesh
    have_shape, have_offset = compute_local_shape_and_global_offset(
        shape, mesh, current.placements
    )
    want_shape, want_offset = compute_local_shape_and_global_offset(
        shape, mesh, target.placements
    )
    slices = tuple(
        (dim, want_offset[dim] - have_offset[dim], want_shape[dim])
        for dim in range(len(shape))
        if want_shape[dim] != have_shape[dim]
    )
    share = math.prod(
        mesh.size(axis) for axis, _, want in changed if type(want) is Partial
    )
    return Cut(slices, share)


def recordings_open():
    """Whether a recording is open on this thread."""
    return bool(local_call_state.step_state().recordings)


def active():
    """Whether layer ends are noted or replayed on this thread: a
    recording or a replay is open, or a check runs a layer on DTensors
    (whose layer ends are counted, `counting_layer_ends`)."""
    state = local_call_state.step_state()
    return bool(state.recordings or state.replays or state.dtensor_checks)


def counting_layer_ends():
    """Whether a DTensor call's layer ends are noted or counted here: in
    a first call's recording, or in a check's run on DTensors, whose
    all-reduces the first calls around it allow
    (`collectives_at_layer_ends`)."""
    state = local_call_state.step_state()
    return bool(state.recordings or state.dtensor_checks)


def layer_end(outputs, reduced):
    """A layer's outputs where it ends, while `active()`.

    Outside a local run, `reduced(outputs)` (the DTensor outputs' partial
    sums reduced) is noted in the open recordings; inside one, the
    outputs reduced at the first call's layer end of the same number are
    all-reduced, and noted so. Either way the all-reduces are counted
    per group (`collectives_at_layer_ends`).
    """
    state = local_call_state.step_state()
    if state.replays:
        outputs, reductions = _replayed(state.replays[-1], outputs)
    else:
        reductions = _reductions(outputs)
        outputs = reduced(outputs)
    for record in state.recordings:
        record.note_end(reductions)
    for _, mesh, axes in reductions:
        for axis in axes:
            state.layer_end_collectives[mesh.get_group(axis)] += 1
    return outputs


def collectives_at_layer_ends():
    """Process group -> the all-reduces issued on it at layer ends while
    recordings or replays were open, on this thread: those a local run
    replays, in a first call's own run or in its sublayers' checks."""
    return dict(local_call_state.step_state().layer_end_collectives)


def _reductions(outputs):
    """(output index, mesh, axes) of each DTensor output with partial sums
    over mesh axes of more than one process (where reducing them is an
    all-reduce: DTensor moves nothing on an axis of one)."""
    leaves = torch_runtime.pytree.tree_leaves(outputs)
    return tuple(
        (index, leaf.device_mesh, _reduced_axes(leaf))
        for index, leaf in enumerate(leaves)
        if type(leaf) is DTensor and _reduced_axes(leaf)
    )


def _reduced_axes(value):
    # Partial sums only (a replay all-reduces by sum): a layer end that
    # reduces another kind is not noted, and its collective, uncounted,
    # keeps the layer on DTensors (`inference_local_calls`).
    mesh = value.device_mesh
    return tuple(
        axis
        for axis, placement in enumerate(value.placements)
        if placement.is_partial("sum") and mesh.size(axis) > 1
    )


def _replayed(replay, outputs):
    """`outputs` with the replay's reductions at this layer end."""
    reductions = replay.plan.reductions.get(replay.ends, ())
    replay.ends += 1
    if not reductions:
        return outputs, reductions
    leaves, spec = torch_runtime.pytree.tree_flatten(outputs)
    for index, mesh, axes in reductions:
        for axis in axes:
            leaf = leaves[index]
            if torch.is_grad_enabled() and leaf.requires_grad:
                leaves[index] = _ReducedSum.apply(leaf, mesh, axis)
            else:
                leaves[index] = torch_runtime.all_reduce_sum(leaf, mesh, axis)
    return torch_runtime.pytree.tree_unflatten(leaves, spec), reductions


class _ReducedSum(torch.autograd.Function):
    """The sum of partial sums over a mesh axis, whose gradient is the
    sum's: DTensor's gradient of a `Partial` to `Replicate`
    redistribution, which keeps the gradient replicated (Megatron's `g`).
    A training local run (`training_local_calls`) replays its layer ends
    through it."""

    @staticmethod
    def forward(ctx, partial, mesh, axis):
        return torch_runtime.all_reduce_sum(partial, mesh, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _requested_shape(args, kwargs):
    """The shape a reshape call asks for, as a tuple of ints; None for a
    call that asks for none (`Tensor.view(dtype)`)."""
    shape = kwargs.get("shape", args[1:])
    if len(shape) == 1 and not isinstance(shape[0], int):
        shape = shape[0]
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(size, int) for size in shape
    ):
        return None
    return tuple(shape)


def _reshape(mode, func, args, kwargs):
    """A step's reshape, noted in the open recordings."""
    value = func(*args, **kwargs)
    records = local_call_state.step_state().recordings
    if records and args and type(args[0]) is DTensor and type(value) is DTensor:
        requested = _requested_shape(args, kwargs)
        if requested is not None:
            key = (
                tuple(torch_internals.local_tensor(args[0]).shape),
                requested,
            )
            local = tuple(torch_internals.local_tensor(value).shape)
            for record in records:
                record.note_shape(key, local)
    return value


# Registered in `created_tensors`'s table of the step's mode.
HANDLERS = {
    func: _reshape
    for func in (torch.reshape, torch.Tensor.reshape, torch.Tensor.view)
}
