"""Single-process tests of `distributed_trainer`.

A one-process mesh makes every value a DTensor, as on many processes.
Compiling with inductor takes minutes on CPU, so these tests stand in
`aot_eager` for it: AOT autograd (where DTensor's missing tangents and
aliased outputs fail) runs as with inductor. Multi-process runs with
inductor are in `integration_tests/jit_compile_test.py`.
"""

import copy
import copyreg
import functools
import hashlib
import inspect
import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch._dynamo.backends import registry
from torch._inductor import config as inductor_config
from torch._inductor.codecache import FxGraphCachePickler
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import distribute_tensor

import keras
from keras.src.backend.torch import distributed_trainer
from keras.src.backend.torch import distribution_lib
from keras.src.backend.torch.trainer import TorchTrainer

STEP_FUNCTIONS = ("train_function", "test_function", "predict_function")


@pytest.fixture
def distribution():
    distribution = keras.distribution.DataParallel(devices=["cpu:0"])
    keras.distribution.set_distribution(distribution)
    yield distribution
    keras.distribution.set_distribution(None)


class CompileCalls(list):
    runs = 0


@pytest.fixture
def inductor_calls(monkeypatch):
    """Replaces inductor by `aot_eager`; records the AOT autograd cache
    setting, the post-grad custom pass and the pickle reduction of
    `DeviceMesh` of each call, and counts the runs of the graphs it
    compiled (`calls.runs`)."""
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


def test_upstream_train_step_is_a_copied_one():
    source = inspect.getsource(TorchTrainer.train_step)
    digest = hashlib.sha256(source.encode()).hexdigest()
    assert digest == distributed_trainer.installed_train_step_sha256()
    assert digest in distributed_trainer.TRAIN_STEP_COPIES, (
        "The installed keras changed `TorchTrainer.train_step`. Copy it "
        "into `distributed_trainer` (keeping `y_pred` detached before the "
        "gradients and backward called through `torch.compiler.disable`), "
        f"and add the copy to `TRAIN_STEP_COPIES` under {digest!r}."
    )


def test_the_installed_train_steps_copy_is_used(monkeypatch):
    digest = distributed_trainer.installed_train_step_sha256()
    calls = []

    def copy(trainer, eager=False):
        calls.append((trainer, eager))
        return "the copy's step"

    monkeypatch.setitem(distributed_trainer.TRAIN_STEP_COPIES, digest, copy)
    step = distributed_trainer.train_step_with_detached_predictions("model")
    assert step == "the copy's step" and calls == [("model", False)]
    distributed_trainer.train_step_with_detached_predictions(
        "model", eager=True
    )
    assert calls[-1] == ("model", True)


def test_an_unknown_train_step_runs_as_installed_with_a_warning(
    monkeypatch,
):
    monkeypatch.setattr(
        distributed_trainer, "installed_train_step_sha256", lambda: "f" * 64
    )
    model = make_model(jit_compile=False)
    with pytest.warns(UserWarning) as warned:
        step = distributed_trainer.train_step_with_detached_predictions(model)
    assert step == model.train_step
    (message,) = [str(w.message) for w in warned]
    assert f"keras {keras.__version__}'s" in message
    assert "f" * 64 in message


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
        distributed_trainer, "compile_step_function", compile_step_function
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
    from keras.src.backend.torch import gradient_buckets

    def failing_step(data):
        # As a backward pass that raised after filling a bucket.
        gradient_buckets._PENDING.finalizer_queued = True
        gradient_buckets._PENDING.open["key"] = "bucket"
        raise RuntimeError("step failed")

    step = distributed_trainer.DistributedStepFunction(failing_step)
    batch = (np.ones((2, 4), "float32"), np.zeros((2,), "int32"))
    with pytest.raises(RuntimeError, match="step failed"):
        step((batch,))
    assert not gradient_buckets._PENDING.finalizer_queued
    assert gradient_buckets._PENDING.open == {}


def test_step_on_data_keeps_a_models_own_train_step(distribution):
    calls = []

    def own_train_step(self, data):
        calls.append(data)
        return {}

    model = make_model(jit_compile=True, train_step=own_train_step)
    distributed_trainer.step_on_data(model, "train")(("batch",))
    assert calls == ["batch"]


