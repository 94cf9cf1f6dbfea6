"""Extreme-value reductions of a DTensor: `max`, `min`, `amax`, `amin`,
`argmax` and `argmin`, with their dimension counted from the front and
their result whole.

- **The dimension.** Torch 2.13's DTensor reduces `argmax` (and the
  others that return indices) along a split dimension by all-gathering
  each process's best value and index along it, and hands the collective
  a negative dimension as it was given. The functional all-gather then
  views its result with a wrong shape (pytorch#194856,
  `_maybe_view_chunk_cat`): `ops.argmax(logits, axis=-1)` of logits split
  along the vocabulary raised "shape '[1, 128, 1, 1, 128, 1]' is invalid"
  (keras-hub's Gemma with `SparseCategoricalAccuracy` on a (2, 1) mesh).
  The same dimension is passed counted from the front. This can go once
  the torch range starts at a release with that issue fixed.
- **The result.** A maximum or minimum over a split dimension is left
  `Partial("max")` or `Partial("min")`: each process holds its part's
  extreme. DTensor's indexing and `narrow` read an index's local value,
  so such a result used as an index differs from process to process
  (keras-hub's sampler starts at `ops.min` of the prompts' lengths, a
  minimum over the batch: where the batch was split, each process
  generated from its own rows' minimum). The result is reduced as it is
  made instead: one all-reduce of a small value, on every process alike.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate


def _extreme(mode, func, args, kwargs):
    """Calls `func` with its dimension from the front; reduces a partial
    result."""
    value = args[0] if args else kwargs.get("input")
    if not isinstance(value, DTensor) or value.ndim == 0:
        return func(*args, **kwargs)
    if len(args) > 1 and isinstance(args[1], int) and args[1] < 0:
        args = (args[0], args[1] % value.ndim, *args[2:])
    elif isinstance(kwargs.get("dim"), int) and kwargs["dim"] < 0:
        kwargs = dict(kwargs, dim=kwargs["dim"] % value.ndim)
    result = func(*args, **kwargs)
    if isinstance(result, DTensor) and any(
        p.is_partial() for p in result.placements
    ):
        placements = [
            Replicate() if p.is_partial() else p for p in result.placements
        ]
        return result.redistribute(result.device_mesh, placements)
    return result


# Torch function -> handler(mode, func, args, kwargs), for
# `created_tensors`'s table.
HANDLERS = {
    func: _extreme
    for func in (
        torch.argmax,
        torch.argmin,
        torch.Tensor.argmax,
        torch.Tensor.argmin,
        torch.max,
        torch.min,
        torch.Tensor.max,
        torch.Tensor.min,
        torch.amax,
        torch.amin,
        torch.Tensor.amax,
        torch.Tensor.amin,
    )
}
