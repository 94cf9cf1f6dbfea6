"""Single-process tests of `compiled_step_backend`.

A one-process mesh makes every value a DTensor, as on many processes.
Compiling with inductor takes minutes on CPU, so these tests stand in
`aot_eager` for it (`inductor_stand_in`): AOT autograd (where DTensor's
missing tangents and aliased outputs fail) runs as with inductor.
Multi-process runs with inductor are in `integration_tests/jit_compile_test.py`.
"""

import copyreg
import functools

import numpy as np
import pytest
import torch
from torch._dynamo.backends import registry
from torch._inductor import config as inductor_config
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import distribute_tensor

from keras.src.backend.torch import compile_cache_keys
from keras.src.backend.torch import compiled_step_backend


class CompileCalls(list):
    runs = 0


def inductor_stand_in(monkeypatch):
    """Replaces inductor by `aot_eager` while the generator runs; yields
    the calls it records: the AOT autograd cache setting, the post-grad
    custom pass and the pickle reduction of `DeviceMesh` of each call,
    and the runs of the graphs it compiled (`calls.runs`)."""
    calls = CompileCalls()
    upstream_lookup = registry.lookup_backend

    def aot_eager(graph_module, example_inputs, inner_compile=None):
        calls.append(
            (
                torch._functorch.config.enable_autograd_cache,
                inductor_config.post_grad_custom_post_pass,
                copyreg.dispatch_table.get(DeviceMesh),
                inner_compile,
            )
        )
        compiled = upstream_lookup("aot_eager")(graph_module, example_inputs)

        @functools.wraps(compiled)
        def run(*args):
            calls.runs += 1
            return compiled(*args)

        return run

    monkeypatch.setattr(
        registry,
        "lookup_backend",
        lambda name: aot_eager if name == "inductor" else upstream_lookup(name),
    )
    torch._dynamo.reset()
    yield calls
    torch._dynamo.reset()


@pytest.fixture
def inductor_calls(monkeypatch):
    """`inductor_stand_in`'s calls, inductor replaced during the test."""
    yield from inductor_stand_in(monkeypatch)


def test_backend_keys_the_autograd_cache_by_process_groups(
    distribution, inductor_calls
):
    mesh = distribution.device_mesh.backend_mesh
    x = distribute_tensor(torch.ones(2, 3), mesh, [Replicate()])

    def f(x):
        y = x * 3
        return y, y.t()

    compiled = compiled_step_backend.compile_step_function(f)
    y, y_t = compiled(x)
    ((cache_enabled, keyed, mesh_reduction, inner_compile),) = inductor_calls
    assert cache_enabled is True
    assert mesh_reduction is compile_cache_keys._reduce_mesh_without_hash
    assert (
        inner_compile
        is compile_cache_keys.compile_with_meshes_pickled_without_hash
    )
    assert DeviceMesh not in copyreg.dispatch_table
    assert isinstance(keyed, compile_cache_keys.ProcessGroupCacheKey)
    assert keyed.uuid() == (
        None,
        compile_cache_keys.process_group_cache_key(),
        compile_cache_keys.backend_sources_digest(),
    )
    assert inductor_config.post_grad_custom_post_pass is None
    np.testing.assert_array_equal(y_t.full_tensor().numpy(), np.full((3, 2), 3))


def test_output_that_backward_does_not_reach_gets_a_zero_tangent(
    distribution, inductor_calls
):
    mesh = distribution.device_mesh.backend_mesh
    weight = torch.nn.Parameter(
        distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Replicate()])
    )

    def f(weight):
        scaled = weight * 3
        return scaled.sum(), scaled.tanh()

    compiled = compiled_step_backend.compile_step_function(f)
    loss, unused = compiled(weight)
    assert unused.requires_grad
    # Backward from one of two differentiable outputs, as a train step
    # does from the loss while its predictions go to the metrics.
    loss.backward()
    assert isinstance(weight.grad, DTensor)
    np.testing.assert_array_equal(
        weight.grad.full_tensor().numpy(), np.full((2, 3), 3.0)
    )
