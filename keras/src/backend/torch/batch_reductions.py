"""Loss reductions over a split batch, on local tensors and one all-reduce.

A loss's per-sample values in a data-parallel step are a DTensor split
along the batch; upstream's reduction (`reduce_weighted_values`) would
run operator by operator on DTensors. `reduce_on_local_tensors` computes
it as DDP would: each process reduces its own values with upstream's
function on plain local tensors, and one all-reduce over the batch axes
adds the processes' results up (`"sum"`: the sum of the local sums;
`"sum_over_batch_size"` and `"mean"`: the sum of the local means divided
by the number of batch shards). `call_loss` runs a whole built-in
`Loss.__call__` on local tensors once earlier calls proved that exact.

Contract: the result has the placements upstream's reduction gives
under DTensor (a mean is a replicated DTensor scalar, a sum a partial
one) and its value, bit for bit with a power of two batch shards
(`_global_value`); the gradient flows back as DTensor's own. Anything
else (a mask, a weighted mean, sample weights not split like the
values, an uneven split, values not split along their first dimension)
takes upstream's reduction on DTensors. Within
`means_reduced_with_gradients` (the train step's loss) a mean stays a
partial DTensor, which the gradient buckets reduce
(`bucket_riders.reduced_with_gradients`); `whole_value` reduces a
partial scalar with the all-reduce used here.

Collectives: for a mean, one all-reduce of the result per batch axis of
more than one process (none on one process), where the DTensor
reduction issues its own; a sum issues none, as the DTensor reduction.
Every process takes the same path, decided from global shapes and
placements.
"""

import collections
import contextlib
import math
import threading
import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate

from keras.src.backend.torch import batch_local
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import local_calls
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import torch_runtime
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import TensorMeta

# Reductions whose global value the local ones add up to (with a scale).
_LOCAL_REDUCTIONS = ("sum", "sum_over_batch_size", "mean")


def reduce_on_local_tensors(
    upstream_reduce, values, sample_weight, mask, reduction, dtype
):
    """`reduce_weighted_values` of split values, locally where exact.

    Args:
        upstream_reduce: upstream `reduce_weighted_values`.
        values: the per-sample loss values.
        sample_weight: sample weights, or None.
        mask: a mask, or None.
        reduction: the loss's reduction.
        dtype: the dtype of the result.

    Returns:
        What `upstream_reduce` returns for these arguments.
    """
    plan = _local_plan(values, sample_weight, mask, reduction)
    if plan is None:
        if _STEP.noted_plans is not None:
            _STEP.noted_plans.append(None)
        return upstream_reduce(
            values,
            sample_weight=sample_weight,
            mask=mask,
            reduction=reduction,
            dtype=dtype,
        )
    local_weight = None
    if sample_weight is not None:
        local_weight = local_calls.local_tensor_of(sample_weight)
    with created_tensors.suspended():
        local = upstream_reduce(
            local_calls.local_tensor_of(values),
            sample_weight=local_weight,
            mask=None,
            reduction=reduction,
            dtype=dtype,
        )
    plan = _LossPlan(values.device_mesh, reduction, *plan)
    if _STEP.noted_plans is not None:
        _STEP.noted_plans.append(
            plan if local_calls.computed_locally(values) else None
        )
    return _global_value(local, plan)


def _global_value(local, plan):
    """The reduction of every process's `local` reduction, as upstream's
    reduction on DTensors lays it out."""
    mesh = plan.mesh
    if plan.reduction == "sum":
        # As upstream's sum on DTensors: a partial sum, all-reduced where
        # it is used.
        placements = [Replicate()] * mesh.ndim
        for mesh_dim in plan.batch_dims:
            placements[mesh_dim] = Partial("sum")
        return DTensor.from_local(local, mesh, placements, run_check=False)
    if _STEP.with_gradients and plan.reduced_dims:
        # Left partial for the gradient buckets to reduce: a scalar
        # all-reduce of its own cost a DataParallel step 1.7 to 3.8 ms on
        # 2 and 4 gloo processes of a 2-core machine (150 to 250
        # alternating steps), about 6% of the transformer's. Whoever reads
        # the partial value before then gets DTensor's all-reduce of it,
        # as every process does, in the same place.
        return _UnreducedMean.apply(local, mesh, plan.reduced_dims, plan.shards)
    with created_tensors.suspended():
        # Every process holds the same number of values, so the global
        # mean is the sum of the local means divided by the shard count.
        # With a power of two processes the division is exact and the
        # result is the DTensor reduction's bit for bit (the local mean
        # divided by the shard count is the local sum divided by the
        # global count, rounded once); with another count it may differ
        # from it in the last bit.
        if plan.shards > 1:
            local = local / plan.shards
        return _SumOverBatch.apply(local, mesh, plan.reduced_dims)


