"""Reproduces torch's compile caches missing on every run of a mesh input.

A graph that takes a `DeviceMesh` as an input (here through
`DTensor.from_local`) has the mesh pickled into its AOT autograd and
inductor cache keys. `DeviceMesh` pickles its `__dict__`, which holds the
`hash()` it caches once it has been hashed (`_hash`), and that hash
differs from one process to the next: it hashes strings (the device type
and dim names, randomized by `PYTHONHASHSEED`) and the mesh's layout
object. So the key is new in every run, no entry is ever found, and a
second run compiles everything again.

Run it twice against one cache folder (1 gloo process, CPU):

    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    torchrun --nproc_per_node=1 scripts/torch_cache_device_mesh_hash.py
    torchrun --nproc_per_node=1 scripts/torch_cache_device_mesh_hash.py
    torchrun --nproc_per_node=1 scripts/torch_cache_device_mesh_hash.py fix
    torchrun --nproc_per_node=1 scripts/torch_cache_device_mesh_hash.py fix

With torch 2.13.0 both plain runs print `autograd_cache_miss: 1` and a
different `hash(mesh)`. With `fix`, which pickles the mesh without
`_hash` (everything it is computed from is still pickled), the second
run prints `autograd_cache_hit: 1`.
`keras/src/backend/torch/compile_cache_keys.py` does the same while the
compile backend of distributed steps runs
(`device_meshes_pickled_without_hash`).
"""

import copyreg
import sys

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard


def reduce_mesh_without_hash(mesh):
    state = mesh.__getstate__()
    state.pop("_hash", None)
    return copyreg.__newobj__, (type(mesh),), state


def main(fix):
    if fix:
        copyreg.pickle(DeviceMesh, reduce_mesh_without_hash)
    dist.init_process_group("gloo")
    mesh = init_device_mesh(
        "cpu", (dist.get_world_size(),), mesh_dim_names=("batch",)
    )

    @torch.compile(backend="inductor", fullgraph=True)
    def total(local, mesh):
        return (DTensor.from_local(local, mesh, [Shard(0)]) * 2).sum()

    local = torch.arange(4.0, requires_grad=True)
    total(local, mesh).full_tensor().backward()
    print(
        f"fix={fix}, rank {dist.get_rank()}: hash(mesh) {hash(mesh)},",
        dict(counters["aot_autograd"]),
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:] == ["fix"])
