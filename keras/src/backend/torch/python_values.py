"""Python values read from a DTensor inside a step are the whole value's.

`bool(x)`, `int(x)`, `x.item()` and `x.tolist()` of a DTensor read its
local tensor: a partial sum or minimum gives this process's part, and a
split value only this process's elements. Code that turns a tensor into
Python control flow or an index then takes different paths on different
processes: keras-hub's sampler starts generating at `ops.min` of the
prompts' lengths, a minimum over the batch, which is partial where the
batch is split, and loops while `ops.any` of the batch's rows is not
done. Inside a step, such a read first gathers the DTensor (reduces its
partial sums, gathers its shards): every process runs the same program,
so every process reads, and gathers, alike. A replicated DTensor is read
as it is, with no collective.
"""

import torch
from torch.distributed.tensor import DTensor


def _whole_value(mode, func, args, kwargs):
    """Calls `func` on the whole value of a split or partial DTensor."""
    value = args[0] if args else None
    if isinstance(value, DTensor) and not all(
        p.is_replicate() for p in value.placements
    ):
        args = (value.full_tensor(), *args[1:])
    return func(*args, **kwargs)


# Torch function -> handler(mode, func, args, kwargs), for
# `created_tensors`'s table.
HANDLERS = {
    func: _whole_value
    for func in (
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.Tensor.item,
        torch.Tensor.tolist,
    )
}
