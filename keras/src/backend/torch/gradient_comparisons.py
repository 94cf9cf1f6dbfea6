"""A local run's outputs and gradients against DTensor's.

The check of a local call (`shard_local_checks`) runs the layer on
DTensors and on local tensors, and, for training, takes both backward
from the same cotangent (`cotangent`: quasi-random values, laid out as an
output's gradient is). It compares each output, and each gradient
(`gradient_specs`), with DTensor's local tensor:

- up to rounding (`same`): the two runs compute the same sums, but not
  always in the same order (DTensor decomposes an operator on its shards
  otherwise than the operator on a local tensor: keras-hub's
  grouped-query attention rounded its query's gradient otherwise). The
  gradient is then DTensor's, in its placements;
- or, where the local run cut a replicated operand (`local_replays`),
  as a partial sum (`as_partial_sum`): the cut's backward pads the
  chunk's gradient with zeros where DTensor's keeps it split;
- or as a shard (`as_shard`): a kernel split along a contracted
  dimension gets its shard's gradient locally, where DTensor's is whole
  and replicated.

Contract: no collective; `cotangent` cuts a replicated tensor made alike
on every process to the output's gradient placements, locally.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Shard

from keras.src.backend.torch import local_call_checks
from keras.src.backend.torch import shard_local_checks
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import TensorMeta

# How far a local result may round otherwise than DTensor's (`same`):
# keras-hub's Gemma and Llama at the benchmark's mid size differed by up
# to 5.3 units in the last place of the larger magnitude.
ROUNDING_ULPS = 64


def gradient_specs(theirs, mine):
    """The specs of DTensor's gradients, where the local ones equal their
    local tensors up to rounding (None: not all do)."""
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
        local = torch_internals.local_tensor(their)
        if not same(my, local):
            spec = as_partial_sum(spec, local, my) or as_shard(spec, local, my)
            if spec is None:
                return None
        specs.append(contiguous(spec))
    return specs


def as_partial_sum(spec, their, my):
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
    if not same(chunk, their) or any(c.any() for c in rest):
        return None
    return DTensorSpec(
        spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta
    )


def as_shard(spec, their, my):
    """The spec under which `my`, a local gradient, is this process's
    chunk of DTensor's gradient (`spec`, local tensor `their`), or None.

    A local run that cut an operand to a split kernel's shard
    (`local_replays`: keras-hub's Llama query, whose kernel is split
    along the contracted hidden size) computes the kernel's gradient for
    its shard; DTensor computes it whole on every process, replicated,
    and the kernel's layout then cuts it. Where `my` is the chunk here
    along one dimension of `their`, over one mesh axis on which `their`
    is replicated, it is the same gradient, split there.
    """
    if my.dtype != their.dtype or my.dim() != their.dim():
        return None
    dims = [d for d in range(my.dim()) if my.shape[d] != their.shape[d]]
    if len(dims) != 1:
        return None
    (dim,) = dims
    coordinate = spec.mesh.get_coordinate()
    for mesh_dim, placement in enumerate(spec.placements):
        size = spec.mesh.size(mesh_dim)
        if not placement.is_replicate() or size == 1:
            continue
        chunks = torch_internals.placement_chunks(Shard(dim), their, size)
        if same(my, chunks[coordinate[mesh_dim]]):
            placements = list(spec.placements)
            placements[mesh_dim] = Shard(dim)
            return DTensorSpec(
                spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta
            )
    return None


def same(my, their):
    """Whether a local result is DTensor's local one up to rounding: bit
    for bit, or, in float32 and float64, within `ROUNDING_ULPS` units in
    the last place of the larger magnitude (far below what a wrong
    result of quasi-random values differs by: a missing reduction, a
    term added on every process). Other dtypes are compared bit for
    bit."""
    if (
        type(my) is not torch.Tensor
        or my.dtype != their.dtype
        or my.shape != their.shape
    ):
        return False
    if torch.equal(my, their):
        return True
    if my.dtype not in (torch.float32, torch.float64):
        return False
    scale = torch.maximum(my.abs().max(), their.abs().max())
    bound = ROUNDING_ULPS * torch.finfo(my.dtype).eps * scale
    return bool((my - their).abs().max() <= bound)


def all_same(mine, theirs):
    """Whether each local result is DTensor's local one (`same`)."""
    return len(mine) == len(theirs) and all(
        same(my, their) for my, their in zip(mine, theirs)
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
