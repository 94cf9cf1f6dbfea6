"""Post-import edits for `jit_compile=True` (torch.compile) under a
distribution.

Like `keras_dtensor._edits`, each edit is one small function applied to an
upstream module after it executes, only under the torch backend; this
module imports neither torch nor keras at module level. The edits act only
while a distribution is set, so plain keras compiles exactly as upstream.

Upstream compiles each whole step function with `torch.compile`. Dynamo
splits the train step at `loss.backward()`, and keras layers break graphs
too (e.g. `MultiHeadAttention` at `SDPAParams`). With DTensor values that
fails or computes wrong numbers in four ways, which the compiled steps
made here avoid while DTensor still does all the math:

1. Missing tangents (pytorch#172556). The graph that ends at
   `loss.backward()` returns the loss and the predictions `y_pred`, which
   only `compute_metrics` reads afterwards. Both require gradients, but
   backward starts from the loss alone, so autograd passes a plain zero
   tensor as the gradient of `y_pred`, where the compiled backward expects
   a DTensor: "Expected a DTensor tangent but got a plain Tensor (tangent
   index: 1)". The compile backend ties the differentiable DTensor outputs
   of each compiled graph together through one autograd node, which gives
   an output that backward does not reach a zero DTensor gradient, so any
   train step (a model's own included) can call `loss.backward()`.
   Upstream's train step also detaches `y_pred` before backward, which
   spares the backward pass that zero gradient.
2. Aliased outputs (pytorch#184002). A graph split inside a layer returns
   several views of one tensor (e.g. attention's query and its transpose);
   AOT autograd rebuilds such outputs with `as_strided`, which DTensor
   rejects. The compile backend clones graph outputs that share storage
   with another output or an input.
3. Backward under Dynamo. `loss.backward()` called from compiled code runs
   with Dynamo's frame hook active, so the Python code that backward
   calls (DTensor's `__tensor_unflatten__`, gradient hooks) gets traced,
   and that failed. Backward is called through `torch.compiler.disable`:
   it still runs the compiled backward graphs; only its Python glue (and
   the gradient reduction hooks) runs eagerly.
4. Wrong numbers from the AOT autograd cache. Its key is computed from the
   Dynamo graph and its inputs' metadata, and it evidently misses
   something the code DTensor lowers the graph to depends on: with
   entries left in the shared cache folder by earlier runs (other meshes
   and code versions), ModelParallel losses were off by up to 26% from
   the first step, while a fresh cache folder, or no AOT autograd cache,
   gave the eager numbers. The backend compiles without the AOT autograd
   cache; inductor's own cache, keyed on the lowered graph, stays on.

Shapes are static (`dynamic=False`): with automatic dynamic shapes,
tracing the transformer's graphs under DTensor ended in a RecursionError.
The steps run in `replicate_created_tensors`, as the eager steps do.
"""

import functools


def _is_torch_backend():
    from keras.src.backend.config import backend

    return backend() == "torch"


def _distribution():
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("distribution")


def _storage_of(node):
    """The storage behind a graph node's example value (a DTensor's local
    tensor), or None for non-tensors."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.multiprocessing.reductions import StorageWeakRef

    value = node.meta.get("example_value")
    if isinstance(value, DTensor):
        value = value._local_tensor
    if not isinstance(value, torch.Tensor):
        return None
    return StorageWeakRef(value.untyped_storage())


def _fake_clone(value):
    """Clones a graph's example DTensor in its fake tensor mode."""
    from torch._subclasses.fake_tensor import maybe_get_fake_mode

    with maybe_get_fake_mode(value._local_tensor):
        return value.clone()


