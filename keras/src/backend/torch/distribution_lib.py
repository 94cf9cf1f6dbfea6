"""Utilities for distribution strategy with the PyTorch backend.

The PyTorch backend distributes with `torch.distributed` and DTensor: one
process drives one device, a Keras `DeviceMesh` becomes a torch
`DeviceMesh` over process ranks, and a `TensorLayout` becomes a tuple of
DTensor placements, one per mesh axis. This module holds the functions of
the JAX backend's `distribution_lib`: devices, `initialize`, the
`_to_backend_*` conversions and the `distribute_*` functions. The jobs
behind them live in the modules imported below (named at the imports).

Contract, collectives in lockstep: every process issues the same
collectives, in the same order, from the thread that runs the step; a
collective paired with a different one is a crash on gloo ("Received data
size doesn't match expected size"), and a hang or wrong numbers on NCCL.
Collectives are issued only by calls that every process makes in the same
order: `initialize`, `set_distribution`, the steps of
`fit`/`evaluate`/`predict`, `convert_to_numpy` and saving. Nothing that
may run on some processes only issues one. Within a step, the order is
fixed by the program, not by timing. A process that stops taking part (it
died, or skipped a call) makes the others fail within
`KERAS_DTENSOR_TIMEOUT_SECONDS`, never hang.
"""

import os

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import distribute_tensor as _dtensor_distribute

from keras.src import tree
from keras.src.backend.common import KerasVariable
from keras.src.backend.common.keras_tensor import KerasTensor

# The jobs behind this module's functions live beside it: `process_group`
# (the process group and the shared seed), `dtensor_layouts` (layouts as
# placements, checked by `keras.src.distribution.layout_validation`),
# `batch_distribution` (input batches), `collectives` (`all_reduce`,
# `all_gather`), `created_tensors` (the step's torch function mode),
# `batch_local` (layers proven local to each batch shard, run on plain
# tensors), `gathered_units` (the fully sharded variables of a local call,
# gathered unit by unit), `sharded_initialization` (variables created shard
# by shard) and `sharding_rules` (DTensor rules, registered when the first
# mesh is made).
from keras.src.backend.torch import batch_distribution
from keras.src.backend.torch import deferred_initialization
from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import gloo_groups
from keras.src.backend.torch import local_call_checks
from keras.src.backend.torch import local_call_state
from keras.src.backend.torch import local_replays
from keras.src.backend.torch import process_group
from keras.src.backend.torch import reducer
from keras.src.backend.torch import sharded_initialization
from keras.src.backend.torch import sharding_rules
from keras.src.backend.torch import torch_internals

# What other modules and Keras code reach through this module.
from keras.src.backend.torch.batch_distribution import distribute_data  # noqa: F401
from keras.src.backend.torch.batch_distribution import distribute_global_batch  # noqa: F401
from keras.src.backend.torch.collectives import all_gather  # noqa: F401
from keras.src.backend.torch.collectives import all_reduce  # noqa: F401
from keras.src.backend.torch.core import convert_to_tensor
from keras.src.backend.torch.core import to_torch_dtype
from keras.src.backend.torch.created_tensors import in_step_context  # noqa: F401
from keras.src.backend.torch.created_tensors import replicate_built_tensors  # noqa: F401
from keras.src.backend.torch.created_tensors import replicate_created_tensors  # noqa: F401
from keras.src.backend.torch.created_tensors import replicating_created_tensors  # noqa: F401
from keras.src.backend.torch.dtensor_layouts import DTensorLayout  # noqa: F401
from keras.src.backend.torch.dtensor_layouts import validate_layout  # noqa: F401
from keras.src.backend.torch.process_group import TIMEOUT_ENV_VAR  # noqa: F401

# `set_distribution` shares the seed once, by `share_seed_once`, if
# `initialize` did not, and converts the distribution's mesh, creating its
# process groups.
from keras.src.backend.torch.process_group import share_seed_once  # noqa: F401

_BACKEND_MESHES = {}


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
    process_group.maybe_auto_initialize()
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
    process_group.initialize(job_addresses, num_processes, process_id)


def num_processes():
    """Return the number of processes for the current distribution setting."""
    return process_group.num_processes()


