"""The local call: a layer run on local shards, its outputs as DTensors.

Under a distribution every operator of a step runs on DTensors, and
DTensor's dispatch costs Python time on each of them. Most layers of a
data-parallel model compute each example from that example alone, with
replicated variables: DTensor then runs every operator on each process's
own shard and communicates nothing, so its dispatch buys nothing. A
layer whose first call proved that (`local_call_checks`) runs on plain
local tensors instead, as DDP runs a module, and its backward pass runs
on plain tensors too (`call_locally`): its DTensor arguments are read
as local tensors (`local_tensor_of`), its variables as local views
(`local_variables`), the step's torch function mode (`created_tensors`)
is suspended, and its outputs are laid out again as DTensors with the
placements and global shapes of the first call (`local_views.FromLocal`).
A layer recomputed whole (remat mode "full") runs its local call in a
checkpoint of its own.

On each DTensor it returns, a local call caches the local tensor it
computed (`local_call_state.caches().computed`): a later local call, or a
loss reduction (`batch_reductions`), given such a DTensor unchanged reads
that tensor instead of going through `to_local`, and its gradient reaches
the first call as the round trip would bring it.

Contract: a local call issues no collective but the gathers of its
sharded variables (`unit_gathering`) in the order it reads them, and in
backward the gathers again and the reduce-scatters, in autograd's order.
"""

import contextlib

import torch
import torch.utils.checkpoint

from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import local_call_state
from keras.src.backend.torch import local_variables
from keras.src.backend.torch import local_views
from keras.src.backend.torch import reshard_after_forward
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import torch_runtime


def saved_tensors_hooked():
    """Whether autograd's saved tensors pass through hooks (e.g. remat)."""
    return torch_runtime.saved_tensors_hooked()


def computed_locally(value):
    """Whether `value`, a DTensor, is a local call's output, unchanged
    since: its local tensor is the one the call computed."""
    computed = local_call_state.caches().computed.get(value)
    return computed is not None and computed[1] == torch_runtime.version(value)


def local_tensor_of(value):
    """The local tensor of a DTensor, for a computation on local tensors.

    A DTensor that a local call returned, unchanged since, gives the
    tensor that the call computed, with its autograd history: its
    gradient reaches the call as directly as the round trip through
    `from_local` and `to_local` would bring it (a gradient split as the
    DTensor is, per process), without those two autograd nodes. Any
    other DTensor gives `to_local()` (detached where it requires no
    gradient).
    """
    computed = local_call_state.caches().computed.get(value)
    if computed is not None and computed[1] == torch_runtime.version(value):
        return computed[0]
    if not value.requires_grad:
        # No gradient to route back (a batch of inputs): a new tensor
        # object on the same storage, as `to_local()` gives, without its
        # autograd function.
        return torch_internals.local_tensor(value).detach()
    return value.to_local()


def call_locally(layer, upstream_call, args, kwargs, plan):
    """Runs the layer on local shards and lays its outputs out again.

    Args:
        layer: the Keras layer (or loss).
        upstream_call: upstream `Layer.__call__`.
        args: the positional arguments of the call.
        kwargs: the keyword arguments of the call.
        plan: the layer's `local_call_checks.LocalCallPlan` for the
            call's signature.
    """
    args, kwargs = map_tensors((args, kwargs), local_tensor_of)
    if getattr(layer, "_remat_mode", None) is None:
        outputs = _run_locally(layer, upstream_call, args, kwargs, plan)
    else:
        outputs = _recompute_locally(layer, upstream_call, args, kwargs, plan)
    return as_dtensors(layer, outputs, plan.outputs)


def as_dtensors(layer, outputs, output_specs):
    """A local call's outputs as the DTensors its first call returned
    (`as_dtensor`, one spec per tensor, in flattening order)."""
    computed = local_call_state.caches().computed
    specs = iter(output_specs)
    return map_tensors(
        outputs, lambda local: as_dtensor(layer, local, next(specs), computed)
    )


def as_dtensor(layer, local, output_spec, computed):
    """A local output as the DTensor the first call returned, noting in
    `computed` the local tensor it holds."""
    local_shape, spec, gradient_placements = output_spec
    if local.shape != local_shape or local.dtype != spec.tensor_meta.dtype:
        raise RuntimeError(
            f"{local_variables.describe(layer)} ran on local shards and "
            f"returned shape {tuple(local.shape)} and dtype {local.dtype} "
            f"where its first call returned {tuple(local_shape)} and "
            f"{spec.tensor_meta.dtype} per process. Its call depends on "
            "something other than its arguments and variables."
        )
    output = local_views.FromLocal.apply(local, spec, gradient_placements)
    computed[output] = (local, torch_runtime.version(output))
    return output


def _run_locally(layer, upstream_call, args, kwargs, plan):
    """Calls the layer on local tensors, reading local variable views.

    The step's torch function mode is suspended; a recomputation in a
    backward pass outside the step runs without it already.
    """
    if created_tensors.current_mode() is None:
        suspended = contextlib.nullcontext()
    else:
        suspended = created_tensors.suspended()
    # Inside a checkpoint, the checkpoint frees the unsharded values with
    # the rest, and its recomputation unshards them again.
    hooked = saved_tensors_hooked()
    resharding = None
    if plan.units and not hooked:
        resharding = reshard_after_forward.ReshardAfterForward()
    scope = local_variables.LocalVariableScope(
        layer,
        plan.gradient_placements,
        plan.units,
        resharding,
        # A checkpoint's two passes read views made in each.
        views=None if hooked else plan.views,
    )
    state = local_call_state.step_state()
    state.local_calls += 1
    try:
        with (
            scope,
            suspended,
            reshard_after_forward.saved_tensors_hooks(resharding),
        ):
            return upstream_call(layer, *args, **kwargs)
    finally:
        state.local_calls -= 1


def _recompute_locally(layer, upstream_call, args, kwargs, plan):
    """A local call of a layer recomputed whole, in one checkpoint.

    The checkpoint holds the whole local call, scope included, so the
    recomputation in backward reads the same local views; inside it the
    layer's own remat is off (one checkpoint, not two).
    """

    def run():
        mode = layer._remat_mode
        layer._remat_mode = None
        try:
            return _run_locally(layer, upstream_call, args, kwargs, plan)
        finally:
            layer._remat_mode = mode

    return torch.utils.checkpoint.checkpoint(run, use_reentrant=False)


def map_tensors(value, function):
    """`value` with `function` applied to its tensors (tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, tuple):
        return tuple(map_tensors(x, function) for x in value)
    if isinstance(value, list):
        return [map_tensors(x, function) for x in value]
    if isinstance(value, dict):
        return {k: map_tensors(x, function) for k, x in value.items()}
    return value
