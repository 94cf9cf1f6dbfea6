"""Input batches as DTensors: the global batch, split along its axis.

With `auto_shard_dataset=True` every process holds the global batch and
keeps its own slice (`distribute_global_batch`, no communication). With
`False`, each process passes its own part of the global batch
(`distribute_process_parts`): the parts' shapes are exchanged (two small
all-gathers per step, issued by every process in the same order), and rows
move between processes only where the parts do not match DTensor's split.
"""

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import tree
from keras.src.backend.common.keras_tensor import KerasTensor
from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import process_group
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import StridedShard
from keras.src.backend.torch.torch_internals import TensorMeta


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
    rows = _even_rows(global_batch, layout)
    if rows is not None:
        return rows
    layout = dtensor_layouts.backend_layout(layout)
    value = to_device_tensor(global_batch, layout.mesh)
    if isinstance(value, DTensor):
        return dtensor_layouts.relayout(value, layout)
    return distribute_tensor(
        value, layout.mesh, layout.placements, src_data_rank=None
    )


# Plans kept at most (shapes seldom vary: a last, smaller batch).
_MAX_ROWS_PLANS = 64


class _RowsPlan:
    """Where this process's equal share of a batch's rows lies."""

    def __init__(self, keras_mesh, start=0, size=0, spec=None):
        self.keras_mesh = keras_mesh
        self.start = start
        self.size = size
        self.spec = spec


def _even_rows(global_batch, layout):
    """This process's rows of a tensor batch as a DTensor, or None.

    The common case of `distribute_tensor`, planned once per Keras layout,
    shape, dtype and device: a Keras `TensorLayout` that splits dimension
    0 over one mesh axis (replicated over the others) into equal parts, of
    a tensor on the mesh's device that requires no gradient. None in any
    other case (a `DTensorLayout` among them).
    """
    if (
        type(global_batch) is not torch.Tensor
        or global_batch.requires_grad
        or global_batch.ndim == 0
        or getattr(layout, "device_mesh", None) is None
    ):
        return None
    key = (
        id(layout.device_mesh),
        tuple(layout.axes),
        tuple(global_batch.shape),
        global_batch.dtype,
        global_batch.device,
    )
    plan = _ROWS_PLANS.get(key)
    if plan is None or plan.keras_mesh is not layout.device_mesh:
        plan = _rows_plan(global_batch, layout)
        _ROWS_PLANS.keep(key, plan)
    if plan.spec is None:
        return None
    local = global_batch.narrow(0, plan.start, plan.size)
    return dtensor_layouts.dtensor_from_spec(
        local, dtensor_layouts.copy_spec(plan.spec)
    )


class _RowsPlans:
    """The `_RowsPlan`s made, at most `_MAX_ROWS_PLANS` of them."""

    def __init__(self):
        # (id of a Keras mesh, layout axes, shape, dtype, device) ->
        # `_RowsPlan`.
        self._plans = {}

    def get(self, key):
        return self._plans.get(key)

    def keep(self, key, plan):
        """Keeps `plan`, first dropping every plan when full."""
        if len(self._plans) >= _MAX_ROWS_PLANS:
            self._plans.clear()
        self._plans[key] = plan


# The process's plans, shared by the threads that distribute batches.
_ROWS_PLANS = _RowsPlans()


def _rows_plan(global_batch, layout):
    """The `_RowsPlan` of `_even_rows`; without a spec where it does not
    apply."""
    backend = dtensor_layouts.backend_layout(layout)
    mesh, placements = backend.mesh, tuple(backend.placements)
    plan = _RowsPlan(layout.device_mesh)
    split = [i for i, p in enumerate(placements) if not p.is_replicate()]
    if (
        len(split) != 1
        or type(placements[split[0]]) is not Shard
        or placements[split[0]].dim != 0
        or to_device_tensor(global_batch, mesh).device != global_batch.device
    ):
        return plan
    (mesh_dim,) = split
    parts = mesh.size(mesh_dim)
    if global_batch.shape[0] % parts:
        return plan
    plan.size = global_batch.shape[0] // parts
    plan.start = mesh.get_local_rank(mesh_dim) * plan.size
    plan.spec = DTensorSpec(
        mesh,
        placements,
        tensor_meta=TensorMeta(
            global_batch.shape, global_batch.stride(), global_batch.dtype
        ),
    )
    return plan


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
        return _map_leaves(distribute_one, data)
    leaves = tree.flatten(data)
    parts = [
        i
        for i, x in enumerate(leaves)
        if _is_batch_array(x) and not isinstance(x, DTensor)
    ]
    distributed = distribute_process_parts(
        [leaves[i] for i in parts],
        [distribution.get_data_layout(leaves[i].shape) for i in parts],
    )
    for i, value in zip(parts, distributed):
        leaves[i] = value
    return tree.pack_sequence_as(data, leaves)


