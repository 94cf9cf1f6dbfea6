"""The reducer of each backward pass: DDP's `Reducer` for DTensors.

A replicated parameter used with batch-sharded inputs receives its
gradient as a DTensor partial over the data-parallel mesh axes. The
reducer brings such gradients to their parameter's placements as DDP's
does: as each gradient is accumulated (`reduce_gradient_when_ready`, the
parameter's post-accumulate-grad hook), it joins the open bucket of
gradients that need the same all-reduce (`bucket_assignment`); a full
bucket is launched (`gradient_bucket`) while backward goes on; when
backward ends (`_finish_backward`, queued on the autograd engine), the
open buckets are launched and every bucket is finished: each gradient
becomes a view of its reduced bucket, laid out like its parameter. Each
gradient is reduced exactly once per step, and the optimizer never meets
a partial gradient. Gradients split along a mesh axis where their
parameter is whole wait in a bucket of their own and are gathered
together when backward ends (`gather_bucket`); any other that needs more
than an all-reduce of partial sums is redistributed by DTensor directly.

Collective order: buckets are filled in the order the autograd engine
accumulates gradients, the same on every process since every process
runs the same program; collectives are issued in the same order
everywhere.

State: a `Reducer` holds one backward pass's buckets, launched and open
(and gathering), the riders waiting for its last buckets
(`bucket_riders`) and whether its finalizer is queued. The process's
`ReducerContext` holds the reducer of the backward pass in progress (or
of the next one) and the plans and layouts kept across passes. A
backward pass that raised runs no finalizer: a step that raises calls
`discard_pending`, which waits for the buckets it launched and drops
them, so no collective of a step outlives it.
"""

import os

import torch
from torch.distributed.tensor import DTensor

from keras.src.backend.torch import bucket_assignment
from keras.src.backend.torch import gather_bucket
from keras.src.backend.torch import gradient_bucket
from keras.src.backend.torch import parameter_gradients
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import torch_runtime

BUCKET_CAP_ENV_VAR = "KERAS_DTENSOR_BUCKET_CAP_MB"
DEFAULT_BUCKET_CAP_MB = 25
FIRST_BUCKET_CAP_ENV_VAR = "KERAS_DTENSOR_FIRST_BUCKET_CAP_MB"
# As in DDP, the first bucket is small so that communication starts early,
# where it runs beside the computation (`first_bucket_cap_bytes`).
FIRST_BUCKET_CAP_BYTES = 2**20


class Reducer:
    """The buckets of one backward pass.

    Args:
        layouts: the `parameter_gradients.GradientLayouts` its buckets lay
            reduced gradients out with.
    """

    def __init__(self, layouts):
        self.layouts = layouts
        # Bucket key (`bucket_assignment.bucket_key`'s second part) -> the
        # open `gradient_bucket.Bucket`.
        self.open = {}
        # Buckets launched, in launch order (which is finishing order).
        self.launched = []
        self.finalizer_queued = False
        # The size at which the next bucket is launched; None until the
        # first gradient's mesh is known.
        self.cap_bytes = None
        # `bucket_riders.Rider`s waiting for the buckets launched when
        # backward ends.
        self.riders = []
        # (id(mesh), mesh axis, dtype) -> the `gather_bucket.GatherBucket`
        # of gradients gathered over that axis when backward ends.
        self.gathers = {}

    def add(self, parameter, local, reduction, key):
        """Adds a local gradient to its open bucket; launches the bucket
        if full."""
        mesh, key = key
        bucket = self.open.get(key)
        if bucket is None:
            bucket = gradient_bucket.Bucket(mesh, *reduction, self.layouts)
            self.open[key] = bucket
        bucket.add(parameter, local)
        if self.cap_bytes is None:
            self.cap_bytes = bucket_cap_bytes(mesh, not self.launched)
        if bucket.nbytes >= self.cap_bytes:
            self._launch(key)

    def gather(self, parameter, local, mesh, gathered):
        """Adds a local gradient to the bucket of gradients gathered over
        its mesh axis (`gathered`: the axis and the split dimension)."""
        axis, dim = gathered
        key = (id(mesh), axis, local.dtype)
        bucket = self.gathers.get(key)
        if bucket is None:
            bucket = gather_bucket.GatherBucket(mesh, axis, self.layouts)
            self.gathers[key] = bucket
        bucket.add(parameter, local, dim)

    def _launch(self, key):
        bucket = self.open.pop(key)
        bucket.launch()
        self.launched.append(bucket)
        self.cap_bytes = bucket_cap_bytes(bucket.mesh, not self.launched)

    def queue_finalizer(self):
        """Arranges for `_finish_backward` to run when backward ends.

        Returns False when no backward pass is running (the gradient was
        then not produced by the autograd engine), in which case nothing
        is queued.
        """
        if self.finalizer_queued:
            return True
        try:
            # Looked up at each call, so that a test may watch it.
            torch_runtime.queue_engine_callback(_finish_backward)
        except RuntimeError:
            return False
        self.finalizer_queued = True
        return True

    def finish(self):
        """Launches the open buckets, with their riders, and installs
        every reduced gradient."""
        assigned = set()
        with torch.no_grad():
            for key, bucket in self.open.items():
                bucket.launch(
                    [rider for rider in self.riders if rider.key == key]
                )
                self.launched.append(bucket)
            for bucket in self.gathers.values():
                bucket.launch()
                self.launched.append(bucket)
            for bucket in self.launched:
                bucket.finish(assigned)

    def discard(self):
        """Waits for the launched buckets, whose results are dropped."""
        for bucket in self.launched:
            bucket.abandon()


