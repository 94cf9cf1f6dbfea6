"""Single-process tests of the `jit_compile` edits
(`keras_dtensor._compile_edits`).

A one-process mesh makes every value a DTensor, as on many processes.
Compiling with inductor takes minutes on CPU, so these tests stand in
`aot_eager` for it: AOT autograd (where DTensor's missing tangents and
aliased outputs fail) runs as with inductor. Multi-process runs with
inductor are in `integration_tests/jit_compile_test.py`.
"""

import numpy as np
import pytest
import torch
from torch._dynamo.backends import registry
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import distribute_tensor

import keras
from keras_dtensor import _compile_edits

STEP_FUNCTIONS = ("train_function", "test_function", "predict_function")


@pytest.fixture
def distribution():
    distribution = keras.distribution.DataParallel(devices=["cpu:0"])
    keras.distribution.set_distribution(distribution)
    yield distribution
    keras.distribution.set_distribution(None)


@pytest.fixture
def inductor_calls(monkeypatch):
    """Replaces inductor by `aot_eager`; records the AOT autograd cache
    setting of each call."""
    calls = []
    upstream_lookup = registry.lookup_backend

    def aot_eager(graph_module, example_inputs):
        calls.append(torch._functorch.config.enable_autograd_cache)
        return upstream_lookup("aot_eager")(graph_module, example_inputs)

    monkeypatch.setattr(
        registry,
        "lookup_backend",
        lambda name: aot_eager if name == "inductor" else upstream_lookup(name),
    )
    torch._dynamo.reset()
    yield calls
    torch._dynamo.reset()


def make_model(jit_compile):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=jit_compile,
    )
    return model


def make_step_functions(model):
    for attribute in STEP_FUNCTIONS:
        getattr(model, f"make_{attribute}")()
    return [getattr(model, attribute) for attribute in STEP_FUNCTIONS]


def is_compiled_for_distribution(function):
    return getattr(function, "compiled_for_distribution", False)


def test_without_distribution_step_functions_are_upstream():
    for function in make_step_functions(make_model(jit_compile=True)):
        assert not is_compiled_for_distribution(function)


def test_eager_steps_under_distribution_are_not_compiled(distribution):
    for function in make_step_functions(make_model(jit_compile=False)):
        assert not is_compiled_for_distribution(function)


def test_jit_steps_under_distribution_are_compiled_once(distribution):
    model = make_model(jit_compile=True)
    functions = make_step_functions(model)
    assert all(is_compiled_for_distribution(f) for f in functions)
    assert make_step_functions(model) == functions
    model.make_train_function(force=True)
    assert model.train_function is not functions[0]
    assert is_compiled_for_distribution(model.train_function)


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
    assert _compile_edits.clone_aliased_dtensor_outputs(graph_module) == [
        0,
        1,
        2,
    ]
    outputs = graph_module(x)
    storages = [o.to_local().untyped_storage().data_ptr() for o in outputs]
    storages.append(x.to_local().untyped_storage().data_ptr())
    assert len(set(storages)) == len(storages)
    for output, expected in zip(outputs, f(x)):
        assert isinstance(output, DTensor)
        np.testing.assert_array_equal(
            output.full_tensor().numpy(), expected.full_tensor().numpy()
        )
    assert _compile_edits.clone_aliased_dtensor_outputs(graph_module) == []


def test_backend_runs_inductor_without_the_autograd_cache(
    distribution, inductor_calls
):
    mesh = distribution.device_mesh.backend_mesh
    x = distribute_tensor(torch.ones(2, 3), mesh, [Replicate()])

    def f(x):
        y = x * 3
        return y, y.t()

    compiled = torch.compile(
        f, backend=_compile_edits.distributed_step_backend, dynamic=False
    )
    y, y_t = compiled(x)
    assert inductor_calls == [False]
    assert torch._functorch.config.enable_autograd_cache is not False
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

    compiled = torch.compile(
        f, backend=_compile_edits.distributed_step_backend, dynamic=False
    )
    loss, unused = compiled(weight)
    assert unused.requires_grad
    # Backward from one of two differentiable outputs, as a train step
    # does from the loss while its predictions go to the metrics.
    loss.backward()
    assert isinstance(weight.grad, DTensor)
    np.testing.assert_array_equal(
        weight.grad.full_tensor().numpy(), np.full((2, 3), 3.0)
    )
