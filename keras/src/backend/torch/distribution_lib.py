"""Utilities for distribution strategy with the PyTorch backend.

The PyTorch backend distributes with `torch.distributed` and DTensor: one
process drives one device, a Keras `DeviceMesh` becomes a torch
`DeviceMesh` over process ranks, and a `TensorLayout` becomes a tuple of
DTensor placements, one per mesh axis.

Collectives in lockstep. Every process issues the same collectives, in the
same order, from the thread that runs the step; a collective paired with a
different one is a crash on gloo ("Received data size doesn't match
expected size"), and a hang or wrong numbers on NCCL. Hence:

- Collectives are issued only by calls that every process makes in the
  same order: `initialize`, `set_distribution` (which shares the seed
  once, see `share_seed_once`, if `initialize` did not, and converts the
  distribution's mesh, creating its process groups), the steps of
  `fit`/`evaluate`/`predict`, `convert_to_numpy` and saving. Nothing that
  may run on some processes only issues one: no property (a mesh's
  `backend_mesh` shares no seed), no `repr`, no logging, no progress bar
  (logs are Python floats on every process before callbacks see them).
- Within a step, the order is fixed by the program, not by timing:
  gradient buckets (`gradient_buckets`) are filled and sent by autograd's
  hooks in the order the engine accumulates gradients, which on CPU runs
  on the thread that called backward; batch-end callbacks run on the main
  thread.
- A process that stops taking part (it died, or skipped a call) makes the
  others fail within `KERAS_DTENSOR_TIMEOUT_SECONDS`, never hang.
"""

import collections
import contextlib
import datetime
import math
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor as _dtensor_distribute
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.placement_types import _MaskPartial
from torch.distributed.tensor.placement_types import _StridedShard
from torch.overrides import TorchFunctionMode

from keras.src import tree
from keras.src.backend.common import global_state
from keras.src.backend.common.keras_tensor import KerasTensor
from keras.src.backend.torch import gradient_buckets
from keras.src.backend.torch import sharding_rules

TIMEOUT_ENV_VAR = "KERAS_DTENSOR_TIMEOUT_SECONDS"
DEFAULT_TIMEOUT_SECONDS = 600

# The backend form of a `TensorLayout`: the torch mesh, one placement per
# mesh axis, and the Keras axes and mesh it came from (for error messages).
DTensorLayout = collections.namedtuple(
    "DTensorLayout", ["mesh", "placements", "axes", "keras_mesh"]
)

_BACKEND_MESHES = {}
# Whether `initialize_rng` ran: variables are created from the shared seed.
_SEED_SYNCHRONIZED = False
# Whether `replicate_created_tensors` is active (it does not nest).
_REPLICATING = False


def list_devices(device_type=None):
    """Return all the available devices based on the device type.

    With the PyTorch backend, each process drives exactly one device, so the
    global device list has one entry per process, named after the process
    rank: `"gpu:3"` is the device of rank 3.

    Args:
        device_type: string of `"cpu"` or `"gpu"`. Defaults to `"gpu"` if
            CUDA is available, otherwise `"cpu"`.

    Return:
        List of devices that are available for distribute computation.
    """
    device_type = _standardize_device_type(device_type)
    _maybe_auto_initialize()
    return [f"{device_type}:{i}" for i in range(num_processes())]


def get_device_count(device_type=None):
    """Returns the number of devices across all processes.

    Args:
        device_type: Optional device type to count (`"cpu"` or `"gpu"`).

    Returns:
        int: The total number of devices of that type.
    """
    return len(list_devices(device_type))


def initialize(job_addresses=None, num_processes=None, process_id=None):
    """Initializes `torch.distributed` and synchronizes the random seed.

    Arguments not given are read from torchrun's environment (`MASTER_ADDR`,
    `MASTER_PORT`, `WORLD_SIZE`, `RANK`, `LOCAL_RANK`). Keras's own
    `KERAS_DISTRIBUTION_*` variables are forwarded here by
    `keras.distribution.initialize`. CPU tensors use gloo; on CUDA, NCCL is
    used and each process binds the `LOCAL_RANK` device.

    Args:
        job_addresses: Comma separated `host:port` addresses of all jobs, or
            just the coordinator's. The first one is the coordinator.
        num_processes: Total number of processes.
        process_id: Rank of this process.
    """
    if not dist.is_initialized():
        _init_process_group(job_addresses, num_processes, process_id)
    initialize_rng()


