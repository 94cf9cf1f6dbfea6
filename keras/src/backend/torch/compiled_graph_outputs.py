"""The outputs of compiled DTensor graphs, made fit for AOT autograd.

Two torch failures on the outputs of a Dynamo graph of DTensors, which
the compile backend of distributed steps (`compiled_step_backend`) works
around for each graph it compiles:

- Aliased outputs (pytorch#184002): `clone_aliased_dtensor_outputs`
  changes the Dynamo graph, before it is compiled, so that every DTensor
  output owns its storage.
- Missing tangents (pytorch#172556): `tie_differentiable_dtensor_outputs`
  passes the differentiable DTensor outputs of each run of a compiled
  graph through one autograd node, which gives an output that backward
  does not reach a zero DTensor gradient.

Collectives: none (a zero gradient is made from a local zero tensor).
"""

import torch
from torch.distributed.tensor import DTensor

from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import torch_runtime


def _storage_of(node):
    """The storage behind a graph node's example value (a DTensor's local
    tensor), or None for non-tensors."""
    from torch.multiprocessing.reductions import StorageWeakRef

    value = node.meta.get("example_value")
    if isinstance(value, DTensor):
        value = torch_internals.local_tensor(value)
    if not isinstance(value, torch.Tensor):
        return None
    return StorageWeakRef(value.untyped_storage())


def _fake_clone(value):
    """Clones a graph's example DTensor in its fake tensor mode."""
    with torch_runtime.fake_mode_of(torch_internals.local_tensor(value)):
        return value.clone()


def _storage_users(graph, outputs):
    """How many inputs and computed outputs of `graph` use each storage."""
    users = {}
    nodes = [n for n in graph.nodes if n.op == "placeholder"] + [
        n
        for n in outputs
        if isinstance(n, torch.fx.Node) and n.op != "placeholder"
    ]
    for node in nodes:
        storage = _storage_of(node)
        if storage is not None:
            users[storage] = users.get(storage, 0) + 1
    return users


def _is_aliased_dtensor(node, users):
    """Whether an output node is a computed DTensor sharing its storage."""
    return (
        isinstance(node, torch.fx.Node)
        and node.op != "placeholder"
        and isinstance(node.meta.get("example_value"), DTensor)
        and users.get(_storage_of(node), 0) >= 2
    )


def clone_aliased_dtensor_outputs(graph_module):
    """Makes every DTensor output of a Dynamo graph own its storage.

    An output that shares storage with another output or with an input
    (and is not that input itself) is replaced by its clone.

    Args:
        graph_module: the Dynamo graph, changed in place.

    Returns:
        The indices of the outputs replaced.
    """
    # A graph split inside a layer returns several views of one tensor
    # (e.g. attention's query and its transpose); AOT autograd rebuilds
    # such outputs with `as_strided`, which DTensor rejects
    # (pytorch#184002).
    graph = graph_module.graph
    output_node = graph.output_node()
    outputs = list(output_node.args[0])
    users = _storage_users(graph, outputs)
    replaced = []
    for index, node in enumerate(outputs):
        if not _is_aliased_dtensor(node, users):
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


def _dtensor_metadata(value):
    """What `_zero_like_dtensor` needs to rebuild a DTensor like `value`."""
    return (
        value.device_mesh,
        value.placements,
        value.shape,
        value.stride(),
        torch_internals.local_tensor(value).shape,
        value.dtype,
        value.device,
    )


def _zero_like_dtensor(metadata):
    """A zero DTensor with the metadata `_dtensor_metadata` kept."""
    mesh, placements, shape, stride, local_shape, dtype, device = metadata
    return DTensor.from_local(
        torch.zeros(local_shape, dtype=dtype, device=device),
        mesh,
        placements,
        run_check=False,
        shape=shape,
        stride=stride,
    )


class _TieDifferentiableOutputs(torch.autograd.Function):
    """Identity on DTensors; a missing gradient becomes a zero DTensor.

    Each output is a new DTensor over the same local tensor, not a view:
    autograd forbids writing in place into one of several views a
    function returns, and the eager code after a graph break may do so
    (keras-hub's Gemma scales its queries with `q *= ...`).
    """

    @staticmethod
    def forward(ctx, *outputs):
        ctx.set_materialize_grads(False)
        ctx.output_metadata = [_dtensor_metadata(o) for o in outputs]
        return tuple(
            dtensor_layouts.rewrapped(output, output.to_local())
            for output in outputs
        )

    @staticmethod
    def backward(ctx, *grads):
        return tuple(
            _zero_like_dtensor(metadata) if grad is None else grad
            for grad, metadata in zip(grads, ctx.output_metadata)
        )


def tie_differentiable_dtensor_outputs(outputs):
    """Passes a compiled graph's differentiable DTensor outputs through one
    autograd node.

    Backward then reaches the compiled graph through that node, which gives
    every output that backward did not reach a zero DTensor gradient,
    where autograd would pass the compiled backward a plain zero tensor
    (pytorch#172556).

    Args:
        outputs: the outputs of a compiled graph (a tuple or list).

    Returns:
        `outputs`, with its differentiable DTensors replaced by tied views
        when there are at least two; other outputs as they are.
    """
    # The graph that ends at `loss.backward()` returns the loss and the
    # predictions `y_pred`, which only `compute_metrics` reads afterwards.
    # Both require gradients, but backward starts from the loss alone, so
    # autograd passed a plain zero tensor as the gradient of `y_pred`,
    # where the compiled backward expects a DTensor: "Expected a DTensor
    # tangent but got a plain Tensor (tangent index: 1)". Tied, any train
    # step (a model's own included) can call `loss.backward()`.
    positions = [
        i
        for i, output in enumerate(outputs)
        if isinstance(output, DTensor) and output.requires_grad
    ]
    if len(positions) < 2:
        return outputs
    tied = _TieDifferentiableOutputs.apply(*(outputs[i] for i in positions))
    result = list(outputs)
    for i, output in zip(positions, tied):
        result[i] = output
    return tuple(result) if isinstance(outputs, tuple) else result