def pad_to_divide(data, distribution):
    """Pads the batches in `data` whose rows do not divide evenly.

    A batch whose rows do not divide by the processes that split it (one
    prompt on a batch axis of two) gets copies of its last row until they
    do, so that it splits evenly, as a divisible batch does. For calls
    that run many steps on one batch (keras-hub's `generate`), where an
    uneven split would gather along the batch at every step; a copy of a
    real row behaves as that row does (it stops generating where the row
    stops). Every process must call this function, in the same order: a
    split batch is gathered first.

    Args:
        data: nested structure of DTensors, tensors or arrays: the global
            batch, as every process holds it.
        distribution: the active `Distribution`.

    Returns:
        `(data, rows)`: the padded structure (the padded batches as plain
        tensors, the global batch as every process holds it, others as
        they were), and the number of rows before padding (None when no
        batch needed any).
    """
    rows = []

    def pad_one(x):
        if not _is_batch_array(x):
            return x
        layout = dtensor_layouts.backend_layout(
            distribution.get_data_layout(x.shape)
        )
        parts = 1
        for mesh_dim, placement in enumerate(layout.placements):
            if placement.is_shard(0):
                parts *= layout.mesh.size(mesh_dim)
        if x.shape[0] % parts == 0:
            return x
        rows.append(x.shape[0])
        value = x.full_tensor() if isinstance(x, DTensor) else x
        value = to_device_tensor(value, layout.mesh)
        copies = value[-1:].expand(parts - x.shape[0] % parts, *value.shape[1:])
        return torch.cat([value, copies])

    data = _map_leaves(pad_one, data)
    return data, (rows[0] if rows else None)


def _map_leaves(function, data):
    """`tree.map_structure(function, data)`, with lists and tuples (of
    exactly those types) and their tensor, array and None leaves mapped
    here.

    A step's batch is a list holding one `(x, y, sample_weight)` tuple:
    pytree's generic traversal of it costs more than cutting the batch.
    Any other structure goes to `tree.map_structure`.
    """
    kind = type(data)
    if kind is list or kind is tuple:
        return kind(_map_leaves(function, item) for item in data)
    if data is None or isinstance(data, (torch.Tensor, np.ndarray)):
        return function(data)
    return tree.map_structure(function, data)


def distribute_process_parts(parts, layouts):
    """Builds global batches from every process's parts of them.

    Args:
        parts: this process's part of each global batch (tensors or
            arrays), the same number of them on every process.
        layouts: the layout of each global batch.

    Returns:
        A list with one DTensor per part.
    """
    layouts = [dtensor_layouts.backend_layout(layout) for layout in layouts]
    locals_ = [
        to_device_tensor(part, layout.mesh)
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
    if process_group.num_processes() == 1:
        return [shapes]
    encoded = [len(shapes)]
    for shape in shapes:
        encoded += [len(shape), *shape]
    device = process_group.collective_device()
    length = torch.tensor([len(encoded)], dtype=torch.int64, device=device)
    lengths = [
        torch.empty_like(length) for _ in range(process_group.num_processes())
    ]
    dist.all_gather(lengths, length)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.int64, device=device)
    padded[: len(encoded)] = torch.tensor(encoded, dtype=torch.int64)
    gathered = [
        torch.empty_like(padded) for _ in range(process_group.num_processes())
    ]
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
            stride=dtensor_layouts.contiguous_strides(global_shape),
        )
    if len(batch_dims) != 1 or isinstance(
        layout.placements[batch_dims[0]], StridedShard
    ):
        raise ValueError(
            "Per-process batches of different sizes "
            f"{sizes} need the batch split over one mesh axis; the layout "
            f"{layout.axes} on mesh {layout.keras_mesh} splits it over "
            f"mesh dims {batch_dims}."
        )
    full = _gather_parts(local, mesh.get_group(batch_dims[0]), sizes)
    return distribute_tensor(full, mesh, layout.placements, src_data_rank=None)


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


def _is_batch_array(x):
    """Whether `x` is a concrete array or tensor with a batch dimension."""
    return (
        isinstance(x, (torch.Tensor, np.ndarray)) and len(x.shape) > 0
    ) and not isinstance(x, KerasTensor)


def to_device_tensor(x, mesh):
    """`x` (array or tensor) on the device of `mesh`; DTensors as they are."""
    if isinstance(x, DTensor):
        return x
    device = torch.device(mesh.device_type)
    if mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    if isinstance(x, torch.Tensor):
        return x.to(device)
    from keras.src.backend.torch.core import convert_to_tensor

    return convert_to_tensor(x).to(device)