class _StepReductions(threading.local):
    """The loss reductions' flags of the step running in this thread."""

    # Whether a mean is left to the gradient buckets to reduce
    # (`means_reduced_with_gradients`).
    with_gradients = False
    # The plans `reduce_on_local_tensors` took inside `_call_noting_plan`,
    # with None for a reduction on DTensors or of values not computed
    # locally; None outside it.
    noted_plans = None


# Per thread, as the step's torch function mode is: a step's forward
# (which reduces its losses) runs in the thread that runs the step.
_STEP = _StepReductions()


@contextlib.contextmanager
def means_reduced_with_gradients():
    """Within the block, a mean reduced on local tensors is not all-reduced.

    It is a DTensor scalar partial over the batch axes of more than one
    process, `Partial("avg")` of each process's local mean: the global
    mean's value, which DTensor all-reduces where an operator needs it
    whole. Adding up losses or scaling them keeps it partial (DTensor's
    rules for a partial average), so the train step's loss reaches
    backward unreduced, and its gradient is the same as the reduced mean's
    (each local mean's is the whole gradient divided by the number of
    batch shards).
    """
    outer = _STEP.with_gradients
    _STEP.with_gradients = True
    try:
        yield
    finally:
        _STEP.with_gradients = outer


class _LossPlan(
    collections.namedtuple(
        "_LossPlan",
        ("mesh", "reduction", "shards", "batch_dims", "reduced_dims"),
    )
):
    """How local reductions add up to the global one: the mesh, the
    reduction, the batch shard count, the batch mesh dims and those of
    them to reduce over (`_local_plan`)."""


class _LossPlans:
    """The local plans of losses whose value is computed from local
    tensors end to end, kept while the loss lives."""

    def __init__(self):
        # loss -> {its arguments' key: `_LossPlan`}.
        self._by_loss = weakref.WeakKeyDictionary()

    def get(self, loss, key):
        """The loss's plan for arguments of `key`, or None."""
        plans = self._by_loss.get(loss)
        return None if plans is None else plans.get(key)

    def keep(self, loss, key, plan):
        self._by_loss.setdefault(loss, {})[key] = plan

    def of(self, loss):
        """The loss's plans by key (empty if none)."""
        return dict(self._by_loss.get(loss, {}))


# The plans of every loss, shared by the threads of the process (a plan
# depends only on the loss and its arguments' layouts).
_LOSS_PLANS = _LossPlans()


