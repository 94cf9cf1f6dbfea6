"""Bucketed gradient reduction, overlapped with the backward pass.

A replicated parameter used with batch-sharded inputs receives its gradient
as a DTensor that is a partial sum over the data-parallel mesh axes. This
module brings such gradients to their parameter's placements the way DDP
does: as each gradient is accumulated, it joins a bucket of gradients that
need the same reduction; a full bucket is flattened and all-reduced
asynchronously while backward goes on; when backward ends, the remaining
buckets are sent and every gradient becomes a view of its reduced bucket,
laid out like its parameter. Each gradient is thus reduced exactly once per
step, and the optimizer never meets a partial gradient.

Buckets are filled in the order the autograd engine accumulates gradients,
which is the same on every process since every process runs the same
program; collectives are therefore issued in the same order everywhere.
Gradients that need anything other than an all-reduce of partial sums (for
instance a reduce-scatter to a sharded parameter) are redistributed by
DTensor directly.

A layer that runs on local tensors (`batch_local`) reads a replicated
parameter through a local view; in a `backward()` that accumulates into
the parameter, the view's gradient joins its bucket directly as a plain
tensor (`reduce_local_gradient`), so that no partial DTensor is built and
accumulated for it. A parameter may then reach the buckets more than
once in one backward pass (a layer called twice, a weight shared by two
layers, or read both locally and on DTensors): its gradients are summed
before the all-reduce where they share an open bucket, and after it
otherwise. In Keras's train step the view is a gradient leaf instead
(`gradient_leaf`): autograd runs a leaf's accumulation as soon as its
gradient is complete, so buckets fill, and are sent, in the order
backward completes gradients, as DDP's hooks send them.

Mesh axes of one process need no reduction: a partial sum over one
process is the whole sum. A gradient that differs from its parameter's
placements only on such axes is handed to the parameter at once, as the
same local tensor laid out as the parameter, without a bucket.

A partial value that is not a gradient can ride along with them
(`reduced_with_gradients`): the train step's loss, a partial mean, joins
the bucket sent when backward ends, as one more element, instead of
being all-reduced by itself.

The buffers of the asynchronous all-reduces: a bucket's flat buffer is a
new tensor (a `cat` of copies), which the bucket holds and nothing
writes until its work is waited for (`finish`); the gradients it was
copied from may be freed at once. A backward pass that raised has the
buckets it sent waited for before they are dropped (`discard_pending`),
so no collective of a step outlives it.
"""

import contextlib
import functools
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor.placement_types import Partial

from keras.src.backend.torch import dtensor_layouts

