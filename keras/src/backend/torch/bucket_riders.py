"""Partial values that ride along with gradients in the reducer's buckets.

A partial value that is not a gradient can ride along with the gradients
(`reduced_with_gradients`): the train step's loss, a partial mean, joins
the bucket launched when backward ends, as one more element, instead of
being all-reduced by itself.

Contract: a value rides when it is a DTensor partial (`Partial("sum")` or
`Partial("avg")`) over some mesh axes of more than one process and
replicated over the others, and the backward pass run inside the block
launches, when it ends, a bucket of gradients partial over the same axes
with the same dtype. Whether it rides depends only on placements, dtypes
and the order of the program, the same on every process. A value that
does not ride is handed back as it was given, and issues no collective.

State: the riders wait on the current `reducer.Reducer`, for the time of
the block.
"""

import contextlib
import math

from torch.distributed.tensor import DTensor

from keras.src.backend.torch import bucket_assignment
from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import reducer
from keras.src.backend.torch import torch_internals


class Rider:
    """A partial DTensor that may be reduced in a bucket of gradients.

    Its local tensor joins the bucket of gradients partial over the same
    mesh axes, on the same mesh, of its dtype, launched when backward
    ends; `value()` is then its reduced value, replicated, else the
    DTensor as it was given.

    Args:
        value: the value.
        key: the key of the bucket it may join (the second part of
            `bucket_assignment.bucket_key`), or None if it may not ride.
        divisor: what its sum over the processes is divided by (the
            number of processes of its averaged axes).
    """

    def __init__(self, value, key, divisor):
        self.value_given = value
        self.local = (
            None
            if key is None
            else torch_internals.local_tensor(value).detach()
        )
        self.key = key
        self.divisor = divisor
        self.reduced = None

    def finish(self, summed):
        """Keeps the reduced value, from its sum over the processes."""
        if self.divisor > 1:
            summed = summed / self.divisor
        self.reduced = dtensor_layouts.replicated_like(
            summed.view(self.local.shape),
            torch_internals.spec_of(self.value_given),
        )

    def value(self):
        """The reduced value if a bucket carried it, else the value."""
        if self.reduced is None:
            return self.value_given
        return self.reduced


@contextlib.contextmanager
def reduced_with_gradients(value):
    """Has the buckets launched when backward ends reduce `value` too.

    Where `value` rides (see the module's contract), the one all-reduce
    of its bucket reduces it too, where it would need one of its own.
    Otherwise nothing happens.

    Args:
        value: the value, e.g. the train step's loss.

    Yields:
        A `Rider`, whose `value()` after the block is the value reduced
        by the buckets (a replicated DTensor), or `value` itself if no
        bucket carried it.
    """
    rider = rider_of(value)
    if rider.key is not None:
        reducer.current().riders.append(rider)
    try:
        yield rider
    finally:
        # The reducer that finished the backward pass was replaced: this
        # one holds the rider only if no backward pass ended in the block.
        riders = reducer.current().riders
        if rider in riders:
            riders.remove(rider)


def rider_of(value):
    """The `Rider` of `value`, with no bucket key unless it may ride."""
    if type(value) is not DTensor:
        return Rider(value, None, 1)
    spec = torch_internals.spec_of(value)
    reduction = dtensor_layouts.additive_partial_dims(spec)
    if reduction is None:
        return Rider(value, None, 1)
    partial, averaged = reduction
    size = bucket_assignment.mesh_dim_size
    partial = tuple(d for d in partial if size(spec.mesh, d) > 1)
    if not partial:
        return Rider(value, None, 1)
    divisor = math.prod(size(spec.mesh, d) for d in averaged)
    key = bucket_assignment.bucket_key(
        spec.mesh, (partial, "sum"), spec.tensor_meta.dtype
    )[1]
    return Rider(value, key, divisor)
