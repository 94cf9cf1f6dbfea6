"""Local results in the memory layout DTensor records for them.

DTensor records a result's strides from the op applied to the global
shapes, and computes the local result by applying the op to the local
shards. For `cat` the two can differ (see `_CAT`), and a later `view`,
valid for the recorded strides, fails on the local tensor ("view size is
not compatible with input tensor's size and stride").

`recorded_local_layouts`, which `created_tensors` enters for the time of a
step, installs a DTensor handler for `cat` that dispatches it as DTensor
does and copies the local result into the recorded layout where the two
differ: the same values, and a copy in the cases that would otherwise
fail. Outside a step, DTensor is left as it is. A handler the process
installed for `cat` itself is kept. Collectives: none of its own; those
of DTensor's dispatch of `cat` are issued as before.

Torch gap: torch 2.11 and 2.13 (not reported upstream yet). It can go
once DTensor lays local `cat` results out as it records them.
"""

import contextlib

import torch

from keras.src.backend.torch import torch_internals

# Torch leaves the strides of size-1 dimensions free, and the global and
# local computations may set them differently (`view` derives them from the
# shape around them). Most ops lay their result out from the order of the
# other dimensions' strides, so the two still agree. `cat` does not: it
# takes its result's memory format from its inputs' suggested format, and
# that suggestion reads the strides of size-1 dimensions too. Where the
# local inputs look `channels_last` and the global ones do not, the local
# result is `channels_last` while DTensor records it contiguous.
#
# Keras steps meet this in the backward of Gemma's rotary embedding with
# one key/value head (Gemma 2B's multi-query attention): `split`'s gradient
# is a `cat` of 4-D gradients whose head dimension has size 1, and the
# query projection's `einsum` views the result. Every model of that shape
# failed to train under any distribution, DataParallel included.
_CAT = torch.ops.aten.cat.default


@contextlib.contextmanager
def recorded_local_layouts():
    """Lays local `cat` results out as DTensor records them, inside the
    context; re-entrant, and per process (DTensor's handlers are)."""
    handlers = torch_internals.custom_op_handlers()
    if _CAT in handlers:
        yield
        return
    # Inside a step, each `cat` of DTensors takes DTensor's Python dispatch
    # path instead of its C++ one (about 20 µs more per call on CPU).
    handlers[_CAT] = _cat_in_recorded_layout
    try:
        yield
    finally:
        handlers.pop(_CAT, None)


def _cat_in_recorded_layout(op_call, args, kwargs):
    """DTensor's `cat`, with its local result in the recorded layout."""
    dispatcher = torch_internals.op_dispatcher()
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    local = torch_internals.local_results(dispatcher, op_call, args, op_info)
    spec = op_info.output_sharding.output_spec
    return dispatcher.wrap(in_recorded_layout(local, spec), spec)


def in_recorded_layout(local, spec):
    """`local` copied into the layout `spec` records, where it differs.

    The recorded layout is the order of the global strides of the
    dimensions larger than one; the local tensor is compared in that
    order, as dense strides for its own shape.
    """
    if not isinstance(local, torch.Tensor) or spec.tensor_meta is None:
        return local
    strides = recorded_local_strides(local.shape, spec.tensor_meta.stride)
    if _same_layout(local.shape, local.stride(), strides):
        return local
    return torch.empty_strided(
        local.shape, strides, dtype=local.dtype, device=local.device
    ).copy_(local)


def recorded_local_strides(local_shape, global_strides):
    """Dense strides for `local_shape`, its dimensions ordered as
    `global_strides` orders them (the last dimension fastest on ties)."""
    order = sorted(
        range(len(local_shape)), key=lambda d: (global_strides[d], -d)
    )
    strides = [0] * len(local_shape)
    step = 1
    for d in order:
        strides[d] = step
        step *= max(local_shape[d], 1)
    return tuple(strides)


def _same_layout(shape, strides, expected):
    return all(
        size <= 1 or stride == want
        for size, stride, want in zip(shape, strides, expected)
    )
