"""Single-process tests of `compile_cache_keys`."""

import copy
import copyreg
import pickle

import torch
import torch.distributed as dist
from torch._inductor import config as inductor_config
from torch._inductor.codecache import FxGraphCachePickler
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.distributed.device_mesh import DeviceMesh

from keras.src.backend.torch import compile_cache_keys


def test_process_group_cache_key_names_every_group(distribution):
    rank, groups = compile_cache_keys.process_group_cache_key()
    assert rank == dist.get_rank() == 0
    names = dict(groups)
    assert names[dist.group.WORLD.group_name] == (0,)
    mesh = distribution.device_mesh.backend_mesh
    assert names[mesh.get_group(0).group_name] == (0,)
    new_group = dist.new_group([0])
    after = dict(compile_cache_keys.process_group_cache_key()[1])
    assert after == {**names, new_group.group_name: (0,)}


def test_cache_keys_of_a_mesh_do_not_depend_on_its_cached_hash(
    distribution,
):
    mesh = distribution.device_mesh.backend_mesh
    hash(mesh)
    twin = copy.copy(mesh)
    twin._hash = mesh._hash + 1
    graph_module = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())

    def cache_key(value):
        return FxGraphCachePickler(graph_module).get_hash(value)

    # torch's own reduction pickles the cached hash, which changes from
    # one process to the next.
    assert cache_key(mesh) != cache_key(twin)
    renamed = copy.copy(mesh)
    renamed._mesh_dim_names = ("other",)
    # A root mesh and a flattened mesh refer to each other.
    root, flattened = copy.copy(mesh), copy.copy(mesh)
    root._flatten_mapping = {"flat": flattened}
    flattened._root_mesh = root
    with compile_cache_keys.device_meshes_pickled_without_hash():
        assert cache_key(mesh) == cache_key(twin)
        # What the hash is computed from is still in the key.
        assert cache_key(mesh) != cache_key(renamed)
        restored = pickle.loads(pickle.dumps(mesh))
        restored_root = pickle.loads(pickle.dumps(root))
    assert DeviceMesh not in copyreg.dispatch_table
    assert restored == mesh and hash(restored) == hash(mesh)
    assert restored.get_group(0) is mesh.get_group(0)
    restored_flattened = restored_root._flatten_mapping["flat"]
    assert restored_flattened._root_mesh is restored_root


def test_inner_compile_pickles_meshes_without_their_hash(monkeypatch):
    from torch._inductor import compile_fx

    def recording_compile(*args, **kwargs):
        return args, kwargs, copyreg.dispatch_table.get(DeviceMesh)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", recording_compile)
    args, kwargs, reduction = (
        compile_cache_keys.compile_with_meshes_pickled_without_hash(
            "graph", ["inputs"], cudagraphs=None
        )
    )
    assert (args, kwargs) == (("graph", ["inputs"]), {"cudagraphs": None})
    assert reduction is compile_cache_keys._reduce_mesh_without_hash
    assert DeviceMesh not in copyreg.dispatch_table


class RecordingPass(CustomGraphPass):
    def __init__(self, uuid):
        self.graphs = []
        self._uuid = uuid

    def __call__(self, graph):
        self.graphs.append(graph)

    def uuid(self):
        return self._uuid


def test_cache_key_wraps_the_configured_pass(distribution):
    configured = RecordingPass("theirs")
    with inductor_config.patch(post_grad_custom_post_pass=configured):
        with compile_cache_keys.aot_autograd_cache_keyed_by_process_groups():
            keyed = inductor_config.post_grad_custom_post_pass
            assert torch._functorch.config.enable_autograd_cache is True
        assert inductor_config.post_grad_custom_post_pass is configured
    keyed("graph")
    assert configured.graphs == ["graph"]
    assert keyed.uuid()[0] == "theirs"
    assert keyed.uuid()[1:] == (
        compile_cache_keys.process_group_cache_key(),
        compile_cache_keys.backend_sources_digest(),
    )
    # A pass that asks for no caching keeps asking.
    assert (
        compile_cache_keys.ProcessGroupCacheKey(RecordingPass(None)).uuid()
        is None
    )


def test_configured_plain_function_turns_the_autograd_cache_off(distribution):
    def plain(graph):
        pass

    with inductor_config.patch(post_grad_custom_post_pass=plain):
        with compile_cache_keys.aot_autograd_cache_keyed_by_process_groups():
            assert inductor_config.post_grad_custom_post_pass is plain
            assert torch._functorch.config.enable_autograd_cache is False
    assert torch._functorch.config.enable_autograd_cache is not False
