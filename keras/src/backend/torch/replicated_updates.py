"""Computations on replicated variables alone run on their local tensors.

Under a data-parallel distribution every variable is a replicated DTensor,
and after the gradient buckets every gradient is one too. An optimizer
step then reads and writes only replicated values, and so do the results
of metrics, which read only the metrics' variables. `call_on_local_tensors`
runs such a computation on the local tensors directly, where DTensor's
dispatch buys nothing. Callers, through `keras_dtensor`'s edits under a
distribution: `TorchOptimizer.apply` (`apply_on_local_tensors`), a `Mean`'s
or `Sum`'s `update_state` (`update_on_local_tensors`) and
`Trainer.get_metrics_result` (`result_on_local_tensors`).

Contract: the values are those of the DTensor computation. Where some
operand is not replicated (see `held_values`), the computation runs on
DTensors as before. An update (an optimizer step, a metric's
`update_state`) counts as an effect for `batch_local`, as an assignment on
DTensors does.

Collectives: none, here or in the DTensor computation it replaces,
except the all-reduce of a partial value passed to a metric update, which
the DTensor computation issues too.
"""

import contextlib
import functools

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.torch import batch_reductions
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import local_call_checks
from keras.src.backend.torch import torch_internals


def apply_on_local_tensors(optimizer, upstream_apply, grads, variables):
    """Runs `optimizer.apply` on local tensors where all are replicated.

    Args:
        optimizer: a built or unbuilt Keras optimizer.
        upstream_apply: upstream `apply` (unbound).
        grads: the gradients, as `apply` takes them.
        variables: the trainable variables, or None, as `apply` takes them.

    Returns:
        What `upstream_apply` returns.
    """
    if variables is not None:
        variables = list(variables)
    held = None
    if optimizer.built and grads:
        trainable = optimizer._trainable_variables
        if variables is not None:
            trainable = variables
        # Every variable the step may read: the trainable variables and
        # the optimizer's own (iterations, learning rate, slots and
        # accumulators).
        held = held_values(list(trainable) + optimizer.variables, grads)
    if held is None:
        return upstream_apply(optimizer, grads, variables)
    # The gradients are passed as their local tensors.
    local_grads = [
        None if g is None else torch_internals.local_tensor(g) for g in grads
    ]
    # Assigns to DTensor variables (`update_on_local_tensors`).
    local_call_checks.note_effect()
    return call_on_local_tensors(
        held, upstream_apply, optimizer, local_grads, variables
    )


def result_on_local_tensors(trainer, upstream_get_metrics_result):
    """Runs `trainer.get_metrics_result()` on local tensors if it may.

    Metric results read only the metrics' variables. Where all of them
    are replicated DTensors, the results are computed on their local
    tensors, and are plain tensors, equal on every process.

    Returns:
        The results, or None where some variable is not replicated (the
        caller then computes them on DTensors).
    """
    # Every variable the results may read: the metrics' variables.
    held = held_values(trainer.metrics_variables)
    if held is None:
        return None
    return call_on_local_tensors(held, upstream_get_metrics_result, trainer)


def update_on_local_tensors(metric, upstream_update, values, sample_weight):
    """Runs a `Mean`'s or `Sum`'s `update_state` locally if it may.

    Such an update reads only its arguments and the metric's variables.
    Where the variables and the tensor arguments are all replicated
    DTensors (the loss of a step, reduced over the batch, is one), the
    update runs on their local tensors; arguments that are not tensors
    (the trainer passes the batch size as a Python number) are passed as
    they are, and become plain tensors where DTensor would have made
    replicated ones of the same values. A value or weight that is a
    partial scalar (the train step's loss where no gradient bucket
    carried it) is first all-reduced (`batch_reductions.whole_value`),
    where the update on DTensors would have redistributed it.

    Args:
        metric: the metric.
        upstream_update: upstream `update_state` (unbound).
        values: the values, as `update_state` takes them.
        sample_weight: the sample weights, or None.

    Returns:
        What `upstream_update` returns.
    """
    # The one collective here: the all-reduce of a partial value, which the
    # update on DTensors issues too.
    values = batch_reductions.whole_value(values)
    sample_weight = batch_reductions.whole_value(sample_weight)
    tensors = [
        x for x in (values, sample_weight) if isinstance(x, torch.Tensor)
    ]
    held = None
    if all(getattr(x, "_keras_mask", None) is None for x in tensors):
        held = held_values(metric.variables, tensors)
    if held is None:
        return upstream_update(metric, values, sample_weight=sample_weight)
    values, sample_weight = (
        dtensor_layouts.waited_local_tensor(x)
        if isinstance(x, torch.Tensor)
        else x
        for x in (values, sample_weight)
    )
    update = functools.partial(upstream_update, sample_weight=sample_weight)
    # Assigns to DTensor variables, as the update on DTensors does: a layer
    # call that makes it cannot run on local shards (a layer call watched
    # while it updated a metric this way keeps running on DTensors).
    local_call_checks.note_effect()
    return call_on_local_tensors(held, update, metric, values)


