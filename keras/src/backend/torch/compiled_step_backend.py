"""The `torch.compile` backend of distributed steps (`jit_compile=True`).

Under a distribution with `jit_compile=True`, a step function is compiled
by `compile_step_function`: `torch.compile` with
`distributed_step_backend` (where upstream compiles each whole step with
inductor, `torch.compile`'s default) and static shapes. Dynamo splits a
train step at `loss.backward()`, and keras layers break graphs too (e.g.
`MultiHeadAttention` at `SDPAParams`); each graph goes through the
backend. With DTensor values, plain inductor failed or computed wrong
numbers; the backend is inductor with these fixes, while DTensor still
does all the math:

- each Dynamo graph's aliased DTensor outputs are cloned, and the
  differentiable DTensor outputs of each of its runs tied through one
  autograd node (`compiled_graph_outputs`);
- inductor's and AOT autograd's cache keys name this process's process
  groups, and are the same in every run (`compile_cache_keys`).

The train step's own part (backward outside Dynamo, `y_pred` detached) is
in `train_step_copies`.

Collectives: compiling issues none; a compiled graph issues those of its
DTensor operations when it runs.
"""

import torch

from keras.src.backend.torch import compile_cache_keys
from keras.src.backend.torch import compiled_graph_outputs
from keras.src.backend.torch import torch_runtime


def compile_step_function(step_fn):
    """Compiles `step_fn` with `distributed_step_backend`, static shapes.

    Args:
        step_fn: a function of the batch.

    Returns:
        The compiled function.
    """
    # With automatic dynamic shapes, tracing the transformer's graphs
    # under DTensor ended in a RecursionError.
    return torch.compile(
        step_fn, backend=distributed_step_backend, dynamic=False
    )


def distributed_step_backend(graph_module, example_inputs):
    """The `torch.compile` backend of steps under a distribution.

    Inductor (upstream's default) with its AOT autograd cache keyed by
    `aot_autograd_cache_keyed_by_process_groups` and its cache keys made
    the same in every run by `device_meshes_pickled_without_hash` (and,
    for backward graphs compiled later, by
    `compile_with_meshes_pickled_without_hash`), after
    `clone_aliased_dtensor_outputs`, with the outputs of each call tied by
    `tie_differentiable_dtensor_outputs`.

    Args:
        graph_module: the Dynamo graph.
        example_inputs: its example inputs.

    Returns:
        The compiled function of the graph's inputs.
    """
    compiled_graph_outputs.clone_aliased_dtensor_outputs(graph_module)
    with (
        compile_cache_keys.aot_autograd_cache_keyed_by_process_groups(),
        compile_cache_keys.device_meshes_pickled_without_hash(),
    ):
        compiled = torch_runtime.compiler_backend("inductor")(
            graph_module,
            example_inputs,
            inner_compile=(
                compile_cache_keys.compile_with_meshes_pickled_without_hash
            ),
        )
    tie = compiled_graph_outputs.tie_differentiable_dtensor_outputs

    def run_compiled(*args):
        return tie(compiled(*args))

    return run_compiled