def initialize_rng():
    """Makes every process use the same global random seed.

    If no seed was set with `keras.utils.set_random_seed`, process 0 draws
    one and broadcasts it, as the JAX backend does in `initialize`.
    """
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils

    global _SEED_SYNCHRONIZED
    _SEED_SYNCHRONIZED = True
    if rng_utils.get_random_seed() is not None:
        return
    seed = torch.tensor(
        [seed_generator.make_default_seed()],
        dtype=torch.int64,
        device=_collective_device(),
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    rng_utils.set_random_seed(int(seed.item()))


def share_seed_once():
    """Shares the global random seed, unless `initialize` already did.

    Called by `keras.distribution.set_distribution` for each distribution
    it sets: every process reaches it in the same order, so the broadcast
    of `initialize_rng` is issued in lockstep. It covers a process group
    created outside `initialize` (e.g. by `dist.init_process_group`);
    with a single process nothing is shared.
    """
    if _SEED_SYNCHRONIZED:
        return
    _maybe_auto_initialize()
    if dist.is_initialized() and dist.get_world_size() > 1:
        initialize_rng()


def num_processes():
    """Return the number of processes for the current distribution setting."""
    if dist.is_initialized():
        return dist.get_world_size()
    return 1


def process_id():
    """Return the current process ID for the distribution setting."""
    if dist.is_initialized():
        return dist.get_rank()
    return 0


def _to_backend_device(device_name):
    """Converts a Keras device name (`"gpu:3"`) to this rank's torch device.

    Device ids are global process ranks. A process can only address its own
    device, so the name is resolved on the node-local device index.
    """
    if isinstance(device_name, torch.device):
        return device_name
    device_type, device_id = _parse_device_name(device_name)
    if device_type == "cpu":
        return torch.device("cpu")
    local_count = max(torch.cuda.device_count(), 1)
    return torch.device("cuda", device_id % local_count)


def _to_backend_mesh(device_mesh):
    """Converts a Keras `DeviceMesh` to a torch `DeviceMesh` over ranks.

    Torch meshes own process groups, so equal Keras meshes share one torch
    mesh. Every process must convert its meshes in the same order, as with
    any collective.

    Args:
        device_mesh: `DeviceMesh` instance to convert.

    Returns:
        A `torch.distributed.device_mesh.DeviceMesh` instance.
    """
    ranks = np.vectorize(lambda d: _parse_device_name(d)[1], otypes=[int])(
        np.asarray(device_mesh.devices)
    )
    device_types = {
        _parse_device_name(d)[0] for d in np.ravel(device_mesh.devices)
    }
    device_type = "cuda" if "gpu" in device_types else "cpu"
    key = (device_type, ranks.shape, tuple(ranks.ravel().tolist()))
    key += (tuple(device_mesh.axis_names),)
    if key in _BACKEND_MESHES:
        return _BACKEND_MESHES[key]
    _ensure_process_group()
    world_size = num_processes()
    if sorted(ranks.ravel().tolist()) != list(range(world_size)):
        raise ValueError(
            f"The device mesh {device_mesh} must hold exactly one device per "
            f"process, for all {world_size} processes. Received devices: "
            f"{np.ravel(device_mesh.devices).tolist()}"
        )
    mesh = TorchDeviceMesh(
        device_type,
        torch.as_tensor(ranks),
        mesh_dim_names=tuple(device_mesh.axis_names),
    )
    _BACKEND_MESHES[key] = mesh
    return mesh


def _to_backend_layout(tensor_layout):
    """Converts a `TensorLayout` to DTensor placements on a torch mesh.

    Each mesh axis maps to `Shard(dim)` when a tensor dimension is sharded
    over it, and to `Replicate()` otherwise. A tensor dimension may be
    sharded over several mesh axes, e.g. `(("batch", "model"), None)`: the
    first axis named is the major one, as in JAX's `PartitionSpec`.

    Args:
        tensor_layout: `TensorLayout` instance to convert.

    Returns:
        A `DTensorLayout` (torch mesh, placements, axes, Keras mesh).
    """
    device_mesh = tensor_layout.device_mesh
    if device_mesh is None:
        raise ValueError(
            "Cannot create sharding when device mesh is not set "
            "for TensorLayout."
        )
    axes = tuple(tensor_layout.axes)
    placements = _axes_to_placements(axes, device_mesh)
    return DTensorLayout(
        _to_backend_mesh(device_mesh), placements, axes, device_mesh
    )


def distribute_variable(value, layout, trainable=True, path=None):
    """Creates the distributed parameter of a variable from its full value.

    Every process computes the same full value from the shared random seed
    (see `initialize_rng`) and keeps its own slice of it, as JAX does with
    a sharded initializer: nothing is communicated.

    Args:
        value: the full (global) value of the variable, a torch tensor.
        layout: `TensorLayout` or `DTensorLayout` for the variable.
        trainable: whether the parameter requires gradients.
        path: the variable path, named in error messages.

    Returns:
        A `torch.nn.Parameter` holding a DTensor.
    """
    try:
        layout = _backend_layout(layout)
    except ValueError as error:
        raise ValueError(
            f"Invalid layout for variable '{path}' with shape "
            f"{tuple(value.shape)}: {error}"
        ) from None
    validate_layout(value.shape, layout, path=path, require_divisible=True)
    if isinstance(value, DTensor):
        value = _relayout(value, layout)
    else:
        value = _dtensor_distribute(
            value.detach(), layout.mesh, layout.placements, src_data_rank=None
        )
    parameter = torch.nn.Parameter(value, requires_grad=trainable)
    if trainable:
        parameter.register_post_accumulate_grad_hook(
            gradient_buckets.reduce_gradient_when_ready
        )
    return parameter


def assign_to_variable(parameter, value):
    """Writes `value` into a distributed parameter, in the parameter's layout.

    Plain values are the full value; each process keeps its own slice of it,
    so no communication is needed. DTensor values of another layout are
    redistributed first.

    Args:
        parameter: the DTensor parameter of a variable.
        value: a torch tensor, numpy array or DTensor of the same shape.
    """
    layout = DTensorLayout(
        parameter.device_mesh, tuple(parameter.placements), None, None
    )
    if isinstance(value, DTensor):
        value = _relayout(value, layout)
    else:
        value = _dtensor_distribute(
            torch.as_tensor(value, device=parameter.device),
            layout.mesh,
            layout.placements,
            src_data_rank=None,
        )
    with torch.no_grad():
        parameter.to_local().copy_(value.to_local())


def distribute_tensor(tensor, layout):
    """Distribute the tensor based on the layout.

    Nested structures are distributed leaf by leaf with the same layout.
    Symbolic tensors and non-tensors are returned unchanged, so functional
    model construction is never affected. A DTensor is redistributed to the
    layout, and, as with JAX's sharding constraints, so is its gradient in
    the backward pass; a plain tensor or numpy array is taken as the full
    value held by process 0.

    Args:
        tensor: a tensor or a nested structure of tensors.
        layout: `TensorLayout` or `DTensorLayout`.

    Returns:
        The distributed value(s).
    """
    if layout is None:
        return tensor
    layout = _backend_layout(layout)

    def distribute_one(x):
        if isinstance(x, np.ndarray):
            x = _to_device_tensor(x, layout.mesh)
        if isinstance(x, KerasTensor) or not isinstance(x, torch.Tensor):
            return x
        if x.device.type == "meta":
            return x
        validate_layout(x.shape, layout, require_divisible=False)
        if isinstance(x, DTensor):
            if x.requires_grad and x.device_mesh == layout.mesh:
                return _ConstrainLayout.apply(x, layout.mesh, layout.placements)
            return _relayout(x, layout)
        return _dtensor_distribute(x, layout.mesh, layout.placements)

    return tree.map_structure(distribute_one, tensor)


class _ConstrainLayout(torch.autograd.Function):
    """Lays out a DTensor, and its gradient in the backward pass, alike.

    Left to itself, DTensor hands the gradient of a redistribution back in
    the input's placements, and the layers before pick placements for it
    that may cost more collectives. Constraining the gradient to the layout
    the user gave the value (as JAX transposes a sharding constraint into
    the same constraint) reduces a partial-sum gradient where the layout is
    replicated: the single backward all-reduce of a tensor-parallel block.
    """

    @staticmethod
    def forward(ctx, x, mesh, placements):
        ctx.mesh = mesh
        ctx.placements = placements
        if tuple(x.placements) == tuple(placements):
            return x.view_as(x)
        return x.redistribute(mesh, placements)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor):
            grad = grad.redistribute(ctx.mesh, ctx.placements)
        return grad, None, None


