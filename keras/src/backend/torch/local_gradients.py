"""Gradients of local views of parameters, reduced in the reducer's buckets.

A layer that runs on local tensors (`batch_local`) reads a replicated
parameter through a local view. In a `backward()` that accumulates into
the parameter, the view's gradient joins its bucket directly as a plain
tensor (`reduce_local_gradient`), so that no partial DTensor is built and
accumulated for it. In Keras's train step the view is a gradient leaf
instead (`gradient_leaf`): autograd runs a leaf's accumulation as soon
as its gradient is complete, so buckets fill, and are launched, in the
order backward completes gradients, as DDP's hooks launch them.

A parameter may reach the buckets more than once in one backward pass (a
layer called twice, a weight shared by two layers, or read both locally
and on DTensors): its gradients are summed before the all-reduce where
they share an open bucket, and after it otherwise (`gradient_bucket`).

Contract: both functions decline (False, None) whenever the buckets
cannot take the gradient; the caller then hands autograd the gradient as
a partial DTensor, which the parameter's hook reduces
(`reducer.reduce_gradient_when_ready`). No collectives here: the
reducer's buckets issue them.
"""

import functools

import torch

from keras.src.backend.torch import parameter_gradients
from keras.src.backend.torch import reducer
from keras.src.backend.torch import torch_runtime


def reduce_local_gradient(node, local, placements):
    """Buckets the gradient of a local view of a parameter, if it can.

    Args:
        node: the autograd node the view's gradient flows to: the
            parameter's `AccumulateGrad` when the view is of a parameter.
        local: the view's gradient, a plain tensor.
        placements: the placements of that gradient as a DTensor: partial
            sums over the batch axes.

    Returns:
        True if the gradient joined a bucket, and the parameter will get
        its reduced gradient when backward ends, or if it needs no
        reduction (the batch axes hold one process each) and the
        parameter has it already, laid out as the parameter. False, having
        done nothing, when the view is not of a parameter whose gradients
        the buckets reduce, when backward does not accumulate into it (as
        in `torch.autograd.grad`) or builds a graph, or when the gradient
        needs more than an all-reduce: the caller then hands autograd the
        gradient as a DTensor.
    """
    if (
        type(node) is not torch_runtime.ACCUMULATE_GRAD
        or torch.is_grad_enabled()
    ):
        return False
    parameter = node.variable
    if not reducer.reduced_by_buckets(parameter):
        return False
    try:
        if not torch_runtime.engine_will_execute(node):
            return False
    except RuntimeError:
        # `torch.autograd.grad` does not accumulate into leaves.
        return False
    state = reducer.context()
    kept = state.assignment.local_plan(parameter, placements, local)
    reduction = kept[2]
    if reduction is None:
        return False
    if not reduction[0]:
        # The batch axes hold one process each: the partial sum is whole.
        parameter.grad = state.layouts.like_parameter(
            parameter_gradients.accumulated(parameter, local.contiguous()),
            parameter,
        )
        return True
    pending = state.reducer
    if not (pending.finalizer_queued or pending.queue_finalizer()):
        return False
    pending.add(parameter, local, reduction, kept[3])
    return True


def gradient_leaf(parameter, placements, local):
    """A leaf tensor on `local`'s storage whose gradients join the buckets.

    The local view a layer reads a parameter through in a step whose
    backward pass accumulates into the parameters (`loss.backward()`, as
    Keras's train step calls it): each gradient autograd accumulates into
    the leaf is taken out at once and joins its bucket, as a local view's
    (`reduce_local_gradient`) does. Autograd runs a leaf's accumulation as
    soon as its gradient is complete, as it runs DDP's hooks, so buckets
    are launched while backward goes on; a view made by an autograd
    function runs in the order it was made, and one kept from an earlier
    step would run last. The leaf shares `local`'s storage and version
    counter, so it sees the optimizer's in-place updates.

    The leaf does not lead back to `parameter`: `torch.autograd.grad` of
    the parameter does not see it. Its gradients reach the parameter only
    through the buckets.

    Args:
        parameter: a `torch.nn.Parameter` holding a DTensor.
        placements: the placements of the view's gradients as DTensors:
            partial sums over the batch axes.
        local: the parameter's local tensor.

    Returns:
        The leaf, or None unless the buckets reduce the parameter's
        gradients and these need an all-reduce over processes.
    """
    if not reducer.reduced_by_buckets(parameter):
        return None
    assignment = reducer.context().assignment
    kept = assignment.local_plan(parameter, placements, local)
    reduction = kept[2]
    if reduction is None or not reduction[0]:
        return None
    leaf = local.detach().requires_grad_()
    leaf.register_post_accumulate_grad_hook(
        functools.partial(_bucket_leaf_gradient, parameter, reduction, kept[3])
    )
    return leaf


def _bucket_leaf_gradient(parameter, reduction, key, leaf):
    """Post-accumulate-grad hook of a `gradient_leaf`: moves its gradient
    to the parameter's bucket."""
    grad = leaf.grad
    leaf.grad = None
    if torch.is_grad_enabled():
        raise RuntimeError(
            "A backward pass that builds a graph (`create_graph=True`) "
            "reached a local view of a distributed variable made for "
            "`loss.backward()` in Keras's train step; its gradient cannot "
            "be differentiated again."
        )
    pending = reducer.current()
    pending.queue_finalizer()
    pending.add(parameter, grad, reduction, key)
