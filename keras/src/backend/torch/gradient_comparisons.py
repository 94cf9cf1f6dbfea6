"""A local run's gradients against DTensor's, for `training_local_calls`.

The check of a training local call takes the layer backward twice from
the same cotangent (`cotangent`: quasi-random values, laid out as an
output's gradient is), on DTensors and on local tensors, and compares
each gradient (`gradient_specs`):

- bit for bit, DTensor's local tensor against the local one: the
  gradient is then DTensor's, in its placements;
- or, where the local run cut a replicated operand (`local_replays`),
  as a partial sum (`as_partial_sum`): the cut's backward pads the
  chunk's gradient with zeros where DTensor's keeps it split, and the
  gradients downstream of it are the same sums added in another order,
  compared up to that rounding (`same`).

Contract: no collective; `cotangent` cuts a replicated tensor made alike
on every process to the output's gradient placements, locally.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial

from keras.src.backend.torch import local_call_checks
from keras.src.backend.torch import shard_local_checks
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import TensorMeta

# How far a gradient downstream of a cut may round otherwise (`same`).
ROUNDING_ULPS = 256


def gradient_specs(theirs, mine, rounding):
    """The specs of DTensor's gradients, where the local ones equal their
    local tensors (None: not all do); up to the rounding of a cut
    (`same`) where `rounding`."""
    specs = []
    for their, my in zip(theirs, mine):
        if their is None or my is None:
            if their is not my:
                return None
            specs.append(None)
            continue
        if type(their) is not DTensor:
            return None
        spec = torch_internals.spec_of(their)
        if not same(my, torch_internals.local_tensor(their), rounding):
            spec = as_partial_sum(
                spec, torch_internals.local_tensor(their), my, rounding
            )
            if spec is None:
                return None
        specs.append(contiguous(spec))
    return specs


def as_partial_sum(spec, their, my, rounding):
    """The spec under which `my`, a local gradient, is DTensor's gradient
    (`spec`, local tensor `their`) as a partial sum, or None.

    A local run's cut (`local_replays`) takes this process's chunk of a
    replicated operand; its backward pads the chunk's gradient with
    zeros, where DTensor's keeps it split. Where `my` is whole along each
    split dimension, its chunk here is `their` and the rest zeros, it is
    the same gradient, `Partial` over those mesh axes: their sum over the
    processes is the gathered one, exactly (the other terms are zeros).
    """
    placements = list(spec.placements)
    shape = spec.tensor_meta.shape
    coordinate = spec.mesh.get_coordinate()
    split = [dim for dim, p in enumerate(placements) if p.is_shard()]
    dims = [placements[m].dim for m in split]
    if (
        not split
        or len(set(dims)) != len(dims)
        or my.dtype != their.dtype
        or tuple(my.shape) != tuple(shape)
    ):
        return None
    chunk, rest = my, []
    for mesh_dim in split:
        chunks = torch_internals.placement_chunks(
            placements[mesh_dim], chunk, spec.mesh.size(mesh_dim)
        )
        here = coordinate[mesh_dim]
        rest += [c for i, c in enumerate(chunks) if i != here]
        chunk = chunks[here]
        placements[mesh_dim] = Partial()
    if not same(chunk, their, rounding) or any(c.any() for c in rest):
        return None
    return DTensorSpec(
        spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta
    )


def same(my, their, rounding):
    """Whether a local gradient is DTensor's local one: bit for bit, or,
    where `rounding`, up to the rounding of sums added in another order.

    Downstream of a cut, a local run's backward contracts over the zeros
    that pad the cut's gradient, where DTensor's contracts over the chunk
    alone (`as_partial_sum`): the same sums, rounded otherwise. The
    bound, `ROUNDING_ULPS` units in the last place of the larger
    magnitude, is far below what a wrong gradient of quasi-random
    cotangents differs by. Float32 and float64 only; other dtypes are
    compared bit for bit.
    """
    if (
        type(my) is not torch.Tensor
        or my.dtype != their.dtype
        or my.shape != their.shape
    ):
        return False
    if torch.equal(my, their):
        return True
    if not rounding or my.dtype not in (torch.float32, torch.float64):
        return False
    scale = torch.maximum(my.abs().max(), their.abs().max())
    bound = ROUNDING_ULPS * torch.finfo(my.dtype).eps * scale
    return bool((my - their).abs().max() <= bound)


def all_equal(mine, theirs):
    """Whether two lists of tensors are equal, bit for bit, in shape and
    dtype, and plain tensors on the local side."""
    return len(mine) == len(theirs) and all(
        type(my) is torch.Tensor
        and my.dtype == their.dtype
        and my.shape == their.shape
        and torch.equal(my, their)
        for my, their in zip(mine, theirs)
    )


def contiguous(spec):
    """`spec` with the strides of a contiguous tensor of its shape: a
    local view's gradient is made contiguous (`local_views.LocalView`)."""
    meta = spec.tensor_meta
    strides, stride = [], 1
    for size in reversed(meta.shape):
        strides.append(stride)
        stride *= max(size, 1)
    return DTensorSpec(
        spec.mesh,
        tuple(spec.placements),
        tensor_meta=TensorMeta(
            meta.shape, tuple(reversed(strides)), meta.dtype
        ),
    )


def cotangent(output):
    """A cotangent of a DTensor output: quasi-random values in [-0.5,
    0.5), laid out as its gradient is (`Replicate` where it is
    `Partial`)."""
    _, _, placements = local_call_checks.output_spec(output, output.device_mesh)
    return shard_local_checks.quasi_random(
        torch_internals.spec_of(output), placements, -0.5
    )