@contextlib.contextmanager
def replicate_created_tensors(device_mesh):
    """Makes tensors created inside the context replicated DTensors.

    Inside a distributed step, every tensor computed from the (distributed)
    inputs and variables is a DTensor. The others are created from Python
    values alone: masks from `ops.arange`, constants from
    `convert_to_tensor`, random values from a seed. All processes run the
    same program with the same seed, so such a tensor is identical on every
    process; in this context it becomes a DTensor replicated on
    `device_mesh` as it is created, and meets other DTensors as one.

    Dropout applied to a DTensor draws its mask for the global shape from
    the (shared) torch generator, so that, as on JAX, processes of one
    model replica use the same mask and data-parallel shards use different
    parts of it. DTensor does that itself on meshes whose device has an
    offset-based generator (CUDA); on CPU it would draw each shard's mask
    from the same generator state.

    Args:
        device_mesh: the Keras `DeviceMesh` of the distribution.
    """
    global _REPLICATING
    if _REPLICATING:
        yield
        return
    _REPLICATING = True
    try:
        with _ReplicateCreatedTensors(device_mesh.backend_mesh):
            yield
    finally:
        _REPLICATING = False


def replicating_created_tensors():
    """Whether `replicate_created_tensors` is active."""
    return _REPLICATING


class _ReplicateCreatedTensors(TorchFunctionMode):
    """The torch function mode of `replicate_created_tensors`."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        self.replicated = [Replicate()] * mesh.ndim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_FUNCTIONS and self.draws_locally(args):
            if func is torch.nn.functional.dropout:
                return self.dropout(*args, **kwargs)
            return self.draw_for_global_shape(func, args, kwargs)
        if func in _REPEAT_FUNCTIONS:
            args, kwargs = _repeats_as_int(args, kwargs)
        if func is torch.nn.functional.embedding:
            args = _replicate_lookup_indices(*args)
        if func is torch.nn.functional.scaled_dot_product_attention:
            args, kwargs = _align_attention_mask(args, kwargs)
        if func in _CREATION_FUNCTIONS:
            value = func(*args, **kwargs)
            if _created_from_python_values(value, args, kwargs):
                return self.replicate(value)
            return value
        return _reduce_single_use_partials(func(*args, **kwargs))

    def replicate(self, value):
        return DTensor.from_local(
            value, self.mesh, self.replicated, run_check=False
        )

    def draws_locally(self, args):
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

    def draw_for_global_shape(self, func, args, kwargs):
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
        return _dtensor_distribute(
            value, first.device_mesh, placements, src_data_rank=None
        )

    def dropout(self, inputs, p=0.5, training=True, inplace=False):
        """`torch.nn.functional.dropout` with a mask of the global shape.

        The mask is drawn as the CPU kernel draws it for a plain tensor, so
        the values equal a single-process run's with the same seed.
        """
        if not training or p == 0.0:
            return inputs
        keep = 1.0 - p
        noise = torch.empty(
            inputs.shape, dtype=inputs.dtype, device=inputs.device
        )
        if keep == 0.0:
            noise.zero_()
        else:
            noise.bernoulli_(keep).div_(keep)
        noise = self.replicate(noise)
        if inplace:
            return inputs.mul_(noise)
        return inputs * noise


_REPEAT_FUNCTIONS = frozenset(
    [torch.repeat_interleave, torch.Tensor.repeat_interleave]
)
# Torch functions that draw random values for a tensor argument.
_RANDOM_FUNCTIONS = frozenset(
    [
        torch.bernoulli,
        torch.multinomial,
        torch.normal,
        torch.poisson,
        torch.rand_like,
        torch.randint_like,
        torch.randn_like,
        torch.nn.functional.dropout,
    ]
)
# Torch functions that create a tensor from Python values alone.
_CREATION_FUNCTIONS = frozenset(
    [
        torch.arange,
        torch.as_tensor,
        torch.asarray,
        torch.empty,
        torch.eye,
        torch.from_numpy,
        torch.full,
        torch.linspace,
        torch.logspace,
        torch.normal,
        torch.ones,
        torch.rand,
        torch.randint,
        torch.randn,
        torch.randperm,
        torch.scalar_tensor,
        torch.tensor,
        torch.tril_indices,
        torch.triu_indices,
        torch.zeros,
    ]
)


def _repeats_as_int(args, kwargs):
    """Passes a one-element `repeats` tensor of `repeat_interleave` as int.

    With a tensor `repeats`, torch decomposes `repeat_interleave` below
    DTensor into an index tensor of its own, which then meets the DTensor;
    with an int, DTensor lays the result out itself.
    """
    if not (args and isinstance(args[0], DTensor)):
        return args, kwargs
    if len(args) > 1:
        repeats = args[1]
        if isinstance(repeats, torch.Tensor) and repeats.numel() == 1:
            args = (args[0], int(repeats.item()), *args[2:])
        return args, kwargs
    repeats = kwargs.get("repeats")
    if isinstance(repeats, torch.Tensor) and repeats.numel() == 1:
        kwargs = dict(kwargs, repeats=int(repeats.item()))
    return args, kwargs


def _replicate_lookup_indices(indices, table, *args):
    """Replicates embedding indices on the mesh axes that shard the table.

    DTensor needs the indices replicated there anyway. Redistributing them
    first avoids a DTensor ordering problem: when the indices are split on
    an axis that splits the table's rows on another axis, the lookup's
    mask was taken from the unreduced indices and did not fit the result.
    """
    if not (isinstance(indices, DTensor) and isinstance(table, DTensor)):
        return (indices, table, *args)
    placements = [
        Replicate() if table_placement.is_shard() else placement
        for placement, table_placement in zip(
            indices.placements, table.placements
        )
    ]
    if placements != list(indices.placements):
        indices = indices.redistribute(indices.device_mesh, placements)
    return (indices, table, *args)


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
        p if p.is_shard() and _mask_splits(mask.shape, p.dim) else Replicate()
        for p in placements
    ]
    kwargs = dict(kwargs, attn_mask=mask.redistribute(mesh, mask_placements))
    return (query, key, value, *args[3:]), kwargs


def _mask_splits(mask_shape, dim):
    """Whether an attention mask has dimension `dim` (batch or head)."""
    return len(mask_shape) == 4 and mask_shape[dim] > 1


def _reduce_single_use_partials(value):
    """Reduces a lookup result that DTensor could reduce only once.

    A lookup into a table sharded along the looked-up dimension (as in an
    embedding with a vocabulary-sharded table) gives a `_MaskPartial`
    DTensor: each process holds the rows it owns. DTensor frees the mask at
    the first reduction, so a second consumer of the same value fails. The
    value is reduced (all-reduced) once, as it is made, instead.
    """
    if type(value) is not DTensor:
        return value
    placements = value.placements
    if not any(isinstance(p, _MaskPartial) for p in placements):
        return value
    reduced = [
        Replicate() if isinstance(p, _MaskPartial) else p for p in placements
    ]
    return value.redistribute(value.device_mesh, reduced)


def _created_from_python_values(value, args, kwargs):
    """Whether `value` is a plain tensor made from no tensor.

    Scalars count too: DTensor would take a 0-d tensor for a replicated
    scalar where it meets a DTensor, but not the tensors derived from it
    alone (`broadcast_to(1, shape)`, as metrics do for a missing sample
    weight), which are as identical on every process.
    """
    if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
        return False
    if value.device.type == "meta":
        # Meta tensors (shape inference) hold no values.
        return False
    leaves = tree.flatten((args, kwargs))
    return not any(isinstance(leaf, torch.Tensor) for leaf in leaves)


def distribute_data_input(per_process_batch, layout, batch_dim_name):
    """Distribute the input data with the corresponding layout.

    Each process passes its own part of the global batch, split along the
    batch axis (processes of one model replica pass the same part). The
    result is the global batch as a DTensor: the concatenation of the
    parts, in the order of the processes along the batch axis. Parts may
    differ in size (a per-process loader's short last batch): every
    process first learns the others' shapes (a small all-gather), and
    parts that do not match DTensor's split of the global batch are
    exchanged so that each process holds its share of it.

    Every process must call this function, in the same order.

    Args:
        per_process_batch: tensor or array, this process's part of the batch.
        layout: `TensorLayout` or `DTensorLayout` for the global batch.
        batch_dim_name: the mesh axis that splits the batch.

    Returns:
        A DTensor holding the global batch.
    """
    del batch_dim_name  # The layout says which mesh axes split the batch.
    (value,) = _distribute_process_parts([per_process_batch], [layout])
    return value


def _distribute_process_parts(parts, layouts):
    """Builds global batches from every process's parts of them.

    Args:
        parts: this process's part of each global batch (tensors or
            arrays), the same number of them on every process.
        layouts: the layout of each global batch.

    Returns:
        A list with one DTensor per part.
    """
    layouts = [_backend_layout(layout) for layout in layouts]
    locals_ = [
        _to_device_tensor(part, layout.mesh)
        for part, layout in zip(parts, layouts)
    ]
    shapes = _gather_part_shapes([tuple(x.shape) for x in locals_])
    _check_part_shapes(shapes)
    return [
        _global_batch_from_parts(local, layout, [s[i] for s in shapes])
        for i, (local, layout) in enumerate(zip(locals_, layouts))
    ]


def _gather_part_shapes(shapes):
    """Every process's list of part shapes, in rank order.

    Two small all-gathers of fixed size: the length of each process's
    encoded shapes, then the encodings padded to the longest.
    """
    if num_processes() == 1:
        return [shapes]
    encoded = [len(shapes)]
    for shape in shapes:
        encoded += [len(shape), *shape]
    device = _collective_device()
    length = torch.tensor([len(encoded)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(num_processes())]
    dist.all_gather(lengths, length)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.int64, device=device)
    padded[: len(encoded)] = torch.tensor(encoded, dtype=torch.int64)
    gathered = [torch.empty_like(padded) for _ in range(num_processes())]
    dist.all_gather(gathered, padded)
    return [_decode_part_shapes(g.tolist()) for g in gathered]


def _decode_part_shapes(encoded):
    shapes = []
    position = 1
    for _ in range(encoded[0]):
        rank = encoded[position]
        shapes.append(tuple(encoded[position + 1 : position + 1 + rank]))
        position += 1 + rank
    return shapes


def _check_part_shapes(shapes):
    """Parts may differ only in their batch size (dimension 0).

    Raises the same ValueError on every process (each one sees every
    process's shapes), before any data is exchanged.
    """
    first = shapes[0]
    consistent = all(
        len(other) == len(first)
        and all(
            len(a) == len(b) and len(a) > 0 and a[1:] == b[1:]
            for a, b in zip(other, first)
        )
        for other in shapes
    )
    if not consistent:
        listing = "; ".join(
            f"process {rank}: {shape}" for rank, shape in enumerate(shapes)
        )
        raise ValueError(
            "With `auto_shard_dataset=False`, each process passes its part "
            "of the global batch: the parts may differ in their batch size "
            "(first dimension) only, and every process must pass the same "
            f"structure. Received the shapes {listing}."
        )


def _global_batch_from_parts(local, layout, part_shapes):
    """The global batch as a DTensor, from the parts of all processes.

    Args:
        local: this process's part, a tensor on the mesh's device.
        layout: the `DTensorLayout` of the global batch.
        part_shapes: the shape of every process's part, in rank order.
    """
    mesh = layout.mesh
    batch_dims = [
        d for d, p in enumerate(layout.placements) if p.is_shard(dim=0)
    ]
    sizes = _part_sizes_by_shard(mesh, batch_dims, part_shapes)
    global_shape = (sum(sizes), *local.shape[1:])
    if sizes == _even_split(global_shape[0], len(sizes)):
        return DTensor.from_local(
            local,
            mesh,
            layout.placements,
            run_check=False,
            shape=torch.Size(global_shape),
            stride=_contiguous_strides(global_shape),
        )
    if len(batch_dims) != 1 or isinstance(
        layout.placements[batch_dims[0]], _StridedShard
    ):
        raise ValueError(
            "Per-process batches of different sizes "
            f"{sizes} need the batch split over one mesh axis; the layout "
            f"{layout.axes} on mesh {layout.keras_mesh} splits it over "
            f"mesh dims {batch_dims}."
        )
    full = _gather_parts(local, mesh.get_group(batch_dims[0]), sizes)
    return _dtensor_distribute(
        full, mesh, layout.placements, src_data_rank=None
    )


def _part_sizes_by_shard(mesh, batch_dims, part_shapes):
    """The batch size of each data shard, in the order of the global batch.

    Processes with the same coordinates on the mesh dims that split the
    batch pass the same part; their sizes must agree.
    """
    ranks = mesh.mesh.cpu().numpy()
    split_shape = tuple(ranks.shape[d] for d in batch_dims)
    sizes = {}
    for rank, shape in enumerate(part_shapes):
        coordinate = np.argwhere(ranks == rank)[0]
        shard = int(
            np.ravel_multi_index(
                tuple(coordinate[d] for d in batch_dims), split_shape
            )
        )
        if sizes.setdefault(shard, shape[0]) != shape[0]:
            raise ValueError(
                "Processes of one model replica must pass the same part of "
                f"the global batch: process {rank} passed {shape[0]} rows "
                f"where another process of data shard {shard} passed "
                f"{sizes[shard]}."
            )
    return [sizes[shard] for shard in sorted(sizes)]


def _even_split(total, parts):
    """DTensor's split of `total` rows over `parts` shards (torch.chunk's)."""
    size = -(-total // parts)
    return [max(0, min(size, total - i * size)) for i in range(parts)]


def _gather_parts(local, group, sizes):
    """All-gathers parts of different sizes along dimension 0."""
    longest = max(sizes)
    padded = local.new_zeros((longest, *local.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    return torch.cat([g[:n] for g, n in zip(gathered, sizes)])


def distribute_global_batch(global_batch, layout):
    """Distributes a batch that every process holds in full.

    Each process keeps only its own slice of the batch, without
    communication. A batch dimension that does not divide by the number of
    data shards is split unevenly, as `torch.chunk` does.

    Args:
        global_batch: tensor or array, the same global batch on every process.
        layout: `TensorLayout` or `DTensorLayout` for the batch.

    Returns:
        A DTensor holding the global batch.
    """
    layout = _backend_layout(layout)
    value = _to_device_tensor(global_batch, layout.mesh)
    if isinstance(value, DTensor):
        return _relayout(value, layout)
    return _dtensor_distribute(
        value, layout.mesh, layout.placements, src_data_rank=None
    )


def distribute_data(data, distribution):
    """Distributes a (nested) batch of input data for a training step.

    With `auto_shard_dataset=True`, every process holds the global batch and
    keeps its own slice; otherwise each process holds its own part of the
    global batch (see `distribute_data_input`).

    Args:
        data: nested structure of tensors or arrays.
        distribution: the active `Distribution`.

    Returns:
        The same structure, with array leaves turned into DTensors.
    """

    def distribute_one(x):
        if isinstance(x, DTensor) or not _is_batch_array(x):
            return x
        return distribute_global_batch(x, distribution.get_data_layout(x.shape))

    if distribution.auto_shard_dataset:
        return tree.map_structure(distribute_one, data)
    leaves = tree.flatten(data)
    parts = [
        i
        for i, x in enumerate(leaves)
        if _is_batch_array(x) and not isinstance(x, DTensor)
    ]
    distributed = _distribute_process_parts(
        [leaves[i] for i in parts],
        [distribution.get_data_layout(leaves[i].shape) for i in parts],
    )
    for i, value in zip(parts, distributed):
        leaves[i] = value
    return tree.pack_sequence_as(data, leaves)


def all_reduce(x, op="sum", axis_name=None):
    """Reduces the per-process values of `x` across processes.

    Args:
        x: a tensor, array or `Variable` holding this process's value. A
            DTensor stands for its global value, which is returned in full.
        op: `"sum"`, `"mean"`, `"max"` or `"min"`.
        axis_name: optional mesh axis of the current distribution; the
            reduction then runs only among processes along that axis.

    Returns:
        A plain tensor, identical on the participating processes.
    """
    reduce_ops = {
        "sum": dist.ReduceOp.SUM,
        "mean": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }
    if op not in reduce_ops:
        raise ValueError(
            f"Unsupported reduction op={op}. Expected one of "
            f"{sorted(reduce_ops)}."
        )
    value = _local_value(x)
    if isinstance(value, DTensor):
        return value.full_tensor()
    value = value.clone()
    if num_processes() == 1:
        return value
    group = _axis_group(axis_name)
    dist.all_reduce(value, op=reduce_ops[op], group=group)
    if op == "mean":
        value = value / dist.get_world_size(group)
    return value


def all_gather(x, axis=0, axis_name=None):
    """Concatenates the per-process values of `x` along `axis`.

    Args:
        x: a tensor, array or `Variable` holding this process's value. A
            DTensor stands for its global value, which is returned in full.
        axis: the tensor axis to concatenate on.
        axis_name: optional mesh axis of the current distribution; only the
            processes along that axis take part.

    Returns:
        A plain tensor, identical on the participating processes.
    """
    value = _local_value(x)
    if isinstance(value, DTensor):
        return value.full_tensor()
    if num_processes() == 1:
        return value.clone()
    group = _axis_group(axis_name)
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, value.contiguous(), group=group)
    return torch.cat(parts, dim=axis)


def check_model_distributed(model, distribution):
    """Checks that a model's variables were created under `distribution`.

    A model built before `set_distribution` holds plain tensors, which
    would meet the distributed inputs inside a kernel ("got mixed
    torch.Tensor and DTensor"). The check runs once per model and
    distribution, and reads no values (it communicates nothing).

    Args:
        model: the `Layer` or `Model` about to run a distributed step.
        distribution: the active `Distribution`.

    Raises:
        ValueError: naming the first variable that is not distributed.
    """
    if getattr(model, "_dtensor_checked_distribution", None) is distribution:
        return
    for variable in model.weights:
        if not isinstance(getattr(variable, "_value", None), DTensor):
            raise ValueError(
                f"The variable '{variable.path}' with shape "
                f"{tuple(variable.shape)} of {model.__class__.__name__} "
                f"'{model.name}' was created before the distribution "
                f"{distribution.__class__.__name__} on mesh "
                f"{distribution.device_mesh} was set, so it is not "
                "distributed. Build the model (and create its variables) "
                "after `keras.distribution.set_distribution(...)` or inside "
                "`distribution.scope()`."
            )
    model._dtensor_checked_distribution = distribution


def validate_layout(shape, layout, path=None, require_divisible=True):
    """Checks that a layout fits a tensor shape on its mesh.

    Args:
        shape: the tensor shape.
        layout: a `DTensorLayout`.
        path: name of the variable or tensor, for the error message.
        require_divisible: whether every sharded dimension must divide by
            the product of its mesh axis sizes (variables must; data batches
            may be split unevenly).

    Raises:
        ValueError: naming the path, shape, layout, mesh and offending axis.
    """
    axes = layout.axes
    if axes is None:
        return
    shape = tuple(shape)
    if len(axes) != len(shape):
        raise ValueError(
            _layout_error(
                path,
                shape,
                layout,
                f"the layout has {len(axes)} axes but the tensor has rank "
                f"{len(shape)}",
            )
        )
    if not require_divisible:
        return
    mesh = layout.keras_mesh
    for dim, entry in enumerate(axes):
        names = _as_axis_tuple(entry)
        if not names:
            continue
        parts = math.prod(
            mesh.shape[list(mesh.axis_names).index(n)] for n in names
        )
        if shape[dim] % parts:
            raise ValueError(
                _layout_error(
                    path,
                    shape,
                    layout,
                    f"dimension {dim} of size {shape[dim]} is not divisible "
                    f"by {parts}, the size of mesh axis "
                    f"{' x '.join(repr(n) for n in names)}",
                )
            )


def _axes_to_placements(axes, device_mesh):
    """Maps Keras layout axes to one DTensor placement per mesh axis."""
    axis_names = list(device_mesh.axis_names)
    mesh_shape = tuple(device_mesh.shape)
    placements = [Replicate() for _ in axis_names]
    used = {}
    for tensor_dim, entry in enumerate(axes):
        mesh_dims = []
        for name in _as_axis_tuple(entry):
            if name not in axis_names:
                raise ValueError(
                    f"Invalid layout axes {axes} for mesh {device_mesh}: "
                    f"axis {name!r} is not a mesh axis. Valid axis names: "
                    f"{axis_names}"
                )
            if name in used:
                raise ValueError(
                    f"Invalid layout axes {axes} for mesh {device_mesh}: "
                    f"axis {name!r} shards both dimension {used[name]} and "
                    f"dimension {tensor_dim}; a mesh axis may be used once."
                )
            used[name] = tensor_dim
            mesh_dims.append(axis_names.index(name))
        for position, mesh_dim in enumerate(mesh_dims):
            if mesh_shape[mesh_dim] == 1:
                # As on JAX, an axis of size 1 splits nothing. A `Shard` on
                # it would only make DTensor refuse views of the dimension.
                continue
            # Mesh axes named earlier are the major ones. DTensor splits in
            # mesh-axis order, so an axis that follows a major axis in the
            # mesh must be split with the major axes' size as a stride.
            split_factor = math.prod(
                mesh_shape[d] for d in mesh_dims[:position] if d > mesh_dim
            )
            if split_factor == 1:
                placements[mesh_dim] = Shard(tensor_dim)
            else:
                placements[mesh_dim] = _StridedShard(
                    tensor_dim, split_factor=split_factor
                )
    return tuple(placements)


def _as_axis_tuple(entry):
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def _layout_error(path, shape, layout, reason):
    name = f"variable '{path}'" if path else "tensor"
    return (
        f"Invalid layout for {name} with shape {tuple(shape)}: layout axes "
        f"{layout.axes} on mesh {layout.keras_mesh}: {reason}."
    )


def _backend_layout(layout):
    """Returns the `DTensorLayout` for a `TensorLayout` or backend layout."""
    if isinstance(layout, DTensorLayout):
        return layout
    return layout.backend_layout


def _relayout(value, layout):
    """Redistributes a DTensor to `layout` (differentiably)."""
    if value.device_mesh == layout.mesh:
        if tuple(value.placements) == tuple(layout.placements):
            return value
        return value.redistribute(layout.mesh, layout.placements)
    return _dtensor_distribute(
        value.full_tensor(), layout.mesh, layout.placements, src_data_rank=None
    )


def _is_batch_array(x):
    return (
        isinstance(x, (torch.Tensor, np.ndarray)) and len(x.shape) > 0
    ) and not isinstance(x, KerasTensor)


def _to_device_tensor(x, mesh):
    if isinstance(x, DTensor):
        return x
    device = torch.device(mesh.device_type)
    if mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    if isinstance(x, torch.Tensor):
        return x.to(device)
    from keras.src.backend.torch.core import convert_to_tensor

    return convert_to_tensor(x).to(device)


def _contiguous_strides(shape):
    strides = []
    running = 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def _local_value(x):
    from keras.src.backend.torch.core import convert_to_tensor

    if hasattr(x, "value") and not isinstance(x, torch.Tensor):
        x = x.value
    if isinstance(x, DTensor):
        return x.detach()
    return convert_to_tensor(x).detach()


def _axis_group(axis_name):
    if axis_name is None:
        return None
    distribution = global_state.get_global_attribute("distribution")
    if distribution is None:
        raise ValueError(
            f"axis_name={axis_name!r} needs a distribution to be set."
        )
    mesh = distribution.device_mesh.backend_mesh
    return mesh.get_group(axis_name)


def _parse_device_name(device_name):
    device_name = str(device_name).lower()
    if ":" in device_name:
        device_type, device_id = device_name.split(":")
    else:
        device_type, device_id = device_name, 0
    device_type = "gpu" if device_type in ("gpu", "cuda") else device_type
    if device_type not in ("cpu", "gpu"):
        raise ValueError(f"Device not found: {device_name}")
    return device_type, int(device_id)


def _standardize_device_type(device_type):
    """`"cpu"` or `"gpu"`; a device type this machine lacks is an error."""
    if device_type is None:
        return "gpu" if torch.cuda.is_available() else "cpu"
    device_type = device_type.lower()
    if device_type == "cuda":
        device_type = "gpu"
    if device_type not in ("cpu", "gpu"):
        raise ValueError(
            f"Unsupported device_type={device_type!r} for the torch backend. "
            "Expected 'cpu' or 'gpu'."
        )
    if device_type == "gpu" and not torch.cuda.is_available():
        raise ValueError(
            "device_type='gpu' is not available: torch sees no CUDA device "
            f"(torch {torch.__version__}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            ". Available device types: ['cpu']."
        )
    return device_type


def _collective_device():
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _timeout():
    seconds = float(os.environ.get(TIMEOUT_ENV_VAR, DEFAULT_TIMEOUT_SECONDS))
    return datetime.timedelta(seconds=seconds)


def _launched_multi_process():
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _maybe_auto_initialize():
    """Joins torchrun's process group if the user did not call initialize."""
    if not dist.is_initialized() and _launched_multi_process():
        initialize()


def _ensure_process_group():
    """DTensor needs a process group, even for a single process."""
    if dist.is_initialized():
        return
    if _launched_multi_process():
        # No seed broadcast here: this runs from property accesses.
        _init_process_group(None, None, None)
        return
    dist.init_process_group(
        backend="gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=_timeout(),
    )


def _init_process_group(job_addresses, num_processes, process_id):
    """Creates the default process group from arguments and environment."""
    if job_addresses:
        addresses = job_addresses.split(",")
        if num_processes is not None and len(addresses) > 1:
            if num_processes != len(addresses):
                raise ValueError(
                    f"The provided job_addresses {addresses} has "
                    f"{len(addresses)} jobs, but num_processes is "
                    f"{num_processes}"
                )
        host, _, port = addresses[0].rpartition(":")
        if not host:
            raise ValueError(
                "Expected job addresses as 'host:port'. Received: "
                f"job_addresses={job_addresses}"
            )
        os.environ["MASTER_ADDR"] = host
        os.environ["MASTER_PORT"] = port
    world_size = (
        num_processes
        if num_processes is not None
        else int(os.environ.get("WORLD_SIZE", "1"))
    )
    rank = (
        process_id
        if process_id is not None
        else int(os.environ.get("RANK", "0"))
    )
    kwargs = {"timeout": _timeout(), "rank": rank, "world_size": world_size}
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        kwargs["store"] = dist.HashStore()
    if torch.cuda.is_available():
        torch.cuda.set_device(_local_cuda_device(rank))
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, **kwargs)


