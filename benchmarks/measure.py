"""Measurements: step times, collective counts and per-rank memory.

Each measurement works the same way on a Keras model and on a native
PyTorch model: a training step is a zero-argument callable, and memory is
read from the tensors that hold parameters, gradients and optimizer state.
"""

import cProfile
import math
import pstats
import statistics
import time

import torch
import torch.distributed as dist
from torch._C._profiler import _EventType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode


def synchronize():
    """Waits for queued device work (a no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_step_peak_bytes(step):
    """Bytes in use on the GPU at the step's peak, above its start."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def cpu_peak_bytes(profiler):
    """Bytes in use at the peak of a profiled region, above its start, on
    the CPU.

    `profiler` ran with `profile_memory=True`. Every allocation it
    recorded carries the CPU allocator's total in use right after it, for
    the whole process (allocations of other threads, gloo's included,
    count too).
    """
    allocations = []
    events = list(profiler.profiler.kineto_results.experimental_event_tree())
    while events:
        event = events.pop()
        events.extend(event.children)
        if event.tag != _EventType.Allocation:
            continue
        fields = event.extra_fields
        if fields.device.type == "cpu":
            allocations.append(
                (event.start_time_ns, fields.alloc_size, fields.total_allocated)
            )
    if not allocations:
        return 0
    allocations.sort()
    _, first_size, first_total = allocations[0]
    start = first_total - first_size
    return max(total for _, _, total in allocations) - start


def barrier():
    """Lines the processes up, when there are several."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def time_steps(steps, count):
    """Times `count` calls of each step function, interleaved.

    The functions take turns step by step, so that slow phases of a shared
    machine hit all of them alike. Processes line up before each step; a
    step's time is the slowest process's.

    Args:
        steps: dict mapping a name to a zero-argument training step.
        count: number of timed calls of each function.

    Returns:
        A dict mapping each name to its list of step times in seconds.
    """
    times = {name: [] for name in steps}
    for _ in range(count):
        for name, step in steps.items():
            barrier()
            start = time.perf_counter()
            step()
            synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: slowest_rank(values) for name, values in times.items()}


def slowest_rank(values):
    """Per-index maximum of a list of floats over all processes."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def largest_over_ranks(value):
    """The largest of every process's `value` (an int)."""
    if not dist.is_initialized():
        return value
    # On the device the process group reduces on (NCCL: the GPU).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def median_ms(values):
    """Median of a list of seconds, in milliseconds."""
    return 1000.0 * statistics.median(values)


class _PhaseTracker:
    """Stands in for CommDebugMode's module tracker.

    CommDebugMode's own tracker registers module hooks that lose track on
    Keras layers (an `IndexError` in `_fw_set_module_hook`). This one only
    tells whether the autograd engine is running backward, which is all
    the forward/backward split needs.
    """

    name = "Global"
    activation_checkpointing = False
    module_parents_dict = {"Global": ("Global",)}

    @property
    def is_bw(self):
        return torch._C._current_graph_task_id() != -1

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


class CollectiveCounter(CommDebugMode):
    """`CommDebugMode` that splits counts into backward and the rest."""

    def __init__(self):
        super().__init__()
        self.advanced_module_tracker = _PhaseTracker()

    def counts(self):
        """Returns `{"forward", "backward", "total", "ops"}`.

        `forward` counts everything outside the autograd backward pass
        (forward, loss logging and optimizer step).
        """
        phases = self.comm_module_counts["Global"]
        forward = sum(phases["forward"].values())
        backward = sum(phases["backward"].values())
        ops = {}
        for op, n in self.get_comm_counts().items():
            name = str(op).rsplit(".", 1)[-1]
            ops[name] = ops.get(name, 0) + int(n)
        return {
            "forward": int(forward),
            "backward": int(backward),
            "total": int(self.get_total_counts()),
            "ops": ops,
        }


def count_collectives(step):
    """Counts the collectives of one call of `step` (see `counts`)."""
    with CollectiveCounter() as counter:
        step()
    synchronize()
    return counter.counts()


def profile_stats(step):
    """cProfile statistics (`pstats.Stats`) of one call of `step`."""
    profile = cProfile.Profile()
    profile.enable()
    try:
        step()
    finally:
        profile.disable()
    return pstats.Stats(profile)


def python_calls(step):
    """Python function calls made by one call of `step` (deterministic).

    Unlike a time, this count does not depend on the machine's load, so it
    shows framework overhead even on a busy machine.
    """
    stats = profile_stats(step)
    synchronize()
    return int(stats.total_calls)


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_bytes(tensors):
    """Bytes of the distinct storages holding this rank's part of tensors.

    A DTensor counts with its local shard; storages shared by several
    tensors count once.
    """
    seen = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = _local(tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def layout_limit_bytes(parameters):
    """The sharding limit for tensors laid out like `parameters`.

    Each tensor costs its full size divided by the number of processes it
    is sharded over: sharded total / N plus the replicated part.
    """
    total = 0.0
    for parameter in parameters:
        full = parameter.numel() * parameter.element_size()
        shards = 1
        if isinstance(parameter, DTensor):
            mesh = parameter.device_mesh
            for dim, placement in enumerate(parameter.placements):
                if placement.is_shard():
                    shards *= mesh.size(dim)
        total += full / shards
    return int(total)


def memory_report(parameters, gradients, optimizer_state, limit, buffers=0):
    """Per-rank bytes of parameters, gradients and optimizer state.

    Args:
        parameters: the trainable parameters (tensors or DTensors).
        gradients: their gradients after a training step.
        optimizer_state: the optimizer's state tensors.
        limit: the per-rank bytes the mode's layout needs at least
            (`workloads.memory_limit_bytes`).
        buffers: bytes of other buffers that training keeps, such as DDP's
            gradient buckets.

    Returns:
        A dict with measured `params`, `grads`, `optimizer`, `buffers` and
        `total` bytes, the `limit`, and `ratio` = total / limit. Values are
        the maximum over processes.
    """
    measured = [
        storage_bytes(list(parameters)),
        storage_bytes(gradients),
        storage_bytes(optimizer_state),
        buffers,
    ]
    measured = slowest_rank(measured)
    params, grads, optimizer, buffers = (int(v) for v in measured)
    total = params + grads + optimizer + buffers
    return {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "buffers": buffers,
        "total": total,
        "limit": int(limit),
        "ratio": total / limit if limit else math.nan,
    }