def call_loss(loss, upstream_call, y_true, y_pred, sample_weight):
    """`Loss.__call__` of a built-in loss in a distributed step: from the
    arguments' local tensors where earlier calls proved that exact.

    A built-in loss (`LossFunctionWrapper`) computes per-sample values
    with `batch_local.call_layer`, then reduces them with
    `reduce_on_local_tensors`. Once a call with the same global shapes,
    dtypes and placements has computed its values locally (the watched
    call proved them local to each batch shard) and reduced them locally,
    the whole `Loss.__call__` runs on the local tensors of its arguments:
    the casts, the per-sample values and the reduction are the operators
    those calls ran on local tensors, and the processes' local reductions
    are added up by the same all-reduce (`_global_value`). No DTensor is
    made or read in between.

    Args:
        loss: the `LossFunctionWrapper`.
        upstream_call: upstream `Loss.__call__`.
        y_true: the targets.
        y_pred: the predictions.
        sample_weight: sample weights, or None.

    Returns:
        What `upstream_call` returns for these arguments.
    """
    key = _loss_key(loss, y_true, y_pred, sample_weight)
    if key is None:
        return upstream_call(loss, y_true, y_pred, sample_weight)
    plan = _LOSS_PLANS.get(loss, key)
    if plan is None or plan.mesh is not torch_internals.spec_of(y_pred).mesh:
        return _call_noting_plan(
            loss, upstream_call, key, y_true, y_pred, sample_weight
        )
    local_pred = local_calls.local_tensor_of(y_pred)
    if getattr(local_pred, "_keras_mask", None) is not None:
        return upstream_call(loss, y_true, y_pred, sample_weight)
    local_weight = None
    if sample_weight is not None:
        local_weight = local_calls.local_tensor_of(sample_weight)
    with created_tensors.suspended():
        local = upstream_call(
            loss, local_calls.local_tensor_of(y_true), local_pred, local_weight
        )
    return _global_value(local, plan)


def _loss_key(loss, y_true, y_pred, sample_weight):
    """What a loss's local plan is kept under: the loss's reduction and
    dtype, the inherited `training` mode, and the global shape, dtype and
    placements of each argument; None where a local call may not run
    (`batch_local.local_calls_allowed`) or the arguments are not all
    unmasked DTensors on the step's mesh (sample weights may be None)."""
    mode = created_tensors.current_mode()
    if (
        mode is None
        or not batch_local.local_calls_allowed()
        or type(y_true) is not DTensor
        or type(y_pred) is not DTensor
        or (sample_weight is not None and type(sample_weight) is not DTensor)
    ):
        return None
    arguments = (y_true, y_pred) + (
        () if sample_weight is None else (sample_weight,)
    )
    for argument in arguments:
        if (
            torch_internals.spec_of(argument).mesh is not mode.mesh
            or getattr(argument, "_keras_mask", None) is not None
        ):
            return None
    return (
        loss.reduction,
        loss.dtype,
        batch_local.call_context_training(),
    ) + tuple(_global_layout(a) for a in arguments)


def _global_layout(value):
    """A DTensor's global shape, dtype and placements, read from its spec
    (a tensor's `shape` and `dtype` go through the step's torch function
    mode)."""
    spec = torch_internals.spec_of(value)
    return spec.tensor_meta.shape, spec.tensor_meta.dtype, spec.placements


def _call_noting_plan(loss, upstream_call, key, y_true, y_pred, weight):
    """`upstream_call`, keeping the loss's local plan for `key` where the
    call's one reduction reduced locally computed values locally."""
    outer = _STEP.noted_plans
    noted = _STEP.noted_plans = []
    try:
        value = upstream_call(loss, y_true, y_pred, weight)
    finally:
        _STEP.noted_plans = outer
    if len(noted) == 1 and noted[0] is not None:
        _LOSS_PLANS.keep(loss, key, noted[0])
    return value


def _local_plan(values, sample_weight, mask, reduction):
    """`(batch shard count, batch mesh dims, mesh dims to reduce)`, or
    None.

    The batch mesh dims split the values; those of more than one process
    are reduced (a mesh axis of one process holds its values whole).

    None unless the reduction may run locally: inside a distributed step
    (whose torch function mode is the innermost), an additive reduction,
    no mask, values of rank 1 or more split evenly along dimension 0 over
    some mesh axes and replicated over the others, and sample weights that
    are None or split like the values.
    """
    if (
        reduction not in _LOCAL_REDUCTIONS
        or mask is not None
        or type(values) is not DTensor
        or values.ndim == 0
        or values.shape[0] == 0
        or created_tensors.current_mode() is None
        or torch.compiler.is_compiling()
    ):
        return None
    spec = torch_internals.spec_of(values)
    if sample_weight is not None and (
        type(sample_weight) is not DTensor
        or torch_internals.spec_of(sample_weight).placements != spec.placements
        or torch_internals.spec_of(sample_weight).mesh != spec.mesh
        or sample_weight.shape[:1] != values.shape[:1]
    ):
        return None
    shards = 1
    batch_dims = []
    reduced_dims = []
    for mesh_dim, placement in enumerate(spec.placements):
        if placement.is_shard(0):
            size = spec.mesh.size(mesh_dim)
            shards *= size
            batch_dims.append(mesh_dim)
            if size > 1:
                reduced_dims.append(mesh_dim)
        elif not placement.is_replicate():
            return None
    if not batch_dims or values.shape[0] % shards:
        return None
    return shards, tuple(batch_dims), tuple(reduced_dims)