def _local_cuda_device(rank):
    """The CUDA device of this process: its `LOCAL_RANK`.

    Raises:
        ValueError: when this machine has no device for that local rank.
    """
    count = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", rank % count))
    if local_rank >= count:
        raise ValueError(
            f"Process with LOCAL_RANK={local_rank} (rank {rank}) has no CUDA "
            f"device: {count} device(s) are visible on this machine "
            f"(CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}). Start at most "
            f"{count} process(es) per machine (`torchrun "
            f"--nproc_per_node={count}`), make more GPUs visible, or run on "
            'CPU with gloo (CUDA_VISIBLE_DEVICES="").'
        )
    return local_rank


def _cpu_attention_sharding(query, key, value, *args, **kwargs):
    """Sharding rules of the CPU flash-attention forward.

    DTensor has rules for the CUDA attention kernels but not for the one
    `scaled_dot_product_attention` uses on CPU. Like its CUDA counterparts,
    it runs replicated, or split by batch (dim 0) or by head (dim 1), with
    query, key, value, output and log-sum-exp split the same way.
    """
    return _attention_strategies(2, 3, args, kwargs)


def _cpu_attention_backward_sharding(
    grad_out, query, key, value, out, logsumexp, *args, **kwargs
):
    """Sharding rules of the CPU flash-attention backward.

    As for the forward: replicated, or every tensor split by batch or by
    head alike.
    """
    return _attention_strategies(3, 6, args, kwargs)


