"""Cache keys of compiled DTensor graphs that are right in every run.

Two contexts around inductor's compile of a distributed step's graph
(`compiled_step_backend`):

- `aot_autograd_cache_keyed_by_process_groups`: AOT autograd's cache key
  misses the names of the process groups the lowered graph's collectives
  hard-code; inside, both of inductor's cache keys include them
  (`ProcessGroupCacheKey`: this process's rank, the name and ranks of
  each of its process groups, and the sources of this backend).
- `device_meshes_pickled_without_hash` (and
  `compile_with_meshes_pickled_without_hash`, for backward graphs
  compiled later): inside, a `DeviceMesh` pickles without the `hash()`
  it caches, which differs from one process to the next, so that a
  graph with a mesh input has the same key in every run.

Collectives: none; the key reads `torch.distributed`'s registry of
process groups.
"""

import contextlib
import copyreg
import functools
import glob
import hashlib
import os

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import torch_runtime


@contextlib.contextmanager
def aot_autograd_cache_keyed_by_process_groups():
    """Inside, inductor's caches are keyed by `ProcessGroupCacheKey` too.

    The key goes in through inductor's `post_grad_custom_post_pass`, whose
    `uuid()` both of inductor's cache keys include: `ProcessGroupCacheKey`
    takes that slot and runs the pass configured there, if any. A plain
    function configured there cannot carry a key: the AOT autograd cache
    is then off inside.
    """
    # AOT autograd's key is computed from the Dynamo graph and its inputs'
    # metadata; for a DTensor input that is the mesh's ranks, layout and
    # dim names, but not the names of the mesh's process groups, which
    # the collectives of the lowered graph hard-code (groups are named in
    # the order a process creates them). An entry left by an earlier run
    # that created its groups in another order (other meshes, other code
    # versions) then all-reduced over the wrong group: ModelParallel
    # losses were off by up to 26% from the first step
    # (`scripts/torch_aot_cache_group_names.py` reproduces it in a few
    # lines of torch). Inductor's own cache is keyed on the lowered graph,
    # names included, and is right.
    configured = torch_runtime.inductor_config().post_grad_custom_post_pass
    if configured is not None and not isinstance(
        configured, torch_runtime.custom_graph_pass_class()
    ):
        with torch_runtime.autograd_cache_disabled():
            yield
        return
    keyed = ProcessGroupCacheKey(configured)
    with torch_runtime.inductor_config().patch(
        post_grad_custom_post_pass=keyed
    ):
        yield


@contextlib.contextmanager
def device_meshes_pickled_without_hash():
    """Inside, a `DeviceMesh` pickles without the `hash()` it caches.

    Inductor's and AOT autograd's cache keys pickle the meshes a graph
    takes as inputs, and a mesh pickles its `__dict__`, where it caches its
    `hash()` once hashed. That hash differs from one process to the next
    (it hashes strings, randomized per process, and a layout object), so
    such a graph had a new key in every run and a second run compiled it
    again (`scripts/torch_cache_device_mesh_hash.py`). Everything the hash
    is computed from is still pickled; unpickling computes it again.
    """
    previous = copyreg.dispatch_table.get(DeviceMesh)
    copyreg.pickle(DeviceMesh, _reduce_mesh_without_hash)
    try:
        yield
    finally:
        if previous is None:
            del copyreg.dispatch_table[DeviceMesh]
        else:
            copyreg.dispatch_table[DeviceMesh] = previous


def compile_with_meshes_pickled_without_hash(*args, **kwargs):
    """Inductor's `compile_fx_inner`, in `device_meshes_pickled_without_hash`.

    AOT autograd compiles a graph's backward when backward first runs,
    after the backend has returned; inductor keys its cache entry of that
    graph in here.
    """
    with device_meshes_pickled_without_hash():
        return torch_runtime.compile_fx_module().compile_fx_inner(
            *args, **kwargs
        )


def _reduce_mesh_without_hash(mesh):
    """The pickle reduction of `mesh`: torch's, but for `_hash`.

    As by default, unpickling makes the mesh, then sets its state
    (`DeviceMesh.__setstate__`): it needs nothing from this module.
    """
    state = torch_internals.mesh_pickle_state(mesh)
    return copyreg.__newobj__, (type(mesh),), state


class ProcessGroupCacheKey(torch_runtime.custom_graph_pass_class()):
    """A post-grad pass that only carries the cache key AOT autograd misses.

    Running it runs the pass it wraps, if any. Its `uuid()` is that pass's
    with `process_group_cache_key()` and `backend_sources_digest()`, or
    None (no caching, as inductor reads it) where the wrapped pass's is.

    Args:
        configured: the `CustomGraphPass` configured before, or None.
    """

    def __init__(self, configured=None):
        self.configured = configured

    def __call__(self, graph):
        if self.configured is not None:
            self.configured(graph)

    def uuid(self):
        configured = None
        if self.configured is not None:
            configured = self.configured.uuid()
            if configured is None:
                return None
        return (
            configured,
            process_group_cache_key(),
            backend_sources_digest(),
        )


def process_group_cache_key():
    """This process's rank and every process group it knows, as
    `(rank, ((group name, global ranks in group-rank order), ...))`.

    A graph lowered here refers to its collectives' groups by name; a
    cached graph is right in another process only where each name stands
    for the same ranks in the same order. Reads the registry of
    `torch.distributed`; issues no collective.
    """
    if not dist.is_initialized():
        return (None, ())
    groups = []
    for _, name, ranks in torch_runtime.process_group_names():
        in_order = tuple(sorted(ranks, key=ranks.get))
        groups.append((name, in_order))
    return (dist.get_rank(), tuple(sorted(groups)))


@functools.cache
def backend_sources_digest():
    """SHA-256 of this backend's module sources (tests aside).

    Among them the sharding rules DTensor lowers graphs with
    (`sharding_rules`): a cached graph lowered under other rules is stale.
    """
    digest = hashlib.sha256()
    folder = os.path.dirname(os.path.abspath(__file__))
    for path in sorted(glob.glob(os.path.join(folder, "*.py"))):
        if path.endswith("_test.py"):
            continue
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as source:
            digest.update(source.read())
    return digest.hexdigest()
