"""Layers that compute each batch shard alone run on local tensors.

Inside a distributed eager step, every layer call (and every built-in
loss's per-sample values, `LossFunctionWrapper.call`) goes through
`call_layer`. A call's signature is the global shapes, dtypes and
placements of its tensor arguments, its other arguments, and the
`training` mode of the call context it inherits. The first call of a
layer with a signature runs on DTensors and is checked
(`local_call_checks`); the next ones run on local shards
(`local_calls`) where that check gave a plan, and on DTensors where not.
The plans are cached per layer (`plans_of`).

Contract:
- Only a call whose tensor arguments are all DTensors on the step's mesh
  with the same batch placements (split along dimension 0, or
  replicated), none with a Keras mask, can run locally; any other runs
  on DTensors, unchecked.
- Every call runs on DTensors under `torch.compile`, and whenever
  saved-tensor hooks are active: inside a checkpoint on DTensors (in
  forward, and in its recomputation in backward, which runs outside any
  scope the forward call entered) every call must take the path it
  takes in the other pass.
- `KERAS_DTENSOR_BATCH_LOCAL=0` in the environment (read at import)
  turns local calls off: every layer (and loss) then runs on DTensors.
- The path depends only on the program and the global shapes: every
  process takes the same one, and the collectives stay in lockstep.
- A call on DTensors (eager, outside remat) reads each variable split
  over the batch axes and a model axis gathered over the batch axes, in
  the order of the layer's variables, when the batch is split over more
  than one process (`_call_on_dtensors`).
"""

import os

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src.backend.common import global_state
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import inference_local_calls
from keras.src.backend.torch import local_call_checks
from keras.src.backend.torch import local_call_state
from keras.src.backend.torch import local_calls
from keras.src.backend.torch import local_replays
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import torch_runtime
from keras.src.backend.torch import training_local_calls
from keras.src.distribution import distribution_lib

ENABLED_ENV_VAR = "KERAS_DTENSOR_BATCH_LOCAL"
# Whether layers proven local run on local tensors.
ENABLED = os.environ.get(ENABLED_ENV_VAR, "1") != "0"

# Argument values other than tensors that a signature holds as they are.
_SCALARS = (bool, int, float, str, type(None))


class _NotLocal(Exception):
    """A call's arguments rule out a local call."""


def call_layer(layer, upstream_call, args, kwargs):
    """Calls `layer` inside a distributed step: locally where proven exact;
    its outputs hold no partial sums (`partial_sums_reduced`).

    Args:
        layer: the Keras layer.
        upstream_call: upstream `Layer.__call__`.
        args: the positional arguments of the call.
        kwargs: the keyword arguments of the call.

    Returns:
        The layer's outputs, as DTensors wherever the call took DTensors.
    """
    outputs = _call_layer(layer, upstream_call, args, kwargs)
    if local_replays.active():
        # A first call on DTensors notes its layer ends, a local run
        # replays them.
        return local_replays.layer_end(outputs, partial_sums_reduced)
    return partial_sums_reduced(outputs)


def partial_sums_reduced(outputs):
    """`outputs` with each DTensor's partial sums reduced (all-reduced to
    `Replicate` on the mesh axes where it is `Partial`).

    A layer's output is a value, as in JAX, where no array is a pending
    sum: a row-parallel layer's output is all-reduced where the layer
    ends, as Megatron's plan does. Left pending, DTensor's next ops chose
    by their own cost: keras-hub's residual adds kept the sums pending,
    their norms reduce-scattered them along the batch, and the next
    layers then gathered their kernels.
    """
    if type(outputs) is DTensor:
        # The common case, without walking a structure.
        return _reduced(outputs)
    if not any(
        isinstance(leaf, DTensor) and _has_partial(leaf)
        for leaf in torch_runtime.pytree.tree_leaves(outputs)
    ):
        return outputs
    return torch_runtime.pytree.tree_map_only(DTensor, _reduced, outputs)


def _has_partial(value):
    return any(p.is_partial() for p in value.placements)


def _reduced(value):
    if not _has_partial(value):
        return value
    placements = [
        Replicate() if p.is_partial() else p for p in value.placements
    ]
    return value.redistribute(value.device_mesh, placements)


def _call_layer(layer, upstream_call, args, kwargs):
    mode = created_tensors.current_mode()
    if mode is None or not local_calls_allowed():
        return upstream_call(layer, *args, **kwargs)
    try:
        leaves = []
        # A sublayer takes `training` from its caller's call context.
        training = call_context_training()
        signature = _signature((args, kwargs, training), leaves)
    except _NotLocal:
        return _call_on_dtensors(layer, upstream_call, args, kwargs, mode)
    try:
        placements = _batch_placements(leaves, mode.mesh)
    except _NotLocal:
        return _not_batch_local(
            layer, upstream_call, args, kwargs, mode, signature, leaves
        )
    plans = local_call_state.caches().plans.setdefault(layer, {})
    if signature not in plans:
        outputs, plans[signature] = local_call_checks.check_first_call(
            layer, upstream_call, args, kwargs, placements, mode.mesh
        )
        return outputs
    plan = plans[signature]
    if plan is not None and plan.recomputes(layer):
        return upstream_call(layer, *args, **kwargs)
    if plan is None:
        return _not_batch_local(
            layer, upstream_call, args, kwargs, mode, signature, leaves
        )
    return local_calls.call_locally(layer, upstream_call, args, kwargs, plan)