class _SumOverBatch(torch.autograd.Function):
    """The sum of every process's local scalar, as a replicated DTensor.

    One all-reduce per batch mesh axis of more than one process, the
    functional collective DTensor issues (`torch_runtime.all_reduce_sum`);
    the gradient of each local scalar is the (replicated) gradient of the sum.
    """

    @staticmethod
    def forward(ctx, local, mesh, batch_dims):
        total = local.detach()
        for mesh_dim in batch_dims:
            total = torch_runtime.all_reduce_sum(total, mesh, mesh_dim)
        replicated = (Replicate(),) * mesh.ndim
        spec = DTensorSpec(
            mesh,
            replicated,
            tensor_meta=TensorMeta(total.shape, total.stride(), total.dtype),
        )
        return dtensor_layouts.dtensor_from_spec(total, spec)

    @staticmethod
    def backward(ctx, grad):
        return _whole_gradient(grad), None, None


class _UnreducedMean(torch.autograd.Function):
    """The mean of every process's local mean, as a partial DTensor.

    No communication: the output is `Partial("avg")` over the batch mesh
    axes of more than one process. The gradient of each local mean is the
    (replicated) gradient of the mean divided by the number of batch
    shards, as that of the local mean divided by them and summed.
    """

    @staticmethod
    def forward(ctx, local, mesh, reduced_dims, shards):
        ctx.shards = shards
        placements = [Replicate()] * mesh.ndim
        for mesh_dim in reduced_dims:
            placements[mesh_dim] = Partial("avg")
        spec = DTensorSpec(
            mesh,
            tuple(placements),
            tensor_meta=TensorMeta(local.shape, local.stride(), local.dtype),
        )
        return dtensor_layouts.dtensor_from_spec(local.detach(), spec)

    @staticmethod
    def backward(ctx, grad):
        return _whole_gradient(grad) / ctx.shards, None, None, None


def _whole_gradient(grad):
    """The whole value of a scalar's gradient, as a plain tensor."""
    if isinstance(grad, DTensor):
        if {type(p) for p in torch_internals.spec_of(grad).placements} == {
            Replicate
        }:
            # The whole value, on every process: no redistribution.
            return torch_internals.local_tensor(grad)
        return grad.full_tensor()
    return grad


def whole_value(value):
    """A DTensor partial over some mesh axes, reduced; else `value`.

    A DTensor whose placements are `Replicate` and `Partial("sum")` or
    `Partial("avg")` is all-reduced over its partial axes (one
    `torch_runtime.all_reduce_sum` each, the division of an average after
    them), and returned replicated, detached: the value DTensor's
    redistribution to `Replicate` gives. Anything else is returned as it is.

    Collectives: one all-reduce per partial mesh axis of more than one
    process, decided from the placements (the same on every process).
    """
    if type(value) is not DTensor:
        return value
    spec = torch_internals.spec_of(value)
    reduction = dtensor_layouts.additive_partial_dims(spec)
    if reduction is None:
        return value
    summed, averaged = reduction
    local = dtensor_layouts.waited_local_tensor(value).detach()
    if created_tensors.current_mode() is None:
        suspended = contextlib.nullcontext()
    else:
        suspended = created_tensors.suspended()
    with suspended:
        for mesh_dim in summed:
            if spec.mesh.size(mesh_dim) > 1:
                local = torch_runtime.all_reduce_sum(local, spec.mesh, mesh_dim)
        divisor = math.prod(spec.mesh.size(mesh_dim) for mesh_dim in averaged)
        if divisor > 1:
            local = local / divisor
    return dtensor_layouts.replicated_like(local, spec)
