"""`_StridedShard` shard sizes computed outside compile's tracing modes.

Torch 2.13's `_StridedShard.local_shard_size_and_offset` finds a shard's
size by splitting a `torch.arange` of the dimension's indices. DTensor
calls it while it plans a redistribution's cost, also inside a compiled
step, where the tracing modes (fake tensors, the graph's proxies) catch
that `arange` and the size read from it: "It appears that you're trying
to get value out of a tracing tensor with aten._local_scalar_dense"
(keras-hub's Gemma compiled under its own layout map on (1, 2) or (2, 1):
a LoRA factor's gradient laid out as a `_StridedShard`, in `aten.mm`'s
backward). pytorch#184945 fixes the same read of the offsets under fake
tensors, not of the size. The sizes are Python integers computed from
Python integers, so `register` runs the method with the tracing modes
set aside: the same numbers, eager or traced. It can go once the torch
range starts at a release that computes them without tensors.
"""

import functools

from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import torch_runtime


@functools.cache
def register():
    """Runs `_StridedShard`'s size computation outside tracing modes;
    once, whatever the number of calls. Called by
    `sharding_rules.register`."""
    strided_shard = torch_internals.StridedShard
    upstream = getattr(strided_shard, "local_shard_size_and_offset", None)
    if upstream is None:
        return

    @functools.wraps(upstream)
    def local_shard_size_and_offset(self, *args, **kwargs):
        with torch_runtime.disable_current_modes():
            return upstream(self, *args, **kwargs)

    strided_shard.local_shard_size_and_offset = local_shard_size_and_offset
