"""Single-process tests of `compiled_graph_outputs`.

A one-process mesh makes every value a DTensor, as on many processes.
"""

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import distribute_tensor

from keras.src.backend.torch import compiled_graph_outputs


def capture_graphs(graphs):
    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    return backend


def test_aliased_dtensor_outputs_are_cloned(distribution):
    mesh = distribution.device_mesh.backend_mesh
    x = distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Replicate()])

    def f(x):
        y = x + 1
        return y, y.t(), x.view(-1), x * 2

    graphs = []
    torch._dynamo.reset()
    torch.compile(f, backend=capture_graphs(graphs), dynamic=False)(x)
    (graph_module,) = graphs
    # `y` and its transpose share storage, `x.view` shares the input's.
    replaced = compiled_graph_outputs.clone_aliased_dtensor_outputs(
        graph_module
    )
    assert replaced == [0, 1, 2]
    outputs = graph_module(x)
    storages = [o.to_local().untyped_storage().data_ptr() for o in outputs]
    storages.append(x.to_local().untyped_storage().data_ptr())
    assert len(set(storages)) == len(storages)
    for output, expected in zip(outputs, f(x)):
        assert isinstance(output, DTensor)
        np.testing.assert_array_equal(
            output.full_tensor().numpy(), expected.full_tensor().numpy()
        )
    assert (
        compiled_graph_outputs.clone_aliased_dtensor_outputs(graph_module) == []
    )


def test_outputs_backward_does_not_reach_get_a_zero_gradient(distribution):
    mesh = distribution.device_mesh.backend_mesh
    weight = torch.nn.Parameter(
        distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Replicate()])
    )
    outputs = (weight * 2, weight.tanh(), "not a tensor")
    tied = compiled_graph_outputs.tie_differentiable_dtensor_outputs(outputs)
    assert isinstance(tied, tuple) and tied[2] == "not a tensor"
    for output, original in zip(tied[:2], outputs):
        assert isinstance(output, DTensor) and output is not original
        assert output.placements == original.placements
    # Backward from the first output alone: the second's gradient is a
    # zero DTensor, where autograd would pass a plain zero tensor.
    tied[0].sum().backward()
    np.testing.assert_array_equal(
        weight.grad.full_tensor().numpy(), np.full((2, 3), 2.0)
    )


def test_a_single_differentiable_output_is_kept(distribution):
    mesh = distribution.device_mesh.backend_mesh
    weight = torch.nn.Parameter(
        distribute_tensor(torch.ones(2, 3), mesh, [Replicate()])
    )
    outputs = [weight * 2, torch.ones(3)]
    tie = compiled_graph_outputs.tie_differentiable_dtensor_outputs
    assert tie(outputs) is outputs