def held_values(variables, tensors=()):
    """`[(variable, value)]` for a local run, or None.

    None unless every variable's value and every tensor of `tensors` (None
    entries aside) is a DTensor replicated on every mesh axis of more than
    one process (its local tensor holds its whole value; `_whole_locally`
    is checked only where a placement is not `Replicate`), outside a
    stateless scope and
    compilation, and outside a distributed step or in one whose torch
    function mode is the innermost.
    """
    # Any other case (a sharded variable or gradient, a partial gradient, a
    # variable that is not a DTensor, a stateless scope, a compiled step)
    # runs on DTensors as before.
    if (
        torch.compiler.is_compiling()
        or in_stateless_scope()
        or (
            created_tensors.replicating_created_tensors()
            and created_tensors.current_mode() is None
        )
    ):
        return None
    held = [(v, v._value) for v in variables]
    replicated = None
    for tensor in [value for _, value in held] + list(tensors):
        if tensor is None:
            continue
        if not isinstance(tensor, DTensor):
            return None
        placements = torch_internals.spec_of(tensor).placements
        if replicated is None:
            replicated = (Replicate(),) * len(placements)
        if placements != replicated and not _whole_locally(tensor):
            return None
    # The values are those of the DTensor computation: with replicated
    # operands only, DTensor's sharding propagation makes every output
    # replicated and computes it with the same local operator.
    return held


def _whole_locally(tensor):
    """Whether a DTensor's local tensor holds its whole value: it is
    replicated on every mesh axis of more than one process."""
    mesh = torch_internals.spec_of(tensor).mesh
    return all(
        p.is_replicate() or _mesh_dim_size(mesh, mesh_dim) == 1
        for mesh_dim, p in enumerate(torch_internals.spec_of(tensor).placements)
    )


def _mesh_dim_size(mesh, mesh_dim):
    return mesh.size(mesh_dim)


def call_on_local_tensors(held, function, *args):
    """Calls `function(*args)` with each variable of `held` reading its
    value's local tensor, the step's torch function mode suspended.

    Args:
        held: what `held_values` returned.
        function: the function.
        *args: its arguments.
    """
    # Tensors the computation creates stay plain (the step's
    # `replicate_created_tensors` mode is suspended), as in a
    # single-process step; metric results are plain tensors, equal on
    # every process.
    if created_tensors.replicating_created_tensors():
        suspended = created_tensors.suspended()
    else:
        suspended = contextlib.nullcontext()
    try:
        # While it runs, every variable it may read holds its local tensor
        # as its value. DTensor would run each operator on each process's
        # local tensor, which holds the whole value, the same operator on
        # the same values everywhere, with no communication. Its dispatch
        # buys nothing, and an optimizer step is dozens of operators over
        # lists of tensors.
        for variable, value in held:
            variable._value = torch_internals.local_tensor(value)
        with suspended:
            return function(*args)
    finally:
        # Updates wrote into the local tensors, which are the DTensors' own
        # storage, so the variables hold the updated values when their
        # DTensor values are put back. In reverse: a variable listed twice
        # gets its first value back.
        for variable, value in reversed(held):
            variable._value = value
