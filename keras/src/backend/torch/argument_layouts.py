"""Arguments that DTensor does not lay out for some torch functions.

Handlers of `created_tensors`'s table (`HANDLERS`), each for a torch
function whose arguments DTensor leaves in a form its rules meet badly,
and which the handler lays out first:

- `repeat_interleave`: a one-element `repeats` tensor is passed as an int.
- `scaled_dot_product_attention`: queries, keys, values and the
  `attn_mask` keyword are brought to placements that fit each other.
- `Tensor.contiguous` of a DTensor: in the standard memory format.
- `einsum` of two DTensors: a replicated operand takes the other's split
  along a letter both operands hold (`_einsum`).

Every handler is called as `handler(mode, func, args, kwargs)` and
returns `func`'s result.

Collectives: the attention inputs' redistributions, inside the step, on
every process alike; the `einsum` layout moves nothing.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

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


def _einsum(mode, func, args, kwargs):
    """`einsum` of two DTensors, a replicated one split as the other is.

    Where one operand is split along a letter of both operands, and the
    other is replicated on that mesh axis, the replicated one is split
    the same way first: its local chunk, nothing moved. A letter the
    output keeps (a batch letter: heads in attention) leaves the output
    split; a contracted one leaves it a partial sum, as a matmul whose
    operand is split along its contracted dimension does (Megatron's
    row-parallel layer). DTensor's `einsum` views its operands for a
    batched matmul, where a split of the heads becomes a strided split,
    and its rule then gathers the split operand rather than chunking the
    replicated one: keras-hub's attention during `generate()` (queries
    split by heads, the KV cache replicated) gathered the queries,
    computed every head on every process and gathered the output
    projection's kernel for each token; Llama's output projection, its
    kernel split along the contracted heads, gathered the kernel on
    every call.
    """
    if kwargs or len(args) != 3 or not isinstance(args[0], str):
        return func(*args, **kwargs)
    equation, first, second = args
    if not (isinstance(first, DTensor) and isinstance(second, DTensor)):
        return func(*args, **kwargs)
    letters = _einsum_letters(equation, first, second)
    if letters is None:
        return func(*args, **kwargs)
    first_letters, second_letters = letters
    first = _split_like(first, second, first_letters, second_letters)
    second = _split_like(second, first, second_letters, first_letters)
    return func(equation, first, second)


def _einsum_letters(equation, first, second):
    """The letters of each operand, or None where the equation has an
    ellipsis or no output, or does not fit the operands."""
    equation = equation.replace(" ", "")
    if "..." in equation or "->" not in equation:
        return None
    operands = equation.split("->")[0].split(",")
    if len(operands) != 2:
        return None
    if (len(operands[0]), len(operands[1])) != (first.ndim, second.ndim):
        return None
    return operands[0], operands[1]


def _split_like(value, other, letters, other_letters):
    """`value`, split along a letter of both operands on each mesh axis
    where it is replicated and `other` is split along that letter (sizes
    equal)."""
    if other.device_mesh != value.device_mesh:
        return value
    placements = list(value.placements)
    for axis, (mine, theirs) in enumerate(
        zip(value.placements, other.placements)
    ):
        if not mine.is_replicate() or type(theirs) is not Shard:
            continue
        letter = other_letters[theirs.dim]
        if letter not in letters:
            continue
        dim = letters.index(letter)
        if value.shape[dim] != other.shape[theirs.dim] or dim in (
            p.dim for p in placements if type(p) is Shard
        ):
            continue
        placements[axis] = Shard(dim)
    if placements == list(value.placements):
        return value
    return _Chunk.apply(value, tuple(placements))


class _Chunk(torch.autograd.Function):
    """A replicated DTensor's local chunk under split `placements`, whose
    gradient keeps the placements DTensor gives it.

    As the cut DTensor's own rules make inside an operator: nothing moves
    forward, and the gradient of the chunk, split as the chunk is, is
    the replicated operand's gradient, split (each element of it comes
    from one chunk). `DTensor.redistribute` would gather it back to
    `Replicate` in backward, an all-gather for each `einsum`.
    """

    @staticmethod
    def forward(ctx, value, placements):
        return value.redistribute(value.device_mesh, placements)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# Torch function -> handler(mode, func, args, kwargs), for
# `created_tensors`'s table.
HANDLERS = {
    torch.repeat_interleave: _repeat_interleave,
    torch.Tensor.repeat_interleave: _repeat_interleave,
    torch.nn.functional.scaled_dot_product_attention: _attention,
    torch.Tensor.contiguous: _contiguous,
    torch.einsum: _einsum,
}
