"""Ops a DTensor step runs on each process's rows of a batch.

Handlers of `created_tensors`'s table (`HANDLERS`) for ops that transform
each row of a batch alone, which DTensor runs wrongly or refuses on a
split argument: convolutions, the signal transforms (`stft`, `istft`),
`unfold` and the cumulative ops. Each process runs the op on the local
tensor of its rows (`_call_on_local_rows`): the first argument keeps its
split along the rows and is gathered along the rest, other DTensor
arguments are replicated, and the result is laid out as the first
argument; the gradient goes back through the same layouts. Every
handler is called as `handler(mode, func, args, kwargs)` and returns
`func`'s result.

Collectives: the redistributions of the arguments (and of their
gradients), inside the step, on every process alike.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate

from keras.src import tree
from keras.src.backend.torch.dtensor_layouts import contiguous_strides


def _convolution(mode, func, args, kwargs):
    """A convolution of a batch, each process on its rows.

    DTensor's convolution cannot be trusted with a split argument: torch
    2.13's runs on the local shards of its arguments without
    redistributing them and lays the result out like the input (with a
    weight split over a mesh axis, a kernel's output channels laid out
    over "model", the result's local tensor holds only some channels
    under the global shape of all of them, and the next operator fails:
    "The size of tensor a (4) must match the size of tensor b (8)");
    torch 2.11's refuses most convolutions outright, even of a batch
    split along its rows ("It requires that input_size[-1] is divisible
    by stride[-1] and stride[-1] equals kernel_size[-1]", a 3 x 3
    "valid" convolution). A convolution transforms each element of a
    batch alone: each process convolves its rows (`_call_on_local_rows`),
    the input split along the batch at most, the weight and bias
    gathered whole, their gradients partial sums over the processes that
    split the batch. An unbatched input (one dimension fewer than the
    weight) is convolved whole.
    """
    value = args[0] if args else kwargs.get("input")
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    batched = weight is None or value.ndim == weight.ndim
    return _call_on_local_rows(func, (0,) if batched else (), args, kwargs)


def _signal_transform(mode, func, args, kwargs):
    """`stft` and `istft` of a batch of signals, each process on its rows.

    DTensor cannot run them: `torch.stft` frames its input with
    `as_strided`, which DTensor refuses ("as_strided not supported with
    DTensor"), so `ops.stft` and Keras's `MelSpectrogram` failed. Both
    transform each row of a batch alone, along its last dimensions: each
    process transforms its rows (`_call_on_local_rows`), the batch kept
    split along dimension 0; a single signal is transformed whole.
    """
    signal = args[0] if args else kwargs.get("input")
    rows = (0,) if signal.ndim > _SIGNAL_RANK[func] else ()
    return _call_on_local_rows(func, rows, args, kwargs)


def _along_one_dimension(mode, func, args, kwargs):
    """An op along one dimension of a DTensor, each process on its rows.

    - `unfold` (`ops.extract_sequences`, and `MelSpectrogram`'s filters):
      DTensor has no rule for it, nor for its gradient, whose
      `input_sizes` argument it would not make local.
    - `cumprod` (`ops.cumprod`): DTensor runs it, but its gradient's
      formula makes plain tensors that meet the DTensor ("aten.where.self
      got mixed torch.Tensor and DTensor").
    - `cumsum`, `cumprod` and `logcumsumexp` along a split dimension
      given as a negative number (`axis=-1`): torch 2.13's DTensor rule
      does not gather that dimension, and each process accumulates its
      shard alone, silently wrong (`cumsum` of `[[1, 2, 3, 4]]` split in
      two gives `[[1, 3, 3, 7]]`).

    Each takes the rows of the other dimensions alone: those keep their
    split, the op's dimension is gathered (`_call_on_local_rows`), and
    its gradient runs on local tensors.
    """
    value = args[0] if args else kwargs.get("self", kwargs.get("input"))
    if not isinstance(value, DTensor):
        return func(*args, **kwargs)
    name = _DIMENSION_ARGUMENTS[func]
    dimension = args[1] if len(args) > 1 else kwargs.get(name)
    dimension %= max(value.ndim, 1)
    rows = tuple(dim for dim in range(value.ndim) if dim != dimension)
    return _call_on_local_rows(func, rows, args, kwargs)


def _call_on_local_rows(func, rows, args, kwargs):
    """Calls `func` on the local tensor of its first argument, a DTensor
    split along the dimensions `rows` at most, whose rows `func`
    transforms alone.

    The first argument is gathered on the mesh axes that split another
    dimension (or hold a partial sum), every other DTensor argument is
    replicated, and the local result is laid out as the first argument,
    its dimensions `rows` being the first argument's. The gradient goes
    back through the same layouts; the gradient of another argument (a
    convolution's weight) is a partial sum over the mesh axes that split
    the first one. A plain tensor argument may hold a
    process's own values: the call is then left to DTensor, and
    `implicit_replication` is not needed.
    """
    value = args[0] if args else kwargs.get("input", kwargs.get("self"))
    others = (*args[1:], *(v for k, v in kwargs.items() if k not in _FIRST))
    if not isinstance(value, DTensor) or any(
        isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
        for v in others
    ):
        return func(*args, **kwargs)
    placements = [
        p if p.is_shard() and p.dim in rows else Replicate()
        for p in value.placements
    ]
    if placements != list(value.placements):
        value = value.redistribute(value.device_mesh, placements)
    kwargs = {k: v for k, v in kwargs.items() if k not in _FIRST}
    # Each process's gradient of another argument is its rows' part.
    grad_placements = [
        Partial() if p.is_shard() else Replicate() for p in placements
    ]
    others, kwargs = tree.map_structure(
        lambda x: (
            _replicated(x).to_local(grad_placements=grad_placements)
            if isinstance(x, DTensor)
            else x
        ),
        (args[1:], kwargs),
    )
    result = func(value.to_local(), *others, **kwargs).contiguous()
    shape = list(result.shape)
    for p in placements:
        if p.is_shard():
            shape[p.dim] = value.shape[p.dim]
    return DTensor.from_local(
        result,
        value.device_mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_strides(shape),
    )


def _replicated(value):
    """`value`, replicated on every mesh axis."""
    if not isinstance(value, DTensor) or all(
        p.is_replicate() for p in value.placements
    ):
        return value
    return value.redistribute(
        value.device_mesh, [Replicate()] * value.device_mesh.ndim
    )


# Convolutions, which DTensor runs wrongly (2.13) or refuses (2.11) on a
# split argument.
_CONVOLUTIONS = (
    torch.conv1d,
    torch.conv2d,
    torch.conv3d,
    torch.conv_transpose1d,
    torch.conv_transpose2d,
    torch.conv_transpose3d,
)
# The keyword names of the first argument of the functions that
# `_call_on_local_rows` runs.
_FIRST = ("input", "self")
# Signal transforms -> the rank of one signal they take (a batch of them
# has one more dimension, the first).
_SIGNAL_RANK = {
    torch.stft: 1,
    torch.Tensor.stft: 1,
    torch.istft: 2,
    torch.Tensor.istft: 2,
}
# Ops along one dimension -> the keyword name of their dimension (their
# second argument).
_DIMENSION_ARGUMENTS = {
    torch.Tensor.unfold: "dimension",
    torch.unfold_copy: "dimension",
    torch.cumprod: "dim",
    torch.Tensor.cumprod: "dim",
    torch.cumsum: "dim",
    torch.Tensor.cumsum: "dim",
    torch.logcumsumexp: "dim",
    torch.Tensor.logcumsumexp: "dim",
}
# Torch function -> handler(mode, func, args, kwargs), for
# `created_tensors`'s table.
HANDLERS = {
    **{func: _convolution for func in _CONVOLUTIONS},
    **{func: _signal_transform for func in _SIGNAL_RANK},
    **{func: _along_one_dimension for func in _DIMENSION_ARGUMENTS},
}