BUCKET_CAP_ENV_VAR = "KERAS_DTENSOR_BUCKET_CAP_MB"
DEFAULT_BUCKET_CAP_MB = 25
FIRST_BUCKET_CAP_ENV_VAR = "KERAS_DTENSOR_FIRST_BUCKET_CAP_MB"
# As in DDP, the first bucket is small so that communication starts early,
# where it runs beside the computation (`_first_bucket_cap_bytes`).
FIRST_BUCKET_CAP_BYTES = 2**20

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class _Bucket:
    """Gradients that share one mesh, dtype and partial-sum reduction.

    The gradients' placements on the other mesh axes may differ: each one
    is handed back with its own parameter's placements.
    """

    def __init__(self, mesh, partial_dims, reduce_op):
        self.mesh = mesh
        self.partial_dims = partial_dims
        self.reduce_op = reduce_op
        self.entries = []
        # id(parameter) -> index of its entry.
        self.index = {}
        self.nbytes = 0
        self.flat = None
        self.work = None
        self.riders = ()

    def add(self, parameter, local):
        """Adds a local gradient, summed with the parameter's earlier one."""
        index = self.index.get(id(parameter))
        if index is not None:
            self.entries[index] = (parameter, self.entries[index][1] + local)
            return
        self.index[id(parameter)] = len(self.entries)
        self.entries.append((parameter, local))
        self.nbytes += local.numel() * local.element_size()

    def launch(self, riders=()):
        """Flattens the bucket, with the local values of `riders` (`_Rider`)
        after the gradients, and starts reducing it over its first axis."""
        self.riders = riders
        self.flat = torch.cat(
            [entry[-1].reshape(-1) for entry in self.entries]
            + [rider.local.reshape(-1) for rider in riders]
        )
        # Keep only the shapes: the unreduced gradients can be freed.
        self.entries = [
            (parameter, local.shape) for parameter, local in self.entries
        ]
        self.index = None
        self.work = dist.all_reduce(
            self.flat,
            op=_REDUCE_OPS[self.reduce_op],
            group=self.mesh.get_group(self.partial_dims[0]),
            async_op=True,
        )

    def abandon(self):
        """Waits for the reduction of a backward pass that raised, whose
        result is not read: gloo reads and writes `flat` until then. A
        failed wait (a process gone) leaves the step's own error to be
        raised."""
        try:
            self.work.wait()
        except RuntimeError:
            pass

    def finish(self, assigned):
        """Waits for the reduction and hands each parameter its gradient.

        A parameter in `assigned` (the ids of those given a gradient by an
        earlier bucket of this backward pass) has this one added to it.
        """
        self.work.wait()
        for mesh_dim in self.partial_dims[1:]:
            dist.all_reduce(
                self.flat,
                op=_REDUCE_OPS[self.reduce_op],
                group=self.mesh.get_group(mesh_dim),
            )
        if self.reduce_op == "avg":
            self.flat /= _group_size(self.mesh, self.partial_dims)
        offset = self.flat.storage_offset()
        for parameter, local_shape in self.entries:
            # One `as_strided` costs a third of a slice and a `view`.
            local = self.flat.as_strided(
                local_shape, _contiguous_strides(local_shape), offset
            )
            offset += local_shape.numel()
            if id(parameter) in assigned:
                parameter.grad._local_tensor.add_(local)
                continue
            if parameter.grad is not None:
                local = _accumulated(parameter, local)
            parameter.grad = _like_parameter(local, parameter)
            assigned.add(id(parameter))
        for rider in self.riders:
            numel = rider.local.numel()
            rider.finish(self.flat.as_strided((numel,), (1,), offset))
            offset += numel


class _PendingReduction:
    """The buckets of the backward pass in progress, and the riders
    (`reduced_with_gradients`) waiting for its last buckets."""

    def __init__(self):
        self.open = {}
        self.launched = []
        self.finalizer_queued = False
        self.cap_bytes = None
        self.riders = []


class _Rider:
    """A partial DTensor that may be reduced in a bucket of gradients.

    Its local tensor joins the bucket of gradients partial over the same
    mesh axes, on the same mesh, of its dtype, sent when backward ends;
    `value()` is then its reduced value, replicated, else the DTensor as
    it was given.
    """

    def __init__(self, value, key, divisor):
        self.value_given = value
        self.local = None if key is None else value._local_tensor.detach()
        self.key = key
        self.divisor = divisor
        self.reduced = None

    def finish(self, summed):
        """Keeps the reduced value, from its sum over the processes."""
        if self.divisor > 1:
            summed = summed / self.divisor
        self.reduced = dtensor_layouts.replicated_like(
            summed.view(self.local.shape), self.value_given._spec
        )

    def value(self):
        """The reduced value if a bucket carried it, else the value."""
        if self.reduced is None:
            return self.value_given
        return self.reduced


_PENDING = _PendingReduction()

# Attribute of a parameter: (its spec, the spec its reduced gradients
# copy).
_GRADIENT_SPEC_ATTRIBUTE = "_keras_reduced_gradient_spec"

# Attribute of a parameter: (its spec, the placements of its local views'
# gradients, their reduction, their bucket key).
_LOCAL_REDUCTION_ATTRIBUTE = "_keras_local_gradient_reduction"