def clone_aliased_dtensor_outputs(graph_module):
    """Makes every DTensor output of a Dynamo graph own its storage.

    An output that shares storage with another output or with an input
    (and is not that input itself) is replaced by its clone. Returns the
    indices of the outputs replaced.
    """
    import torch
    from torch.distributed.tensor import DTensor

    graph = graph_module.graph
    output_node = graph.output_node()
    outputs = list(output_node.args[0])
    users = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            storage = _storage_of(node)
            if storage is not None:
                users[storage] = users.get(storage, 0) + 1
    for node in outputs:
        if isinstance(node, torch.fx.Node) and node.op != "placeholder":
            storage = _storage_of(node)
            if storage is not None:
                users[storage] = users.get(storage, 0) + 1
    replaced = []
    for index, node in enumerate(outputs):
        if (
            not isinstance(node, torch.fx.Node)
            or node.op == "placeholder"
            or not isinstance(node.meta.get("example_value"), DTensor)
            or users.get(_storage_of(node), 0) < 2
        ):
            continue
        with graph.inserting_before(output_node):
            clone = graph.call_method("clone", (node,))
        clone.meta = dict(node.meta)
        clone.meta["example_value"] = _fake_clone(node.meta["example_value"])
        outputs[index] = clone
        replaced.append(index)
    if replaced:
        output_node.args = (type(output_node.args[0])(outputs),)
        graph.lint()
        graph_module.recompile()
    return replaced


def _zero_like_dtensor(metadata):
    """A zero DTensor with the metadata `_TieDifferentiableOutputs` kept."""
    import torch
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride, local_shape, dtype, device = metadata
    return DTensor.from_local(
        torch.zeros(local_shape, dtype=dtype, device=device),
        mesh,
        placements,
        run_check=False,
        shape=shape,
        stride=stride,
    )


@functools.cache
def _tie_differentiable_outputs_class():
    """The autograd function behind `tie_differentiable_dtensor_outputs`
    (defined on first use: this module does not import torch on import)."""
    import torch

    class TieDifferentiableOutputs(torch.autograd.Function):
        """Identity on DTensors; a missing gradient becomes a zero DTensor."""

        @staticmethod
        def forward(ctx, *outputs):
            ctx.set_materialize_grads(False)
            ctx.output_metadata = [
                (
                    output.device_mesh,
                    output.placements,
                    output.shape,
                    output.stride(),
                    output._local_tensor.shape,
                    output.dtype,
                    output.device,
                )
                for output in outputs
            ]
            return tuple(output.view_as(output) for output in outputs)

        @staticmethod
        def backward(ctx, *grads):
            return tuple(
                _zero_like_dtensor(metadata) if grad is None else grad
                for grad, metadata in zip(grads, ctx.output_metadata)
            )

    return TieDifferentiableOutputs


def tie_differentiable_dtensor_outputs(outputs):
    """Passes a compiled graph's differentiable DTensor outputs through one
    autograd node.

    Backward then reaches the compiled graph through that node, which gives
    every output that backward did not reach a zero DTensor gradient,
    where autograd would pass the compiled backward a plain zero tensor
    (pytorch#172556). Other outputs are returned as they are.
    """
    from torch.distributed.tensor import DTensor

    positions = [
        i
        for i, output in enumerate(outputs)
        if isinstance(output, DTensor) and output.requires_grad
    ]
    if len(positions) < 2:
        return outputs
    tie = _tie_differentiable_outputs_class()
    tied = tie.apply(*(outputs[i] for i in positions))
    result = list(outputs)
    for i, output in zip(positions, tied):
        result[i] = output
    return tuple(result) if isinstance(outputs, tuple) else result


def distributed_step_backend(graph_module, example_inputs):
    """The `torch.compile` backend of steps under a distribution: inductor
    (upstream's default), after `clone_aliased_dtensor_outputs`, with the
    outputs tied by `tie_differentiable_dtensor_outputs`."""
    import torch
    from torch._dynamo.backends.registry import lookup_backend

    clone_aliased_dtensor_outputs(graph_module)
    with torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = lookup_backend("inductor")(graph_module, example_inputs)

    def run_compiled(*args):
        return tie_differentiable_dtensor_outputs(compiled(*args))

    return run_compiled