def _not_batch_local(
    layer, upstream_call, args, kwargs, mode, signature, leaves
):
    """A call that is not batch-local: local where it reproduces its
    DTensor call, without gradients (`inference_local_calls`) or with
    them (`training_local_calls`); else on DTensors."""

    def on_dtensors():
        return _call_on_dtensors(layer, upstream_call, args, kwargs, mode)

    for path in (inference_local_calls, training_local_calls):
        if path.applies(leaves, mode.mesh):
            return path.call_layer(
                layer, upstream_call, args, kwargs, signature, on_dtensors
            )
    return on_dtensors()


def _call_on_dtensors(layer, upstream_call, args, kwargs, mode):
    """A call on DTensors that reads variables split over the batch axes
    and a model axis gathered over the batch axes (FSDP's unshard, the
    model axes left to DTensor), as a first call does
    (`local_call_checks.UnshardedVariables`): DTensor's operators would
    otherwise move activations to meet such a kernel (keras-hub's layouts
    on a (2, 2) mesh split activations along their hidden size and
    gathered them back). Variables that a local call can read are read
    as DTensor reads them."""
    placements = _batch_split(mode.mesh)
    if placements is None:
        return upstream_call(layer, *args, **kwargs)
    with local_call_checks.UnshardedVariables(
        layer, placements, readable=False
    ):
        return upstream_call(layer, *args, **kwargs)


def _batch_split(mesh):
    """The batch placements of the distribution's inputs on `mesh`
    (`Shard(0)` on the batch axis), or None when the batch is not split
    over more than one process, or no model axis can split a variable
    too (a one-axis mesh: nothing for `_call_on_dtensors` to gather)."""
    if mesh.ndim < 2:
        return None
    distribution = distribution_lib.distribution()
    name = getattr(distribution, "batch_dim_name", None)
    if name is None or name not in mesh.mesh_dim_names:
        return None
    axis = mesh.mesh_dim_names.index(name)
    if mesh.size(axis) == 1:
        return None
    return tuple(
        Shard(0) if dim == axis else Replicate() for dim in range(mesh.ndim)
    )


def plans_of(layer):
    """The layer's plans so far: {call signature: `LocalCallPlan`, or None
    where the layer runs on DTensors with that signature}."""
    return local_call_state.caches().plans.get(layer, {})


def local_calls_allowed():
    """Whether a call may run locally here: local calls are on, the step
    is not being compiled, no saved-tensor hooks are active (a local
    call inside a checkpoint must take the path of its other pass), and
    no check runs a layer on DTensors (`training_local_calls`)."""
    return (
        ENABLED
        and not torch.compiler.is_compiling()
        and not local_calls.saved_tensors_hooked()
        and not local_call_state.step_state().dtensor_checks
    )


def call_context_training():
    """The `training` mode a call inherits from its caller's call context
    (None outside any call)."""
    context = global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.get_value("training")


def _signature(value, leaves):
    """A hashable signature of call arguments; DTensors go to `leaves`.

    Raises:
        _NotLocal: for a plain tensor, a Keras mask or any other object
            whose effect on the call cannot be told from its value.
    """
    if isinstance(value, DTensor):
        if getattr(value, "_keras_mask", None) is not None:
            raise _NotLocal
        leaves.append(value)
        # Read from the spec: a tensor's `shape` and `dtype` go through
        # the step's torch function mode.
        spec = torch_internals.spec_of(value)
        meta = spec.tensor_meta
        return (DTensor, meta.shape, meta.dtype, spec.placements)
    if isinstance(value, _SCALARS):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value),) + tuple(_signature(x, leaves) for x in value)
    if isinstance(value, dict):
        return (dict,) + tuple(
            (key, _signature(x, leaves)) for key, x in value.items()
        )
    raise _NotLocal


def _batch_placements(leaves, mesh):
    """The one placement tuple of the DTensor arguments, if it is allowed.

    On a mesh axis of one process, a placement other than a split of the
    batch is read as `Replicate` (`local_call_checks.batch_layout`):
    arguments whose placements differ only there have the same batch
    placements.

    Raises:
        _NotLocal: without DTensor arguments, with several placements, on
            another mesh, or with a split along a dimension other than 0
            over more than one process.
    """
    if not leaves:
        raise _NotLocal
    placements = leaves[0].placements
    for leaf in leaves:
        if leaf.device_mesh != mesh:
            raise _NotLocal
        if leaf.placements != placements:
            break
    else:
        if _splits_only_the_batch(placements):
            return placements
    placements = local_call_checks.batch_layout(placements, mesh)
    if not _splits_only_the_batch(placements):
        raise _NotLocal
    for leaf in leaves:
        if local_call_checks.batch_layout(leaf.placements, mesh) != placements:
            raise _NotLocal
    return placements


def _splits_only_the_batch(placements):
    return all(p.is_replicate() or p.is_shard(0) for p in placements)