class ReducerContext:
    """What the reducer's hooks reach in this process: the `Reducer` of
    the backward pass in progress (or of the next one), and the
    `BucketAssignment` and `GradientLayouts` kept across passes."""

    def __init__(self):
        self.assignment = bucket_assignment.BucketAssignment()
        self.layouts = parameter_gradients.GradientLayouts()
        self.reducer = Reducer(self.layouts)

    def take(self):
        """The current reducer, replaced by a new one for the next pass."""
        reducer = self.reducer
        self.reducer = Reducer(self.layouts)
        return reducer


# One per process, not per thread: autograd runs the hooks of a CUDA
# parameter, and the finalizer it queued, on its device's worker thread,
# not on the thread that called backward (on CPU it is that thread), so
# the thread that enters `reduced_with_gradients` or `discard_pending`
# and the ones running the hooks must reach the same reducer. A process
# runs one backward pass through the buckets at a time.
_CONTEXT = ReducerContext()


def context():
    """The process's `ReducerContext`."""
    return _CONTEXT


def current():
    """The `Reducer` of the backward pass in progress, or of the next."""
    return _CONTEXT.reducer


def reduce_gradient_when_ready(parameter):
    """Post-accumulate-grad hook of a distributed parameter.

    Args:
        parameter: a `torch.nn.Parameter` holding a DTensor, whose `grad`
            was just accumulated.
    """
    grad = parameter.grad
    if not isinstance(grad, DTensor):
        return
    state = _CONTEXT
    plan = state.assignment.gradient_plan(parameter, grad)
    if plan is None:
        return
    reduction, key = plan
    if reduction is not None and not reduction[0]:
        # The partial axes hold one process each: the partial sum is
        # whole, handed over as the same local tensor without a bucket.
        parameter.grad = state.layouts.like_parameter(
            torch_internals.local_tensor(grad).contiguous(), parameter
        )
        return
    pending = state.reducer
    # Backward hooks run without gradient tracking: the local tensor is
    # read directly (`to_local` would add an autograd node).
    if reduction is not None:
        if pending.queue_finalizer():
            pending.add(
                parameter, torch_internals.local_tensor(grad), reduction, key
            )
            return
    else:
        gathered = gather_bucket.gathered_dim(
            torch_internals.spec_of(grad), torch_internals.spec_of(parameter)
        )
        if gathered is not None and pending.queue_finalizer():
            pending.gather(
                parameter, torch_internals.local_tensor(grad), key[0], gathered
            )
            return
    parameter.grad = parameter_gradients.redistribute_gradient(grad, parameter)


def reduced_by_buckets(parameter):
    """Whether the parameter's gradients go through the buckets: it has
    `reduce_gradient_when_ready` as a post-accumulate-grad hook."""
    hooks = torch_runtime.post_accumulate_grad_hooks(parameter)
    return hooks is not None and reduce_gradient_when_ready in hooks.values()


def _finish_backward():
    """Launches the remaining buckets and installs every reduced gradient
    (queued on the autograd engine by `Reducer.queue_finalizer`)."""
    _CONTEXT.take().finish()


def discard_pending():
    """Drops the buckets of a backward pass that raised.

    Autograd runs `_finish_backward` only when backward completes. After a
    backward pass that raised, its buckets, and the mark that the
    finalizer is queued, would be taken for the next backward pass's:
    that pass would queue no finalizer, so its gradients would never
    reach the parameters, and the stale gradients would join its buckets.
    A step that raises calls this (`DistributedStepFunction`).
    Collectives the failed pass launched are waited for, and their results
    dropped.
    """
    _CONTEXT.take().discard()


def bucket_cap_bytes(mesh, first):
    """The size at which a bucket of gradients on `mesh` is launched.

    `KERAS_DTENSOR_BUCKET_CAP_MB`, or less for the first bucket of a
    backward pass (`first`, see `first_bucket_cap_bytes`).
    """
    cap = _megabytes(BUCKET_CAP_ENV_VAR, DEFAULT_BUCKET_CAP_MB)
    if first:
        return min(cap, first_bucket_cap_bytes(mesh))
    return cap


def first_bucket_cap_bytes(mesh):
    """The size at which the first bucket of a backward pass is launched.

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