def _attention_strategies(num_outputs, num_inputs, args, kwargs):
    """Replicated, batch-split and head-split attention strategies.

    DTensor does not redistribute keyword arguments, so an attention mask
    (`attn_mask=`) must already be laid out as a strategy needs: split like
    the queries where it has a batch or head dimension of its own,
    replicated where it broadcasts. `_align_attention_mask` lays the inputs
    out so that the strategy DTensor picks (the one needing no
    redistribution) is the one the mask was laid out for.
    """
    mask = kwargs.get("attn_mask")
    strategies = []
    for placement in (Replicate(), Shard(0), Shard(1)):
        mask_placement = Replicate()
        if mask is not None and placement.is_shard():
            if _mask_splits(mask.shape, placement.dim):
                mask_placement = placement
        others = [None] * len(args) + [
            mask_placement if isinstance(v, DTensorSpec) else None
            for v in kwargs.values()
        ]
        strategies.append(
            ([placement] * num_outputs, [placement] * num_inputs + others)
        )
    return strategies


register_sharding(
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
)(_cpu_attention_backward_sharding)


register_sharding(
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
)(_cpu_attention_sharding)


def _scatter_reduce_sharding(self, dim, index, src, reduce, *args, **kwargs):
    """Sharding rule of `scatter_reduce`, which DTensor lacks: replicated.

    Keras's segment reductions (used by `AUC`) call it on small tensors.
    """
    specs = [Replicate(), None, Replicate(), Replicate(), None]
    specs += [
        Replicate() if isinstance(v, DTensorSpec) else None
        for v in (*args, *kwargs.values())
    ]
    return [([Replicate()], specs)]


register_sharding(torch.ops.aten.scatter_reduce.two)(_scatter_reduce_sharding)

# Rules that some supported torch releases lack (see `sharding_rules`).
sharding_rules.register()