@pytest.mark.parametrize(
    "jit_compile, eager", [(False, True), (True, False), (True, True)]
)
def test_detached_train_step_matches_upstream(distribution, jit_compile, eager):
    """Eager calls of both; with `jit_compile=True` a later keras computes
    the gradients with `torch.autograd.grad` rather than backward. The
    copy made for eager steps (`eager=True`) clears and lists the
    gradients outside the step's mode."""
    x = np.random.RandomState(0).normal(size=(8, 4)).astype("float32")
    y = np.arange(8) % 3
    results = []
    for detached in (False, True):
        model = make_model(jit_compile=jit_compile)
        if detached:
            step = distributed_trainer.train_step_with_detached_predictions(
                model, eager=eager
            )
        else:
            step = model.train_step
        data = distribution_lib.distribute_data((x, y), distribution)
        with distribution_lib.replicate_created_tensors(
            distribution.device_mesh
        ):
            logs = step(data)
        logs = {k: keras.ops.convert_to_numpy(v) for k, v in logs.items()}
        results.append((logs, model.get_weights()))
    (logs, weights), (detached_logs, detached_weights) = results
    assert set(logs) == set(detached_logs) == {"loss", "accuracy"}
    for name, value in logs.items():
        np.testing.assert_array_equal(detached_logs[name], value)
    assert len(weights) == len(detached_weights) == 4
    for weight, detached_weight in zip(weights, detached_weights):
        np.testing.assert_array_equal(weight, detached_weight)


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
    replaced = distributed_trainer.clone_aliased_dtensor_outputs(graph_module)
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
    assert distributed_trainer.clone_aliased_dtensor_outputs(graph_module) == []


def test_backend_keys_the_autograd_cache_by_process_groups(
    distribution, inductor_calls
):
    mesh = distribution.device_mesh.backend_mesh
    x = distribute_tensor(torch.ones(2, 3), mesh, [Replicate()])

    def f(x):
        y = x * 3
        return y, y.t()

    compiled = distributed_trainer.compile_step_function(f)
    y, y_t = compiled(x)
    ((cache_enabled, keyed, mesh_reduction, inner_compile),) = inductor_calls
    assert cache_enabled is True
    assert mesh_reduction is distributed_trainer._reduce_mesh_without_hash
    assert (
        inner_compile
        is distributed_trainer.compile_with_meshes_pickled_without_hash
    )
    assert DeviceMesh not in copyreg.dispatch_table
    assert isinstance(keyed, distributed_trainer.ProcessGroupCacheKey)
    assert keyed.uuid() == (
        None,
        distributed_trainer.process_group_cache_key(),
        distributed_trainer.backend_sources_digest(),
    )
    assert inductor_config.post_grad_custom_post_pass is None
    np.testing.assert_array_equal(y_t.full_tensor().numpy(), np.full((3, 2), 3))


def test_process_group_cache_key_names_every_group(distribution):
    rank, groups = distributed_trainer.process_group_cache_key()
    assert rank == dist.get_rank() == 0
    names = dict(groups)
    assert names[dist.group.WORLD.group_name] == (0,)
    mesh = distribution.device_mesh.backend_mesh
    assert names[mesh.get_group(0).group_name] == (0,)
    new_group = dist.new_group([0])
    after = dict(distributed_trainer.process_group_cache_key()[1])
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
    with distributed_trainer.device_meshes_pickled_without_hash():
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
        distributed_trainer.compile_with_meshes_pickled_without_hash(
            "graph", ["inputs"], cudagraphs=None
        )
    )
    assert (args, kwargs) == (("graph", ["inputs"]), {"cudagraphs": None})
    assert reduction is distributed_trainer._reduce_mesh_without_hash
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
        with distributed_trainer.aot_autograd_cache_keyed_by_process_groups():
            keyed = inductor_config.post_grad_custom_post_pass
            assert torch._functorch.config.enable_autograd_cache is True
        assert inductor_config.post_grad_custom_post_pass is configured
    keyed("graph")
    assert configured.graphs == ["graph"]
    assert keyed.uuid()[0] == "theirs"
    assert keyed.uuid()[1:] == (
        distributed_trainer.process_group_cache_key(),
        distributed_trainer.backend_sources_digest(),
    )
    # A pass that asks for no caching keeps asking.
    assert (
        distributed_trainer.ProcessGroupCacheKey(RecordingPass(None)).uuid()
        is None
    )


def test_configured_plain_function_turns_the_autograd_cache_off(distribution):
    def plain(graph):
        pass

    with inductor_config.patch(post_grad_custom_post_pass=plain):
        with distributed_trainer.aot_autograd_cache_keyed_by_process_groups():
            assert inductor_config.post_grad_custom_post_pass is plain
            assert torch._functorch.config.enable_autograd_cache is False
    assert torch._functorch.config.enable_autograd_cache is not False


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

    compiled = distributed_trainer.compile_step_function(f)
    loss, unused = compiled(weight)
    assert unused.requires_grad
    # Backward from one of two differentiable outputs, as a train step
    # does from the loss while its predictions go to the metrics.
    loss.backward()
    assert isinstance(weight.grad, DTensor)
    np.testing.assert_array_equal(
        weight.grad.full_tensor().numpy(), np.full((2, 3), 3.0)
    )
