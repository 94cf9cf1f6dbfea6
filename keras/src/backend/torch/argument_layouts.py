"""Arguments that DTensor does not lay out for some torch functions.

Handlers of `created_tensors`'s table (`HANDLERS`), each for a torch
function whose arguments DTensor leaves in a form its rules meet badly,
and which the handler lays out first:

- `repeat_interleave`: a one-element `repeats` tensor is passed as an int.
- `scaled_dot_product_attention`: queries, keys, values and the
  `attn_mask` keyword are brought to placements that fit each other.
- `Tensor.contiguous` of a DTensor: in the standard memory format.

Every handler is called as `handler(mode, func, args, kwargs)` and
returns `func`'s result.

Collectives: the attention inputs' redistributions, inside the step, on
every process alike.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras.src.backend.torch import attention_rules


def _repeat_interleave(mode, func, args, kwargs):
    """`repeat_interleave` with a one-element `repeats` tensor, as an int.

    With a tensor `repeats`, torch decomposes `repeat_interleave` below
    DTensor into an index tensor of its own, which then meets the DTensor
    ("got mixed torch.Tensor and DTensor"). That tensor is made inside the
    decomposition, below any scope a caller could open, so
    `implicit_replication` cannot reach it; with an int, DTensor lays out
    the result itself.
    """
    args, kwargs = _repeats_as_int(args, kwargs)
    return func(*args, **kwargs)


def _repeats_as_int(args, kwargs):
    """Passes a one-element `repeats` tensor of `repeat_interleave` as int.

    With a tensor `repeats`, torch decomposes `repeat_interleave` below
    DTensor into an index tensor of its own, which then meets the DTensor;
    with an int, DTensor lays the result out itself. That is done where
    the input is a DTensor, or `repeats` is one: under `torch.vmap` the
    input is a batched tensor wrapping a DTensor, and `repeats` (made from
    Python values) a replicated DTensor.
    """
    if not args:
        return args, kwargs
    in_args = len(args) > 1
    repeats = args[1] if in_args else kwargs.get("repeats")
    if not (
        isinstance(repeats, torch.Tensor)
        and repeats.numel() == 1
        and (isinstance(args[0], DTensor) or isinstance(repeats, DTensor))
    ):
        return args, kwargs
    repeats = int(repeats.item())
    if in_args:
        return (args[0], repeats, *args[2:]), kwargs
    return args, dict(kwargs, repeats=repeats)


def _attention(mode, func, args, kwargs):
    """`scaled_dot_product_attention` with its mask laid out to fit.

    DTensor does not redistribute keyword arguments such as `attn_mask`,
    so the sharding rules would find the mask in a layout no strategy
    accepts. The mask is a DTensor, so `implicit_replication` does not
    apply.
    """
    args, kwargs = _align_attention_mask(args, kwargs)
    return func(*args, **kwargs)


def _align_attention_mask(args, kwargs):
    """Lays out attention inputs and mask so that they fit each other.

    DTensor does not redistribute keyword arguments such as `attn_mask`,
    so queries, keys and values are first brought to a placement the
    attention rules accept as is (split by batch or by head, else
    replicated), and the mask to the matching placement (split like the
    queries where it has a batch or head dimension of its own).
    """
    query, key, value = args[:3]
    mask = kwargs.get("attn_mask")
    if not (isinstance(query, DTensor) and isinstance(mask, DTensor)):
        return args, kwargs
    placements = [
        p if p.is_shard() and p.dim in (0, 1) else Replicate()
        for p in query.placements
    ]
    mesh = query.device_mesh
    query, key, value = (
        x.redistribute(mesh, placements) if isinstance(x, DTensor) else x
        for x in (query, key, value)
    )
    mask_placements = [
        attention_rules.mask_placement(mask, p) for p in placements
    ]
    kwargs = dict(kwargs, attn_mask=mask.redistribute(mesh, mask_placements))
    return (query, key, value, *args[3:]), kwargs


def _contiguous(mode, func, args, kwargs):
    """`Tensor.contiguous` of a DTensor in the standard memory format.

    DTensor computes a result's strides from its global shape and its
    inputs' global strides, while a redistribution (a partial sum
    reduced, a shard gathered) gives a local tensor in the standard
    format. A DTensor laid out `channels_last` (keras-nightly's pooling
    asks for it) whose input an operator redistributes gets a local
    tensor with other strides than its own, and a later `reshape` views
    it wrongly ("view size is not compatible with input tensor's size
    and stride"). In the standard format the two agree; the values are
    the same. No plain tensor is involved, so `implicit_replication`
    does not apply.
    """
    if args and isinstance(args[0], DTensor):
        kwargs = dict(kwargs)
        kwargs.pop("memory_format", None)
        args = args[:1]
    return func(*args, **kwargs)


# Torch function -> handler(mode, func, args, kwargs), for
# `created_tensors`'s table.
HANDLERS = {
    torch.repeat_interleave: _repeat_interleave,
    torch.Tensor.repeat_interleave: _repeat_interleave,
    torch.nn.functional.scaled_dot_product_attention: _attention,
    torch.Tensor.contiguous: _contiguous,
}
