"""Tensors created from Python values, and random draws, inside a step.

Handlers of `created_tensors`'s table (`HANDLERS`) for the torch functions
that create tensors: a factory's result made from Python values alone is
replicated (`mode.replicate`), and a random draw on a DTensor takes the
values of its global shape, as one process would draw them. Every
handler is called as `handler(mode, func, args, kwargs)`, where `mode`
is the step's torch function mode, and returns `func`'s result.

Collectives: a random draw or dropout on a CPU mesh gathers its DTensor
arguments (`full_tensor`), inside the step, on every process alike.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import distribute_tensor

from keras.src import tree
from keras.src.backend.torch import torch_internals


def _create(mode, func, args, kwargs):
    """A factory's result is replicated where it is made from Python values.

    All processes run the same program with the same seed, so a tensor
    made from Python values alone (`arange`, `zeros`, `tensor(2.0)`,
    `from_numpy` of a constant) is identical on every process.
    `implicit_replication` would take every plain tensor for replicated,
    including one computed from a process's own data, and would be
    silently wrong there; replicating at creation covers exactly the
    tensors that are identical.
    """
    value = func(*args, **kwargs)
    if _created_from_python_values(value, args, kwargs):
        return mode.replicate(value)
    return value


def _draw_random(mode, func, args, kwargs):
    """Random draws on a DTensor take the values of the global shape.

    On meshes without an offset-based generator (CPU), DTensor draws each
    shard from the same generator state and drops a `generator=` argument,
    so shards repeat each other's values and seeded layers are not
    reproducible. No plain tensor is involved, so `implicit_replication`
    does not help. `normal` made from Python values is a factory.
    """
    mode.count_draw()
    if _draws_locally(args):
        return _draw_for_global_shape(func, args, kwargs)
    if func is torch.normal:
        return _create(mode, func, args, kwargs)
    return func(*args, **kwargs)


def _dropout(mode, func, args, kwargs):
    """Dropout on a DTensor draws its mask for the global shape.

    As for `_draw_random`: DTensor's CPU dropout would draw each shard's
    mask from the same generator state.
    """
    mode.count_draw()
    if _draws_locally(args):
        return _dropout_of_global_shape(mode, *args, **kwargs)
    return func(*args, **kwargs)


def _create_random(mode, func, args, kwargs):
    """A random factory's draw is counted (`draw_count`), then created."""
    mode.count_draw()
    return _create(mode, func, args, kwargs)


def _draws_locally(args):
    """Whether DTensor would draw random values shard by shard.

    DTensor draws globally consistent values only with its offset-based
    generator (CUDA); otherwise each process draws for its own shard,
    and DTensor drops a `generator=` argument.
    """
    return (
        bool(args)
        and isinstance(args[0], DTensor)
        and args[0].device_mesh.device_type == "cpu"
    )


def _draw_for_global_shape(func, args, kwargs):
    """Runs a random function on full values, then lays the result out.

    Every process draws the same values for the global shape (with the
    given generator, if any), and keeps its part of them.
    """
    first = args[0]
    full_args, full_kwargs = tree.map_structure(
        lambda x: x.full_tensor() if isinstance(x, DTensor) else x,
        (args, kwargs),
    )
    value = func(*full_args, **full_kwargs)
    placements = [
        Replicate() if p.is_partial() else p for p in first.placements
    ]
    return distribute_tensor(
        value, first.device_mesh, placements, src_data_rank=None
    )


def _dropout_of_global_shape(mode, inputs, p=0.5, training=True, inplace=False):
    """`torch.nn.functional.dropout` with a mask of the global shape.

    The mask is drawn as the CPU kernel draws it for a plain tensor, so
    the values equal a single-process run's with the same seed.
    """
    if not training or p == 0.0:
        return inputs
    keep = 1.0 - p
    noise = torch.empty(inputs.shape, dtype=inputs.dtype, device=inputs.device)
    if keep == 0.0:
        noise.zero_()
    else:
        noise.bernoulli_(keep).div_(keep)
    noise = mode.replicate(noise)
    if inplace:
        return inputs.mul_(noise)
    return inputs * noise


def _created_from_python_values(value, args, kwargs):
    """Whether `value` is a plain tensor made from Python values alone.

    Scalars count too: DTensor would take a 0-d tensor for a replicated
    scalar where it meets a DTensor, but not the tensors derived from it
    alone (`broadcast_to(1, shape)`, as metrics do for a missing sample
    weight), which are as identical on every process. So does a 0-d
    DTensor argument, a number whose value DTensor gives every process
    alike (`ops.size(x)` passed to `ops.eye`, as Keras's pairwise losses
    do).
    """
    if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
        return False
    if value.device.type == "meta":
        # Meta tensors (shape inference) hold no values.
        return False
    return not _holds_tensor(args) and not _holds_tensor(kwargs)


def _holds_tensor(value):
    """Whether `value` or the lists, tuples and dicts in it hold a tensor
    other than a 0-d DTensor.

    A factory's arguments are flat, so this recursion is shallower than
    `tree.flatten`, and cheaper in the step's hot path.
    """
    if isinstance(value, torch.Tensor):
        return not (
            type(value) is DTensor
            and not torch_internals.spec_of(value).tensor_meta.shape
        )
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return False
    return any(_holds_tensor(item) for item in value)


# Torch functions that create a tensor from Python values alone.
CREATION_FUNCTIONS = (
    torch.arange,
    torch.as_tensor,
    torch.asarray,
    torch.empty,
    torch.eye,
    torch.from_numpy,
    torch.full,
    torch.linspace,
    torch.logspace,
    torch.ones,
    torch.scalar_tensor,
    torch.tensor,
    torch.tril_indices,
    torch.triu_indices,
    torch.zeros,
    torch.bartlett_window,
    torch.blackman_window,
    torch.hamming_window,
    torch.hann_window,
    torch.kaiser_window,
)
# Torch functions that create a tensor of random values.
RANDOM_CREATION_FUNCTIONS = (
    torch.rand,
    torch.randint,
    torch.randn,
    torch.randperm,
)
# Torch functions that draw random values for a tensor argument.
RANDOM_FUNCTIONS = (
    torch.bernoulli,
    torch.multinomial,
    torch.normal,
    torch.poisson,
    torch.rand_like,
    torch.randint_like,
    torch.randn_like,
)
# Torch function -> handler(mode, func, args, kwargs), for
# `created_tensors`'s table.
HANDLERS = {
    **{func: _create for func in CREATION_FUNCTIONS},
    **{func: _create_random for func in RANDOM_CREATION_FUNCTIONS},
    **{func: _draw_random for func in RANDOM_FUNCTIONS},
    torch.nn.functional.dropout: _dropout,
}
