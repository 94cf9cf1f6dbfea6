"""Index reductions (`argmax`, `argmin`, `max`/`min` along a dimension) of
a DTensor, with their dimension counted from the front.

Torch 2.13's DTensor reduces such an op along a split dimension by
all-gathering each process's best value and index along it, and hands
the collective a negative dimension as it was given. The functional
all-gather then views its result with a wrong shape (pytorch#194856,
`_maybe_view_chunk_cat`): `ops.argmax(logits, axis=-1)` of logits split
along the vocabulary raised "shape '[1, 128, 1, 1, 128, 1]' is invalid"
(keras-hub's Gemma with `SparseCategoricalAccuracy` on a (2, 1) mesh,
whose tied embedding splits the vocabulary). The handler passes the same
dimension counted from the front. It can go once the torch range starts
at a release with that issue fixed.
"""

import torch
from torch.distributed.tensor import DTensor


def _from_front(mode, func, args, kwargs):
    """Calls `func` with a negative `dim` of a DTensor made non-negative."""
    value = args[0] if args else kwargs.get("input")
    if not isinstance(value, DTensor) or value.ndim == 0:
        return func(*args, **kwargs)
    if len(args) > 1 and isinstance(args[1], int) and args[1] < 0:
        args = (args[0], args[1] % value.ndim, *args[2:])
    elif isinstance(kwargs.get("dim"), int) and kwargs["dim"] < 0:
        kwargs = dict(kwargs, dim=kwargs["dim"] % value.ndim)
    return func(*args, **kwargs)


# Torch function -> handler(mode, func, args, kwargs), for
# `created_tensors`'s table.
HANDLERS = {
    func: _from_front
    for func in (
        torch.argmax,
        torch.argmin,
        torch.Tensor.argmax,
        torch.Tensor.argmin,
        torch.max,
        torch.min,
        torch.Tensor.max,
        torch.Tensor.min,
    )
}