def make_train_step_with_detached_predictions(model):
    """Returns `TorchTrainer.train_step` for `model`, with `y_pred` detached
    before backward and backward run outside Dynamo.

    The computation is upstream's, step for step: the metrics read the same
    predictions, without their autograd history.
    """
    import warnings

    import torch
    from torch.utils import _pytree

    from keras.src import tree
    from keras.src.trainers.data_adapters import data_adapter_utils

    backward = torch.compiler.disable(torch.Tensor.backward)

    def train_step(data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        if model._call_has_training_arg:
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
        model.zero_grad()
        loss = model._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        batch_size = next(i for i in tree.flatten(x) if i is not None).shape[0]
        model._loss_tracker.update_state(loss, sample_weight=batch_size)
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
        y_pred = _pytree.tree_map_only(
            torch.Tensor, torch.Tensor.detach, y_pred
        )
        if model.trainable_weights:
            backward(loss)
            trainable_weights = model.trainable_weights[:]
            gradients = [v.value.grad for v in trainable_weights]
            with torch.no_grad():
                model.optimizer.apply(gradients, trainable_weights)
        else:
            warnings.warn("The model does not have any trainable weights.")
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return train_step


def compile_step_for_distribution(step_on_data):
    """Compiles `step_on_data` with `distributed_step_backend`.

    The returned step function prepares the batch as the eager step does:
    it is wrapped by `distribute_step_inputs`, which, under a distribution,
    distributes the batch on entry and runs the step in
    `replicate_created_tensors`.
    """
    import torch

    from keras_dtensor._edits import distribute_step_inputs

    compiled_step = torch.compile(
        step_on_data, backend=distributed_step_backend, dynamic=False
    )
    step_function = distribute_step_inputs(compiled_step)
    step_function.compiled_for_distribution = True
    return step_function


def edit_trainer_compile_under_distribution(trainer_module):
    """Under a distribution, `jit_compile=True` compiles steps that DTensor
    can run.

    Stands for: in `keras/src/backend/torch/trainer.py`, when a
    distribution is set, `make_train_function`, `make_test_function` and
    `make_predict_function` compile with `distributed_step_backend`
    (inductor, after cloning aliased DTensor outputs), and `train_step`
    detaches `y_pred` before calling `loss.backward()` through
    `torch.compiler.disable`. A model that overrides `train_step` keeps
    its own, compiled with that backend. Without a distribution, or with
    `jit_compile=False`, the step functions are upstream's.
    """
    if not _is_torch_backend():
        return
    import torch

    trainer_class = trainer_module.TorchTrainer
    upstream_train_step = trainer_class.train_step

    def train_step_on_data(model):
        if type(model).train_step is upstream_train_step:
            step = make_train_step_with_detached_predictions(model)
        else:
            step = model.train_step
        return lambda data: step(data[0])

    def test_step_on_data(model):
        def one_step_on_data(data):
            with torch.no_grad():
                return model.test_step(data[0])

        return one_step_on_data

    def predict_step_on_data(model):
        def one_step_on_data(data):
            with torch.no_grad():
                return model.predict_step(data[0])

        return one_step_on_data

    def wrap_maker(attribute, step_on_data):
        previous_maker = getattr(trainer_class, f"make_{attribute}")

        def make_function(self, force=False):
            function = previous_maker(self, force=force)
            if _distribution() is None or not self._should_torch_compile():
                return function
            current = getattr(self, attribute)
            if getattr(current, "compiled_for_distribution", False):
                return current
            step_function = compile_step_for_distribution(step_on_data(self))
            setattr(self, attribute, step_function)
            return step_function

        setattr(trainer_class, f"make_{attribute}", make_function)

    wrap_maker("train_function", train_step_on_data)
    wrap_maker("test_function", test_step_on_data)
    wrap_maker("predict_function", predict_step_on_data)


# Upstream module name -> function returning the edits for that module.
POST_IMPORT_EDITS = {
    "keras.src.backend.torch.trainer": lambda: [
        edit_trainer_compile_under_distribution
    ],
}
