"""Backward's CPU time: the gradient buckets against torch's C++ Reducer.

Would DDP's C++ reducer take the buckets' per-gradient Python out of a
DataParallel backward? This measures it apart from Keras: one gradient
leaf per trainable variable of a benchmark model (shapes from
`keras_models`), summed into a loss with fixed weights, and three
backward passes timed in the main thread's CPU time (the gloo work runs
on threads of its own):

- `buckets`: the leaves of `local_gradients.gradient_leaf`, as a Keras
  train step reads replicated variables, reduced by the buckets, each
  parameter getting its reduced gradient as a DTensor;
- `reducer`: persistent leaves reduced by torch's `Reducer` (the one DDP
  runs, built on the same buckets, with a Python communication hook that
  all-reduces each bucket's sum, since the built-in hook averages), each
  parameter getting its reduced gradient as a DTensor as above;
- `none`: plain leaves, no reduction.

The reduced gradients of `buckets` and `reducer` are checked equal, bit
for bit. Rank 0 prints the medians and each reduction's cost over
`none`.

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 \\
        benchmarks/reducer_backward.py --workload transformer --steps 200
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras_models  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import workloads  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Partial  # noqa: E402
from torch.distributed.tensor import Replicate  # noqa: E402
from torch.distributed.tensor import distribute_tensor  # noqa: E402

from keras.src.backend.torch import local_gradients  # noqa: E402
from keras.src.backend.torch import reducer as bucket_reducer  # noqa: E402


def parameter_shapes(workload):
    """The shapes of a benchmark model's trainable variables."""
    model = keras_models.build_model(workload, workloads.Config())
    return [tuple(v.shape) for v in model.trainable_variables]


def bucketed_parameters(shapes, mesh):
    """Replicated DTensor parameters whose gradients the buckets reduce."""
    parameters = []
    for shape in shapes:
        parameter = torch.nn.Parameter(
            distribute_tensor(torch.randn(shape), mesh, [Replicate()])
        )
        parameter.register_post_accumulate_grad_hook(
            bucket_reducer.reduce_gradient_when_ready
        )
        parameters.append(parameter)
    return parameters


def bucket_indices(leaves):
    """DDP's bucket assignment: in reverse order, a 1 MiB first bucket."""
    buckets, current, size = [], [], 0
    cap = bucket_reducer.FIRST_BUCKET_CAP_BYTES
    for index in reversed(range(len(leaves))):
        current.append(index)
        size += leaves[index].numel() * leaves[index].element_size()
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
            cap = bucket_reducer.DEFAULT_BUCKET_CAP_MB * 2**20
    if current:
        buckets.append(current)
    return buckets


def summed_buckets(group, bucket):
    """A communication hook: the sum of the bucket over the processes."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def make_reducer(leaves, group):
    buckets = bucket_indices(leaves)
    caps = [bucket_reducer.FIRST_BUCKET_CAP_BYTES] + [
        bucket_reducer.DEFAULT_BUCKET_CAP_MB * 2**20
    ] * (len(buckets) - 1)
    reducer = dist.Reducer(
        leaves,
        buckets,
        caps,
        group,
        [False] * len(leaves),
        bucket_reducer.DEFAULT_BUCKET_CAP_MB * 2**20,
        False,
        True,
    )
    dist._register_comm_hook(reducer, group, summed_buckets)
    return reducer


def timed_backward(loss):
    """The main thread's CPU time of `loss.backward()`, in seconds."""
    start = time.thread_time()
    loss.backward()
    return time.thread_time() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="transformer")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shapes = parameter_shapes(args.workload)
    torch.manual_seed(0)
    weights = [torch.randn(shape) for shape in shapes]

    def loss_of(leaves):
        return sum((leaf * w).sum() for leaf, w in zip(leaves, weights))

    bucketed = bucketed_parameters(shapes, mesh)
    bucket_leaves = [
        local_gradients.gradient_leaf(p, (Partial(),), p._local_tensor)
        for p in bucketed
    ]
    reduced = bucketed_parameters(shapes, mesh)
    reducer_leaves = [
        p._local_tensor.detach().requires_grad_() for p in reduced
    ]
    reducer = make_reducer(reducer_leaves, mesh.get_group(0))
    plain_leaves = [torch.randn(shape, requires_grad=True) for shape in shapes]

    def buckets_step():
        for parameter in bucketed:
            parameter.grad = None
        return timed_backward(loss_of(bucket_leaves))

    def reducer_step():
        for parameter in reduced:
            parameter.grad = None
        for leaf in reducer_leaves:
            if leaf.grad is not None:
                leaf.grad.zero_()
        loss = loss_of(reducer_leaves)
        start = time.thread_time()
        reducer.prepare_for_backward([])
        loss.backward()
        for parameter, leaf in zip(reduced, reducer_leaves):
            parameter.grad = bucket_reducer.context().layouts.like_parameter(
                leaf.grad, parameter
            )
        return time.thread_time() - start

    def plain_step():
        for leaf in plain_leaves:
            leaf.grad = None
        return timed_backward(loss_of(plain_leaves))

    steps = {"buckets": buckets_step, "reducer": reducer_step}
    steps["none"] = plain_step
    for _ in range(5):
        for step in steps.values():
            step()
    times = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            dist.barrier()
            times[name].append(step())
    for a, b in zip(bucketed, reduced):
        if not torch.equal(a.grad._local_tensor, b.grad._local_tensor):
            raise AssertionError("the two reductions disagree")
    if dist.get_rank() == 0:
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(
            f"{args.workload}, {len(shapes)} gradients, "
            f"{dist.get_world_size()} processes, median of {args.steps} "
            "backward passes, main-thread CPU ms: "
            + ", ".join(f"{name} {value:.3f}" for name, value in ms.items())
            + f"; over none: buckets +{ms['buckets'] - ms['none']:.3f}, "
            f"reducer +{ms['reducer'] - ms['none']:.3f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