# (mesh shape, gradient placements, parameter placements) -> the result of
# `_partial_sum_reduction`.
_REDUCTIONS = {}


def reduce_gradient_when_ready(parameter):
    """Post-accumulate-grad hook of a distributed parameter.

    Args:
        parameter: a `torch.nn.Parameter` holding a DTensor, whose `grad`
            was just accumulated.
    """
    grad = parameter.grad
    if not isinstance(grad, DTensor):
        return
    plan = _reduction_plan(parameter, grad)
    if plan is None:
        return
    reduction, key = plan
    if reduction is not None and not reduction[0]:
        parameter.grad = _like_parameter(
            grad._local_tensor.contiguous(), parameter
        )
        return
    if reduction is None or not _queue_finalizer():
        parameter.grad = _redistribute_gradient(grad, parameter)
        return
    # Backward hooks run without gradient tracking: the local tensor is
    # read directly (`to_local` would add an autograd node).
    _add(parameter, grad._local_tensor, reduction, key)


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
        done
        nothing, when the view is not of a parameter whose gradients the
        buckets reduce, when backward does not accumulate into it (as in
        `torch.autograd.grad`) or builds a graph, or when the gradient
        needs more than an all-reduce: the caller then hands autograd the
        gradient as a DTensor.
    """
    if type(node) is not _ACCUMULATE_GRAD or torch.is_grad_enabled():
        return False
    parameter = node.variable
    if not _reduced_by_buckets(parameter):
        return False
    try:
        if not torch._C._will_engine_execute_node(node):
            return False
    except RuntimeError:
        # `torch.autograd.grad` does not accumulate into leaves.
        return False
    kept = _local_reduction_plan(parameter, placements, local)
    reduction = kept[2]
    if reduction is None:
        return False
    if not reduction[0]:
        # The batch axes hold one process each: the partial sum is whole.
        parameter.grad = _like_parameter(
            _accumulated(parameter, local.contiguous()), parameter
        )
        return True
    if not (_PENDING.finalizer_queued or _queue_finalizer()):
        return False
    _add(parameter, local, reduction, kept[3])
    return True


def gradient_leaf(parameter, placements, local):
    """A leaf tensor on `local`'s storage whose gradients join the buckets.

    The local view a layer reads a parameter through in a step whose
    backward pass accumulates into the parameters (`loss.backward()`, as
    Keras's train step calls it): each gradient autograd accumulates into
    the leaf is taken out at once and joins its bucket, as a local view's
    (`reduce_local_gradient`) does. Autograd runs a leaf's accumulation as
    soon as its gradient is complete, as it runs DDP's hooks, so buckets
    are sent while backward goes on; a view made by an autograd function
    runs in the order it was made, and one kept from an earlier step would
    run last. The leaf shares `local`'s storage and version counter, so it
    sees the optimizer's in-place updates.

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
    if not _reduced_by_buckets(parameter):
        return None
    kept = _local_reduction_plan(parameter, placements, local)
    reduction = kept[2]
    if reduction is None or not reduction[0]:
        return None
    leaf = local.detach().requires_grad_()
    leaf.register_post_accumulate_grad_hook(
        functools.partial(_bucket_leaf_gradient, parameter, reduction, kept[3])
    )
    return leaf


def _reduced_by_buckets(parameter):
    """Whether the parameter's gradients go through the buckets: it has
    `reduce_gradient_when_ready` as a post-accumulate-grad hook."""
    hooks = parameter._post_accumulate_grad_hooks
    return hooks is not None and reduce_gradient_when_ready in hooks.values()


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
    _queue_finalizer()
    _add(parameter, grad, reduction, key)


def _local_reduction_plan(parameter, placements, local):
    """`(spec, placements, reduction, bucket key)` of a local view's
    gradient, kept on the parameter.

    Planned once per parameter spec and gradient placements.
    """
    kept = getattr(parameter, _LOCAL_REDUCTION_ATTRIBUTE, None)
    if (
        kept is not None
        and kept[0] is parameter._spec
        and kept[1] is placements
    ):
        return kept
    spec = parameter._spec
    reduction = _cached_reduction(spec.mesh, placements, spec.placements)
    kept = (
        spec,
        placements,
        reduction,
        _bucket_key(spec.mesh, reduction, local.dtype),
    )
    setattr(parameter, _LOCAL_REDUCTION_ATTRIBUTE, kept)
    return kept


_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad


def _bucket_key(mesh, reduction, dtype):
    """The key of the bucket of gradients of this mesh, partial-sum
    reduction and dtype: `(mesh, (id(mesh), reduction, dtype))`.

    Buckets are looked up by the second part, which hashes without Python
    code (a `DeviceMesh` hashes in Python).
    """
    return (mesh, (id(mesh), reduction, dtype))


def _add(parameter, local, reduction, key):
    """Adds a local gradient to its open bucket; sends the bucket if full."""
    mesh, key = key
    bucket = _PENDING.open.get(key)
    if bucket is None:
        bucket = _Bucket(mesh, *reduction)
        _PENDING.open[key] = bucket
    bucket.add(parameter, local)
    if _PENDING.cap_bytes is None:
        _PENDING.cap_bytes = _bucket_cap_bytes(mesh)
    if bucket.nbytes >= _PENDING.cap_bytes:
        _launch(key)


def _reduction_plan(parameter, grad):
    """How the gradient reaches its parameter's placements.

    Returns None if it has them already, else `(reduction, bucket key)`:
    the `_partial_sum_reduction` and the key of the bucket it joins.
    Gradients that need the same all-reduce share a bucket whatever their
    placements on the other mesh axes: on a ("batch", "model") mesh, a
    column-sharded and a replicated kernel are reduced together over
    "batch" (processes of one "batch" group hold shards of equal shapes).
    """
    target = parameter._spec.placements
    if grad._spec.placements == target:
        return None
    mesh = grad._spec.mesh
    reduction = _cached_reduction(mesh, grad._spec.placements, target)
    return reduction, _bucket_key(mesh, reduction, grad.dtype)


def _cached_reduction(mesh, current, placements):
    """`_partial_sum_reduction`, computed once per mesh shape and placements."""
    key = (mesh.shape, current, placements)
    if key not in _REDUCTIONS:
        _REDUCTIONS[key] = _partial_sum_reduction(mesh, current, placements)
    return _REDUCTIONS[key]


def _partial_sum_reduction(mesh, current_placements, placements):
    """Returns `(partial mesh dims, reduce op)` if an all-reduce suffices.

    That is the case when, on every mesh axis, the gradient's placement is
    its parameter's, or a partial sum where the parameter is replicated.
    Mesh axes of size 1 need no communication whatever the placements; when
    only those differ, the partial mesh dims are empty. Returns None when an
    all-reduce does not suffice.
    """
    partial_dims = []
    reduce_ops = set()
    for mesh_dim, (current, target) in enumerate(
        zip(current_placements, placements)
    ):
        if current == target or _mesh_dim_size(mesh, mesh_dim) == 1:
            continue
        if type(current) is not Partial or not isinstance(target, Replicate):
            return None
        partial_dims.append(mesh_dim)
        reduce_ops.add(current.reduce_op)
    if not partial_dims:
        return (), None
    if len(reduce_ops) != 1:
        return None
    (reduce_op,) = reduce_ops
    if reduce_op not in _REDUCE_OPS:
        return None
    return tuple(partial_dims), reduce_op


@contextlib.contextmanager
def reduced_with_gradients(value):
    """Has the buckets sent when backward ends reduce `value` too.

    `value` rides along when it is a DTensor partial (`Partial("sum")` or
    `Partial("avg")`) over some mesh axes and replicated over the others,
    and a backward pass run inside the block sends, when it ends, a bucket
    of gradients partial over the same axes with the same dtype: the
    sum's one all-reduce then reduces it too, where it would need one of
    its own. Otherwise nothing happens. Whether it rides depends only on
    placements, dtypes and the order of the program, the same on every
    process.

    Args:
        value: the value, e.g. the train step's loss.

    Yields:
        A `_Rider`, whose `value()` after the block is the value reduced
        by the buckets (a replicated DTensor), or `value` itself if no
        bucket carried it.
    """
    rider = _rider(value)
    if rider.key is not None:
        _PENDING.riders.append(rider)
    try:
        yield rider
    finally:
        if rider in _PENDING.riders:
            _PENDING.riders.remove(rider)


def _rider(value):
    """The `_Rider` of `value`, with no bucket key unless it may ride."""
    if type(value) is not DTensor:
        return _Rider(value, None, 1)
    spec = value._spec
    reduction = dtensor_layouts.additive_partial_dims(spec)
    if reduction is None:
        return _Rider(value, None, 1)
    partial, averaged = reduction
    partial = tuple(d for d in partial if _mesh_dim_size(spec.mesh, d) > 1)
    if not partial:
        return _Rider(value, None, 1)
    divisor = math.prod(_mesh_dim_size(spec.mesh, d) for d in averaged)
    key = _bucket_key(spec.mesh, (partial, "sum"), spec.tensor_meta.dtype)[1]
    return _Rider(value, key, divisor)


def _queue_finalizer():
    """Arranges for `_finish_backward` to run when backward ends.

    Returns False when no backward pass is running (the gradient was then
    not produced by the autograd engine), in which case nothing is queued.
    """
    if _PENDING.finalizer_queued:
        return True
    try:
        torch.autograd.Variable._execution_engine.queue_callback(
            _finish_backward
        )
    except RuntimeError:
        return False
    _PENDING.finalizer_queued = True
    return True


def _launch(key):
    bucket = _PENDING.open.pop(key)
    bucket.launch()
    _PENDING.launched.append(bucket)
    _PENDING.cap_bytes = _bucket_cap_bytes(bucket.mesh)


def _finish_backward():
    """Sends the remaining buckets and installs every reduced gradient."""
    global _PENDING

    pending = _PENDING
    _PENDING = _PendingReduction()
    assigned = set()
    with torch.no_grad():
        for key, bucket in pending.open.items():
            bucket.launch(
                [rider for rider in pending.riders if rider.key == key]
            )
            pending.launched.append(bucket)
        for bucket in pending.launched:
            bucket.finish(assigned)


def discard_pending():
    """Drops the buckets of a backward pass that raised.

    Autograd runs `_finish_backward` only when backward completes. After a
    backward pass that raised, its buckets, and the mark that the
    finalizer is queued, would be taken for the next backward pass's:
    that pass would queue no finalizer, so its gradients would never
    reach the parameters, and the stale gradients would join its buckets.
    A step that raises calls this (`DistributedStepFunction`).
    Collectives the failed pass sent are waited for, and their results
    dropped.
    """
    global _PENDING

    pending, _PENDING = _PENDING, _PendingReduction()
    for bucket in pending.launched:
        bucket.abandon()


def _accumulated(parameter, local):
    """The local part of the parameter's gradient once its reduced
    `local` gradient is in.

    A gradient the parameter holds from an earlier backward pass (not
    reset since) is laid out like it, and `local` is added to it, as
    autograd accumulates. A partial gradient it holds is this pass's, and
    is in `local` already: it is replaced.
    """
    grad = parameter.grad
    if (
        isinstance(grad, DTensor)
        and grad._spec.placements == parameter._spec.placements
    ):
        return grad._local_tensor + local
    return local


def _like_parameter(local, parameter):
    """A DTensor of `local` (contiguous) laid out as `parameter`.

    The gradient of a parameter has the parameter's mesh, placements,
    global shape and dtype; its spec is a copy (DTensors do not share
    specs) of the parameter's, or of one with contiguous strides where the
    parameter's are not. The spec copied is kept on the parameter.
    """
    kept = getattr(parameter, _GRADIENT_SPEC_ATTRIBUTE, None)
    if kept is None or kept[0] is not parameter._spec:
        kept = (parameter._spec, _contiguous_spec(parameter._spec))
        setattr(parameter, _GRADIENT_SPEC_ATTRIBUTE, kept)
    return dtensor_layouts.dtensor_from_spec(
        local, dtensor_layouts.copy_spec(kept[1])
    )


def _contiguous_strides(shape):
    """The strides of a contiguous tensor of `shape`, computed once per
    shape."""
    strides = _STRIDES.get(shape)
    if strides is None:
        strides = dtensor_layouts.contiguous_strides(shape)
        _STRIDES[shape] = strides
    return strides


# torch.Size -> its contiguous strides.
_STRIDES = {}


def _contiguous_spec(spec):
    """`spec`, or a copy of it with contiguous global strides."""
    meta = spec.tensor_meta
    strides = dtensor_layouts.contiguous_strides(meta.shape)
    if meta.stride == strides:
        return spec
    return DTensorSpec(
        spec.mesh,
        spec.placements,
        tensor_meta=TensorMeta(meta.shape, strides, meta.dtype),
    )


def _redistribute_gradient(grad, parameter):
    """Redistributes one gradient to its parameter's placements.

    A shard cut out of a larger buffer is copied, so that the full buffer
    is not kept alive by the gradient.
    """
    grad = grad.redistribute(parameter.device_mesh, parameter.placements)
    local = grad.to_local()
    if local.untyped_storage().nbytes() > local.numel() * local.element_size():
        grad = dtensor_layouts.rewrapped(grad, local.clone())
    return grad


def _bucket_cap_bytes(mesh):
    """The size at which a bucket of gradients on `mesh` is sent.

    `KERAS_DTENSOR_BUCKET_CAP_MB`, or less for the first bucket of a
    backward pass (`_first_bucket_cap_bytes`).
    """
    cap = _megabytes(BUCKET_CAP_ENV_VAR, DEFAULT_BUCKET_CAP_MB)
    if not _PENDING.launched:
        return min(cap, _first_bucket_cap_bytes(mesh))
    return cap


def _first_bucket_cap_bytes(mesh):
    """The size at which the first bucket of a backward pass is sent.

    `KERAS_DTENSOR_FIRST_BUCKET_CAP_MB` where set. Otherwise 1 MiB, as
    DDP's, so that communication starts early in backward, except on a
    CPU mesh: there gloo's all-reduce runs on the cores backward is
    using, and a bucket sent early only competes with it (measured with 2
    and 4 gloo processes on 2 cores: 1.8 to 5.3 ms a step slower than one
    bucket sent at the end). The rule depends only on the mesh, which is
    the same on every process, so every process makes the same buckets.
    """
    if os.environ.get(FIRST_BUCKET_CAP_ENV_VAR):
        return _megabytes(FIRST_BUCKET_CAP_ENV_VAR, 0)
    if mesh.device_type == "cpu":
        return float("inf")
    return FIRST_BUCKET_CAP_BYTES


def _megabytes(env_var, default):
    """The size in bytes that `env_var` gives in MB (`default` if unset)."""
    return int(float(os.environ.get(env_var, default)) * 2**20)


def _mesh_dim_size(mesh, mesh_dim):
    return mesh.size(mesh_dim)


def _group_size(mesh, mesh_dims):
    size = 1
    for mesh_dim in mesh_dims:
        size *= mesh.size(mesh_dim)
    return size
