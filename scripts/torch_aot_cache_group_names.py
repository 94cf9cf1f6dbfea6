"""Reproduces torch's AOT autograd cache serving stale process groups.

AOT autograd keys its cache entry of a compiled graph on the Dynamo graph
and its inputs. For a DTensor input the key holds the device mesh's ranks,
layout and dim names (`DeviceMesh._stable_hash`), but neither the names of
the mesh's process groups, which the collectives of the lowered graph
hard-code, nor the rank. So every rank computes the same key for graphs
that differ (each names its own groups), the entry saved last is served
to all of them, and a process that creates its groups in another order
reads names that now stand for other groups.

Run it against one cache folder (4 gloo processes, CPU):

    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    torchrun --nproc_per_node=4 scripts/torch_aot_cache_group_names.py plain
    torchrun --nproc_per_node=4 scripts/torch_aot_cache_group_names.py plain
    torchrun --nproc_per_node=4 scripts/torch_aot_cache_group_names.py shifted

With torch 2.13.0 the first run prints 56.0 on every rank. The second,
the same command, fails on two ranks ("Could not resolve the process
group registered under the name 4": the entry of a rank in the other
group of that mesh axis). The third, which creates two groups before its
mesh, prints wrong sums on some ranks (24.0 or 88.0, depending on which
rank's graph the entry holds) and fails on the others. With
`TORCHINDUCTOR_AUTOGRAD_CACHE=0`, every run prints 56.0 everywhere
(inductor's own cache is keyed on the lowered graph, group names
included). `keras/src/backend/torch/compile_cache_keys.py` adds the rank
and the process groups to the key (`ProcessGroupCacheKey`).
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor


def main(mode):
    dist.init_process_group("gloo")
    if mode == "shifted":
        # These take the names the mesh's groups had in the first run.
        dist.new_group(list(range(dist.get_world_size())))
        dist.new_group(list(range(dist.get_world_size())))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    x = distribute_tensor(torch.arange(8.0), mesh, [Replicate(), Shard(0)])

    @torch.compile(backend="inductor", fullgraph=True)
    def total(x):
        return (x * 2).sum().full_tensor()

    groups = [mesh.get_group(d).group_name for d in range(mesh.ndim)]
    print(
        f"{mode}, rank {dist.get_rank()}, mesh groups {groups}: "
        f"sum {total(x).item()} (expected {2.0 * sum(range(8))})",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
