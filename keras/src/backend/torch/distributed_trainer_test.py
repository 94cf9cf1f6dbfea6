"""Single-process tests of `distributed_trainer`.

A one-process mesh makes every value a DTensor, as on many processes.
Compiled steps stand in `aot_eager` for inductor
(`compiled_step_backend_test.inductor_stand_in`); multi-process runs
with inductor are in `integration_tests/jit_compile_test.py`.
"""

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

import keras
from keras.src.backend.torch import compiled_step_backend
from keras.src.backend.torch import compiled_step_backend_test
from keras.src.backend.torch import distributed_trainer

STEP_FUNCTIONS = ("train_function", "test_function", "predict_function")


@pytest.fixture
def inductor_calls(monkeypatch):
    yield from compiled_step_backend_test.inductor_stand_in(monkeypatch)


def make_model(jit_compile, train_step=None):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = keras.layers.Dense(3)(hidden)
    if train_step is None:
        model = keras.Model(inputs, outputs)
    else:
        model_class = type("OwnStepModel", (keras.Model,), {})
        model_class.train_step = train_step
        model = model_class(inputs, outputs)
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
    return (
        isinstance(function, distributed_trainer.DistributedStepFunction)
        and function.compiled_for_distribution
    )


def test_without_distribution_step_functions_are_upstream():
    for function in make_step_functions(make_model(jit_compile=True)):
        assert isinstance(function, distributed_trainer.DistributedStepFunction)
        assert not function.compiled_for_distribution


def test_eager_steps_under_distribution_are_not_compiled(distribution):
    for function in make_step_functions(make_model(jit_compile=False)):
        assert isinstance(function, distributed_trainer.DistributedStepFunction)
        assert not is_compiled_for_distribution(function)


def test_jit_steps_under_distribution_are_compiled_once(distribution):
    model = make_model(jit_compile=True)
    functions = make_step_functions(model)
    assert all(is_compiled_for_distribution(f) for f in functions)
    assert make_step_functions(model) == functions
    model.make_train_function(force=True)
    assert model.train_function is not functions[0]
    assert is_compiled_for_distribution(model.train_function)


def test_compiled_train_step_compiles_once(distribution, inductor_calls):
    model = make_model(jit_compile=True)
    x = np.random.RandomState(0).normal(size=(8, 4)).astype("float32")
    y = np.arange(8) % 3
    assert not inductor_calls
    model.train_on_batch(x, y)
    # The first step compiled its graphs (Dynamo's graph breaks make
    # several) with the backend standing in for inductor, and ran them.
    compiles = len(inductor_calls)
    assert compiles > 0
    first_runs = inductor_calls.runs
    assert first_runs >= compiles
    for _ in range(2):
        model.train_on_batch(x, y)
    # Without clearing the gradients after each step, the second step was
    # compiled again when it met the first step's gradients. The later
    # steps ran the first step's graphs again, compiling none.
    assert len(inductor_calls) == compiles
    assert inductor_calls.runs == 3 * first_runs
    assert all(v.value.grad is None for v in model.trainable_variables)
    eager = make_model(jit_compile=False)
    for _ in range(3):
        eager.train_on_batch(x, y)
    for weight, eager_weight in zip(model.get_weights(), eager.get_weights()):
        np.testing.assert_allclose(weight, eager_weight, rtol=1e-6, atol=1e-6)


def test_only_keras_own_compiled_train_step_clears_gradients(monkeypatch):
    def compile_step_function(step_fn):
        return lambda data: f"logs of {data}"

    monkeypatch.setattr(
        compiled_step_backend, "compile_step_function", compile_step_function
    )
    cleared = []
    models = {
        "keras": make_model(jit_compile=True),
        "own": make_model(jit_compile=True, train_step=lambda self, d: {}),
    }
    for name, model in models.items():
        monkeypatch.setattr(
            model, "zero_grad", lambda n=name: cleared.append(n)
        )
        for kind in ("train", "test"):
            step = distributed_trainer.compiled_step_on_data(model, kind)
            assert step("batch") == "logs of batch"
    # A model's own train step may keep gradients from step to step.
    assert cleared == ["keras"]


