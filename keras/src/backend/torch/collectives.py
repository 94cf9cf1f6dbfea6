"""Collectives for Keras code on the torch backend.

`all_reduce` and `all_gather` combine the per-process values of a tensor,
array or variable across processes (or along one mesh axis of the current
distribution). Every process of the group must call them, in the same
order; a process that does not makes the others fail after
`KERAS_DTENSOR_TIMEOUT_SECONDS`.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from keras.src.backend.torch import process_group


def all_reduce(x, op="sum", axis_name=None):
    """Reduces the per-process values of `x` across processes.

    Args:
        x: a tensor, array or `Variable` holding this process's value. A
            DTensor stands for its global value, which is returned in full.
        op: `"sum"`, `"mean"`, `"max"` or `"min"`.
        axis_name: optional mesh axis of the current distribution; the
            reduction then runs only among processes along that axis.

    Returns:
        A plain tensor, identical on the participating processes.
    """
    reduce_ops = {
        "sum": dist.ReduceOp.SUM,
        "mean": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }
    if op not in reduce_ops:
        raise ValueError(
            f"Unsupported reduction op={op}. Expected one of "
            f"{sorted(reduce_ops)}."
        )
    value = _local_value(x)
    if isinstance(value, DTensor):
        return value.full_tensor()
    value = value.clone()
    if process_group.num_processes() == 1:
        return value
    group = _axis_group(axis_name)
    dist.all_reduce(value, op=reduce_ops[op], group=group)
    if op == "mean":
        value = value / dist.get_world_size(group)
    return value


def all_gather(x, axis=0, axis_name=None):
    """Concatenates the per-process values of `x` along `axis`.

    Args:
        x: a tensor, array or `Variable` holding this process's value. A
            DTensor stands for its global value, which is returned in full.
        axis: the tensor axis to concatenate on.
        axis_name: optional mesh axis of the current distribution; only the
            processes along that axis take part.

    Returns:
        A plain tensor, identical on the participating processes.
    """
    value = _local_value(x)
    if isinstance(value, DTensor):
        return value.full_tensor()
    if process_group.num_processes() == 1:
        return value.clone()
    group = _axis_group(axis_name)
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, value.contiguous(), group=group)
    return torch.cat(parts, dim=axis)


def _local_value(x):
    """This process's value of `x` (a variable, tensor or array)."""
    from keras.src.backend.torch.core import convert_to_tensor

    if hasattr(x, "value") and not isinstance(x, torch.Tensor):
        x = x.value
    if isinstance(x, DTensor):
        return x.detach()
    return convert_to_tensor(x).detach()


def _axis_group(axis_name):
    """The process group of a mesh axis of the current distribution."""
    if axis_name is None:
        return None
    from keras.src.distribution import distribution_lib

    distribution = distribution_lib.distribution()
    if distribution is None:
        raise ValueError(
            f"axis_name={axis_name!r} needs a distribution to be set."
        )
    mesh = distribution.device_mesh.backend_mesh
    return mesh.get_group(axis_name)
