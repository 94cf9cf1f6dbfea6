"""Optimizer steps on replicated variables run on their local tensors.

Under a data-parallel distribution every variable is a replicated DTensor,
and after the gradient buckets every gradient is one too. An optimizer
step then reads and writes only replicated values, and DTensor runs each
of its operators on each process's local tensor, which holds the whole
value: the same operator on the same values everywhere, with no
communication. Its dispatch buys nothing, and an optimizer step is
dozens of operators over lists of tensors.

`apply_on_local_tensors` runs such a step on the local tensors directly:
for the duration of `optimizer.apply`, every variable the step may read
(the trainable variables and the optimizer's own: iterations, learning
rate, slots, accumulators) holds its local tensor as its value, and the
gradients are passed as their local tensors. The updates write into the
local tensors, which are the DTensors' own storage, so the variables hold
the updated values when their DTensor values are put back. Tensors the
step creates stay plain (the step's `replicate_created_tensors` mode is
suspended), as in a single-process step.

The values are those of the DTensor step: with replicated operands only,
DTensor's sharding propagation makes every output replicated and
computes it with the same local operator. Any other case (a sharded
variable or gradient, a partial gradient, a variable that is not a
DTensor, a stateless scope, a compiled step) runs the step on DTensors
as before.

Collectives: none, here or in the DTensor step it replaces.
"""

import contextlib

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.torch import created_tensors


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
    scope = _local_scope(optimizer, grads, variables)
    if scope is None:
        return upstream_apply(optimizer, grads, variables)
    suspended, held = scope
    local_grads = [None if g is None else g._local_tensor for g in grads]
    try:
        for variable, value in held:
            variable._value = value._local_tensor
        with suspended:
            return upstream_apply(optimizer, local_grads, variables)
    finally:
        # In reverse: a variable listed twice gets its first value back.
        for variable, value in reversed(held):
            variable._value = value


def _local_scope(optimizer, grads, variables):
    """`(suspension context, [(variable, DTensor value)])`, or None.

    None unless the step may run on local tensors: the optimizer is built,
    the step is eager and outside any stateless scope, and every gradient
    and every value the step may read is a replicated DTensor.
    """
    if (
        not optimizer.built
        or not grads
        or torch.compiler.is_compiling()
        or in_stateless_scope()
    ):
        return None
    if created_tensors.replicating_created_tensors():
        if created_tensors.current_mode() is None:
            return None
        suspended = created_tensors.suspended()
    else:
        suspended = contextlib.nullcontext()
    if variables is None:
        variables = optimizer._trainable_variables
    held = [(v, v._value) for v in variables]
    held.extend((v, v._value) for v in optimizer.variables)
    replicated = None
    for tensor in [value for _, value in held] + list(grads):
        if tensor is None:
            continue
        if not isinstance(tensor, DTensor):
            return None
        placements = tensor._spec.placements
        if replicated is None:
            replicated = (Replicate(),) * len(placements)
        if placements != replicated:
            return None
    return suspended, held