def process_id():
    """Return the current process ID for the distribution setting."""
    return process_group.process_id()


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
    # Nothing that may run on some processes only issues a collective: no
    # property (a mesh's `backend_mesh` shares no seed), no `repr`, no
    # logging, no progress bar (logs are Python floats on every process
    # before callbacks see them).
    process_group.ensure_process_group()
    sharding_rules.register()
    world_size = num_processes()
    if sorted(ranks.ravel().tolist()) != list(range(world_size)):
        raise ValueError(
            f"The device mesh {device_mesh} must hold exactly one device per "
            f"process, for all {world_size} processes. Received devices: "
            f"{np.ravel(device_mesh.devices).tolist()}"
        )
    # The mesh's groups are made now (`gloo_groups`).
    with gloo_groups.one_worker_thread():
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
        A `DTensorLayout` (torch mesh, placements, axes, Keras mesh), or
        None for no layout.
    """
    if tensor_layout is None:
        return None
    device_mesh = tensor_layout.device_mesh
    if device_mesh is None:
        raise ValueError(
            "Cannot create sharding when device mesh is not set "
            "for TensorLayout."
        )
    axes = tuple(tensor_layout.axes)
    placements = dtensor_layouts.axes_to_placements(axes, device_mesh)
    # `DeviceMesh.backend_mesh` converts once per Keras mesh.
    return dtensor_layouts.DTensorLayout(
        device_mesh.backend_mesh, placements, axes, device_mesh
    )


def distribute_variable(value, layout, trainable=True, path=None):
    """Creates the distributed parameter of a variable from its value.

    The value is this process's shard where `initialize_variable_shard`
    could create it alone (a DTensor in the layout already); otherwise
    every process computes the same full value from the shared random seed
    (see `process_group.initialize_rng`) and keeps its own slice of it, as
    JAX does with a sharded initializer. Nothing is communicated.

    Args:
        value: the full (global) value of the variable, a torch tensor.
        layout: `TensorLayout` or `DTensorLayout` for the variable.
        trainable: whether the parameter requires gradients.
        path: the variable path, named in error messages.

    Returns:
        A `torch.nn.Parameter` holding a DTensor.
    """
    layout = _checked_variable_layout(tuple(value.shape), layout, path)
    if isinstance(value, DTensor):
        value = dtensor_layouts.relayout(value, layout)
    else:
        value = _dtensor_distribute(
            value.detach(), layout.mesh, layout.placements, src_data_rank=None
        )
    parameter = torch.nn.Parameter(value, requires_grad=trainable)
    if trainable:
        # Gradient buckets (`reducer`) are filled and sent by autograd's
        # hooks in the order the engine accumulates gradients, which on CPU
        # runs on the thread that called backward; batch-end callbacks run
        # on the main thread.
        parameter.register_post_accumulate_grad_hook(
            reducer.reduce_gradient_when_ready
        )
    return parameter


def initialize_variable_shard(initializer, shape, dtype, layout, path=None):
    """This process's shard of a new variable, without its full value.

    Args:
        initializer: the variable's initializer.
        shape: the variable's shape.
        dtype: the variable's Keras dtype.
        layout: `TensorLayout` or `DTensorLayout` for the variable.
        path: the variable path, named in error messages.

    Returns:
        A DTensor in `layout`, or `None` where the initializer has to run
        in full (see `sharded_initialization`).
    """
    layout = _checked_variable_layout(tuple(shape), layout, path)
    return sharded_initialization.initialize_variable_shard(
        initializer, tuple(shape), to_torch_dtype(dtype), layout
    )


def _checked_variable_layout(shape, layout, path):
    """`layout` as a `DTensorLayout`, once checked against the variable."""
    if getattr(layout, "device_mesh", None) is not None:
        from keras.src.distribution import layout_validation

        # Checked before the layout is converted, so that the message
        # names the variable.
        layout_validation.check_layout(
            path, shape, layout.axes, layout.device_mesh
        )
    layout = dtensor_layouts.backend_layout(layout)
    validate_layout(shape, layout, path=path, require_divisible=True)
    return dtensor_layouts.replicated_on_unit_axes(layout)


def assign_to_variable(parameter, value):
    """Writes `value` into a distributed parameter, in the parameter's layout.

    Plain values are the full value; each process keeps its own slice of it,
    so no communication is needed. DTensor values of another layout are
    redistributed first.

    Args:
        parameter: the DTensor parameter of a variable.
        value: a torch tensor, numpy array or DTensor of the same shape.
    """
    local_call_checks.note_effect()
    spec = torch_internals.spec_of(parameter)
    replicated = (Replicate(),) * len(spec.placements)
    local = torch_internals.local_tensor(parameter)
    if not isinstance(value, DTensor) and spec.placements == replicated:
        # Every process holds the whole value: no slicing to do.
        with torch.no_grad():
            local.copy_(torch.as_tensor(value, device=local.device))
        deferred_initialization.note_written(local)
        return
    layout = dtensor_layouts.DTensorLayout(
        spec.mesh, tuple(spec.placements), None, None
    )
    if isinstance(value, DTensor):
        value = dtensor_layouts.relayout(value, layout)
    else:
        value = _dtensor_distribute(
            torch.as_tensor(value, device=parameter.device),
            layout.mesh,
            layout.placements,
            src_data_rank=None,
        )
    with torch.no_grad():
        local.copy_(value.to_local())
    # A variable a load creates and then writes needs no initial values.
    deferred_initialization.note_written(local)


def distribute_tensor(tensor, layout):
    """Distribute the tensor based on the layout.

    Nested structures are distributed leaf by leaf with the same layout.
    Symbolic tensors and non-tensors are returned unchanged, so functional
    model construction is never affected. A DTensor is redistributed to the
    layout, and, as with JAX's sharding constraints, so is its gradient in
    the backward pass; a plain tensor or numpy array is taken as the full
    value held by process 0. A Keras variable is distributed as its value.

    Args:
        tensor: a tensor or a nested structure of tensors.
        layout: `TensorLayout` or `DTensorLayout`.

    Returns:
        The distributed value(s).
    """
    if layout is None:
        return tensor
    layout = dtensor_layouts.backend_layout(layout)

    def distribute_one(x):
        if isinstance(x, KerasVariable):
            x = x.value
        if isinstance(x, np.ndarray):
            x = batch_distribution.to_device_tensor(x, layout.mesh)
        if isinstance(x, KerasTensor) or not isinstance(x, torch.Tensor):
            return x
        if x.device.type == "meta":
            return x
        validate_layout(x.shape, layout, require_divisible=False)
        if isinstance(x, DTensor):
            if local_replays.counting_layer_ends():
                # A layer's first call on DTensors notes the relayout as a
                # layer end, which its local runs replay: a row-parallel
                # output laid out replicated is all-reduced there.
                return local_replays.layer_end(
                    x, lambda value: _relaid(value, layout)
                )
            return _relaid(x, layout)
        # A layer runs on local tensors (`batch_local`) only where its first
        # call issued no collective other than the gathers of its fully
        # sharded variables, a verdict every process reaches alike; a local
        # call gathers those in the order the program reads them, and
        # autograd's hooks gather them again and reduce-scatter their
        # gradients in the engine's order, as they do the buckets.
        if local_call_state.step_state().replays:
            # A local run replays the layer end its first call noted here.
            return local_replays.layer_end(x, None)
        if local_call_state.running_locally():
            # A local shard in a local call, whose first (watched) call
            # proved that this layout leaves local tensors as they are.
            return x
        local_call_checks.note_effect()
        return _dtensor_distribute(x, layout.mesh, layout.placements)

    return tree.map_structure(distribute_one, tensor)


def _relaid(value, layout):
    """A DTensor laid out as `layout`, its gradient too where it has one.

    A relayout that moves values is an effect (`note_effect`) that keeps
    a layer on DTensors, but for the sum of partial sums noted as a layer
    end in a first call (`local_replays.layer_end`), which its local runs
    replay.
    """
    if not local_call_checks.keeps_local_values(value, layout) and not (
        local_replays.counting_layer_ends() and _sums_partials(value, layout)
    ):
        local_call_checks.note_effect()
    if value.requires_grad and value.device_mesh == layout.mesh:
        return _ConstrainLayout.apply(value, layout.mesh, layout.placements)
    return dtensor_layouts.relayout(value, layout)


def _sums_partials(value, layout):
    """Whether laying `value` out as `layout` only sums its partial sums
    (`Partial("sum")` to `Replicate`, other placements kept)."""
    return value.device_mesh == layout.mesh and all(
        have == want or (have.is_partial("sum") and want.is_replicate())
        for have, want in zip(value.placements, layout.placements)
    )


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


def distribute_data_input(per_process_batch, layout, batch_dim_name=None):
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
            A DTensor is the global batch already: it is laid out as
            `layout` (`distribute_tensor`).
        layout: `TensorLayout` or `DTensorLayout` for the global batch, or
            None: the part is returned as a tensor, undistributed.
        batch_dim_name: the mesh axis that splits the batch. Optional, as
            in upstream's two-argument form (keras 3.16): the layout says
            which mesh axes split the batch.

    Returns:
        A DTensor holding the global batch.
    """
    del batch_dim_name  # The layout says which mesh axes split the batch.
    if layout is None:
        return convert_to_tensor(per_process_batch)
    if isinstance(per_process_batch, DTensor):
        return distribute_tensor(per_process_batch, layout)
    (value,) = batch_distribution.distribute_process_parts(
        [per_process_batch], [layout]
    )
    return value


def call_on_global_batch(function, args, kwargs, distribution):
    """Runs a direct call of a model, layer, loss or metric.

    Outside `fit`, `evaluate` and `predict`, the arrays and plain tensors
    passed to such a call are the global batch, as a step's batch is:
    they are distributed on entry (`distribute_data`: split along the
    batch axis, or built from every process's part when
    `auto_shard_dataset=False`), and the call runs in
    `replicate_created_tensors`, as a step does. DTensors are passed as
    they are, so the targets of a custom training loop meet the model's
    outputs in the same layout.

    Every process must make the call, in the same order: with
    `auto_shard_dataset=False` it exchanges the parts' shapes.

    Args:
        function: the call, a function of `*args, **kwargs`.
        args: its positional arguments.
        kwargs: its keyword arguments.
        distribution: the active `Distribution`.

    Returns:
        What `function` returns.
    """
    args, kwargs = distribute_data((args, kwargs), distribution)
    with replicate_created_tensors(distribution.device_mesh):
        return function(*args, **kwargs)


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


def _parse_device_name(device_name):
    """`"gpu:3"` -> `("gpu", 3)`; `"cuda"` is `"gpu"`."""
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