def test_step_built_without_the_distribution_is_compiled_under_it():
    distribution = keras.distribution.DataParallel(devices=["cpu:0"])
    with distribution.scope():
        model = make_model(jit_compile=True)
    model.make_train_function()
    before = model.train_function
    assert not is_compiled_for_distribution(before)
    keras.distribution.set_distribution(distribution)
    try:
        model.make_train_function()
    finally:
        keras.distribution.set_distribution(None)
    assert is_compiled_for_distribution(model.train_function)
    # Without the distribution again, the compiled step is kept.
    model.make_train_function()
    assert is_compiled_for_distribution(model.train_function)


def test_model_built_before_the_distribution_is_refused():
    model = make_model(jit_compile=True)
    distribution = keras.distribution.DataParallel(devices=["cpu:0"])
    keras.distribution.set_distribution(distribution)
    try:
        for attribute in STEP_FUNCTIONS:
            with pytest.raises(ValueError, match="was created before"):
                getattr(model, f"make_{attribute}")()
    finally:
        keras.distribution.set_distribution(None)


def test_eager_step_distributes_its_batch(distribution):
    model = make_model(jit_compile=False)
    seen = []
    step = distributed_trainer.DistributedStepFunction(seen.append)
    batch = (np.ones((2, 4), "float32"), np.zeros((2,), "int32"))
    step((batch,))
    ((x, y),) = seen[0]
    assert isinstance(x, DTensor) and isinstance(y, DTensor)
    assert tuple(x.shape) == (2, 4)
    model.make_train_function()
    logs = model.train_function((batch,))
    assert set(logs) == {"loss", "accuracy"}


def test_a_step_that_raises_discards_pending_buckets(distribution):
    from keras.src.backend.torch import reducer

    def failing_step(data):
        # As a backward pass that raised after filling a bucket.
        reducer.current().finalizer_queued = True
        reducer.current().open["key"] = "bucket"
        raise RuntimeError("step failed")

    step = distributed_trainer.DistributedStepFunction(failing_step)
    batch = (np.ones((2, 4), "float32"), np.zeros((2,), "int32"))
    with pytest.raises(RuntimeError, match="step failed"):
        step((batch,))
    assert not reducer.current().finalizer_queued
    assert reducer.current().open == {}


def test_step_on_data_keeps_a_models_own_train_step(distribution):
    calls = []

    def own_train_step(self, data):
        calls.append(data)
        return {}

    model = make_model(jit_compile=True, train_step=own_train_step)
    distributed_trainer.step_on_data(model, "train")(("batch",))
    assert calls == ["batch"]


def intercepted_functions(monkeypatch):
    """Records every function the step's torch function mode intercepts."""
    from keras.src.backend.torch import created_tensors

    seen = []
    mode_class = created_tensors._ReplicateCreatedTensors
    upstream = mode_class.__torch_function__

    def record(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return upstream(self, func, types, args, kwargs)

    monkeypatch.setattr(mode_class, "__torch_function__", record)
    return seen


def test_eager_train_step_handles_gradients_outside_the_mode(
    distribution, monkeypatch
):
    x = np.random.RandomState(0).normal(size=(8, 4)).astype("float32")
    y = np.arange(8) % 3
    grad_accessors = {torch.Tensor.grad.__get__, torch.Tensor.grad.__set__}
    results = []
    for step_of in ("upstream", "eager copy"):
        keras.utils.set_random_seed(0)
        model = make_model(jit_compile=False)
        model.make_train_function()
        function = model.train_function
        if step_of == "upstream":
            function = distributed_trainer.DistributedStepFunction(
                function.step_fn
            )
        seen = intercepted_functions(monkeypatch)
        logs = function(((x, y),))
        monkeypatch.undo()
        grad_calls = [f for f in seen if f in grad_accessors]
        logs = {k: keras.ops.convert_to_numpy(v) for k, v in logs.items()}
        results.append((grad_calls, logs, model.get_weights()))
    (upstream_calls, logs, weights), (copy_calls, copy_logs, copy_weights) = (
        results
    )
    # Upstream's zero_grad and gradient list read each of the 4 variables'
    # gradients through the mode; the eager copy reads none there.
    assert len(upstream_calls) >= 8
    assert copy_calls == []
    for name, value in logs.items():
        np.testing.assert_array_equal(copy_logs[name], value)
    for weight, copy_weight in zip(weights, copy_weights):
        np.testing.assert_array_equal(copy_weight, weight)
