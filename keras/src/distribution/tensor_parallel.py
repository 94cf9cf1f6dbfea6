"""Tensor-parallel plans that build `LayoutMap`s.

A plan is a dict from a layer path pattern to a style, as in PyTorch's
`parallelize_module` plans:

```python
plan = {
    r"block_\\d+/attention/(query|key|value)": column_parallel("model"),
    r"block_\\d+/attention/attention_output": row_parallel("model"),
    r"block_\\d+/ffn_in": column_parallel("model"),
    r"block_\\d+/ffn_out": row_parallel("model"),
}
layout_map = tensor_parallel_layouts(model, device_mesh, plan)
```

A style is a function `style(layer, batch_dim_name) -> dict` that returns
the layout axes of the layer's variables (keyed by variable path) and of
its output (keyed `<layer path>/output`). `column_parallel` and
`row_parallel` realise Megatron's column and row split for `Dense`,
`EinsumDense` and `Embedding`; `prepare_input` and `prepare_output` set
activation layouts without sharding parameters. Any function with the
same signature may appear in a plan.

Nothing here depends on a backend: the result is a `LayoutMap` that any
backend's `ModelParallel` accepts.
"""

import collections
import functools
import re

from keras.src.api_export import keras_export
from keras.src.distribution import layout_composition
from keras.src.distribution.layout_composition import layer_path
from keras.src.layers.core.dense import Dense
from keras.src.layers.core.einsum_dense import EinsumDense
from keras.src.layers.core.embedding import Embedding
from keras.src.layers.core.input_layer import InputLayer
from keras.src.layers.layer import Layer

# The letters of an `EinsumDense` equation.
_EinsumSpec = collections.namedtuple(
    "_EinsumSpec", ["inputs", "kernel", "output", "output_left_elided"]
)


@keras_export("keras.distribution.column_parallel")
def column_parallel(axis="model", *, gather_output=False):
    """Returns a style that splits a layer's output features over `axis`.

    Megatron's column split: a `Dense` kernel `(in, out)` is sharded on
    `out`, as is its bias, and the output stays sharded on its last
    dimension, ready for a `row_parallel` layer. An `EinsumDense` is split
    on the first kernel dimension that appears in the output but not in
    the input (the heads of an attention projection). An `Embedding` is
    split on its embedding dimension.

    Args:
        axis: the mesh axis to split over.
        gather_output: if `True`, the output is replicated over `axis`
            (gathered) instead of sharded.

    Returns:
        A style: a function `(layer, batch_dim_name) -> dict` for a plan.
        Applied by `tensor_parallel_layouts`, it raises a `ValueError`
        naming a layer it cannot split: not a `Dense`, `EinsumDense` or
        `Embedding`, quantized, or not built.
    """
    return functools.partial(
        column_parallel_layouts, axis=axis, gather_output=gather_output
    )


@keras_export("keras.distribution.row_parallel")
def row_parallel(axis="model"):
    """Returns a style that splits a layer's input features over `axis`.

    Megatron's row split: a `Dense` kernel `(in, out)` is sharded on `in`,
    the bias is replicated, and the output (a sum of per-shard partial
    products) is replicated over `axis`. An `EinsumDense` is split on the
    first contracted kernel dimension; an `Embedding` on its vocabulary.

    Args:
        axis: the mesh axis to split over.

    Returns:
        A style: a function `(layer, batch_dim_name) -> dict` for a plan.
        Applied by `tensor_parallel_layouts`, it raises a `ValueError`
        naming a layer it cannot split: not a `Dense`, `EinsumDense` or
        `Embedding`, quantized, or not built.
    """
    return functools.partial(row_parallel_layouts, axis=axis)


@keras_export("keras.distribution.prepare_output")
def prepare_output(axes):
    """Returns a style that sets a layer's output layout, and nothing else.

    Args:
        axes: the layout axes of the output, one entry per output
            dimension (e.g. `("batch", None, None)`).

    Returns:
        A style: a function `(layer, batch_dim_name) -> dict` for a plan.
        Applied by `tensor_parallel_layouts`, it raises a `ValueError` when
        `axes` does not have the rank of the layer's output.
    """
    return functools.partial(output_layouts, axes=tuple(axes))


@keras_export("keras.distribution.prepare_input")
def prepare_input(axes):
    """Returns a style that sets the layout of a layer's inputs.

    Keras applies layouts to layer outputs, so the layout is set on the
    output of each layer that feeds this one in a functional model. An
    input that is a model input, or that comes from an operation which is
    not a layer, cannot be annotated.

    Args:
        axes: the layout axes of each input of the layer.

    Returns:
        A style: a function `(layer, batch_dim_name) -> dict` for a plan.
        Applied by `tensor_parallel_layouts`, it raises a `ValueError` when
        the layer has no recorded inputs (outside a functional model), or
        an input comes from a model input or a non-layer operation, or has
        another rank than `axes`.
    """
    return functools.partial(input_layouts, axes=tuple(axes))


@keras_export("keras.distribution.tensor_parallel_layouts")
def tensor_parallel_layouts(model, device_mesh, plan, *, batch_dim_name=None):
    """Applies a tensor-parallel plan to a model and returns a `LayoutMap`.

    Each key of `plan` is a regex that must `re.fullmatch` the path of at
    least one layer of `model`; each value is a style (`column_parallel`,
    `row_parallel`, `prepare_input`, `prepare_output`, or any function
    `(layer, batch_dim_name) -> dict`). The result holds an exact key for
    each variable and output the styles lay out, and is checked against
    every variable of the model.

    Args:
        model: a built Keras model, or an abstract one (built under
            `keras.StatelessScope()`).
        device_mesh: the `DeviceMesh`.
        plan: dict from layer path pattern to style.
        batch_dim_name: the mesh axis that splits the batch of layer
            outputs. Defaults to the mesh's first axis, as in
            `ModelParallel`; a style never shards the batch over its own
            axis.

    Returns:
        A `LayoutMap`.

    Raises:
        ValueError: when a pattern matches no layer, a layer matches two
            patterns, two styles give one key different layouts, or a
            layout does not fit a variable.
    """
    if batch_dim_name is None:
        batch_dim_name = device_mesh.axis_names[0]
    layers = {
        layer_path(layer): layer
        for layer in layout_composition.called_layers(model)
    }
    entries = {}
    for pattern, layer in _planned_layers(plan, layers):
        style = plan[pattern]
        for key, axes in style(layer, batch_dim_name).items():
            axes = layout_composition.normalize_axes(axes)
            if key in entries and entries[key] != axes:
                raise ValueError(
                    f"Conflicting layouts for '{key}' on mesh "
                    f"{device_mesh}: layout axes {entries[key]} and "
                    f"{axes} (from plan key {pattern!r})."
                )
            entries[key] = axes
    layout_map = layout_composition.build_layout_map(device_mesh, entries)
    layout_composition.check_layouts(model, layout_map)
    return layout_map


def _planned_layers(plan, layers):
    """`(plan key, layer)` for each layer a plan key matches.

    Raises:
        ValueError: when a key matches no layer (listing the layer paths),
            or a layer matches two keys.
    """
    claimed = {}
    for pattern in plan:
        matched = [path for path in layers if re.fullmatch(pattern, path)]
        if not matched:
            raise ValueError(
                f"The plan key {pattern!r} matches no layer of the model. "
                f"Layer paths: {list(layers)}"
            )
        for path in matched:
            if path in claimed:
                raise ValueError(
                    f"Layer '{path}' matches two plan keys: "
                    f"{claimed[path]!r} and {pattern!r}."
                )
            claimed[path] = pattern
            yield pattern, layers[path]


def column_parallel_layouts(layer, batch_dim_name, axis, gather_output=False):
    """The layouts of `column_parallel` for one layer (see there)."""
    batch = _batch_entry(batch_dim_name, axis)
    output_rank = _output_rank(layer)
    if isinstance(layer, Embedding):
        return _with_output(
            {_variable_path(layer, "embeddings"): (None, axis)},
            layer,
            output_rank,
            -1,
            None if gather_output else axis,
            batch,
        )
    if isinstance(layer, EinsumDense):
        spec = _einsum_spec(layer)
        letters = [
            c for c in spec.kernel if c in spec.output and c not in spec.inputs
        ]
        if not letters:
            raise ValueError(_einsum_error(layer, "no output-only dimension"))
        letter = letters[0]
        entries = {
            _variable_path(layer, "kernel"): _kernel_axes(spec, letter, axis)
        }
        bias_axes = _einsum_bias_axes(layer, spec, letter, axis)
        if bias_axes is not None:
            entries[_variable_path(layer, "bias")] = bias_axes
        return _with_output(
            entries,
            layer,
            output_rank,
            _einsum_output_dim(spec, letter),
            None if gather_output else axis,
            batch,
        )
    _check_dense(layer, "column_parallel")
    entries = {_variable_path(layer, "kernel"): (None, axis)}
    if layer.use_bias:
        entries[_variable_path(layer, "bias")] = (axis,)
    return _with_output(
        entries,
        layer,
        output_rank,
        -1,
        None if gather_output else axis,
        batch,
    )


def row_parallel_layouts(layer, batch_dim_name, axis):
    """The layouts of `row_parallel` for one layer (see there)."""
    batch = _batch_entry(batch_dim_name, axis)
    output_rank = _output_rank(layer)
    if isinstance(layer, Embedding):
        entries = {_variable_path(layer, "embeddings"): (axis, None)}
    elif isinstance(layer, EinsumDense):
        spec = _einsum_spec(layer)
        letters = [
            c for c in spec.kernel if c in spec.inputs and c not in spec.output
        ]
        if not letters:
            raise ValueError(_einsum_error(layer, "no contracted dimension"))
        entries = {
            _variable_path(layer, "kernel"): _kernel_axes(
                spec, letters[0], axis
            )
        }
        if layer.bias is not None:
            entries[_variable_path(layer, "bias")] = (None,) * len(
                layer.bias.shape
            )
    else:
        _check_dense(layer, "row_parallel")
        entries = {_variable_path(layer, "kernel"): (axis, None)}
        if layer.use_bias:
            entries[_variable_path(layer, "bias")] = (None,)
    return _with_output(entries, layer, output_rank, None, None, batch)


def output_layouts(layer, batch_dim_name, axes):
    """The layouts of `prepare_output` for one layer (see there)."""
    path = layer_path(layer)
    output_rank = _output_rank(layer)
    if output_rank is not None and len(axes) != output_rank:
        raise ValueError(
            f"prepare_output({axes}) for layer '{path}': the layer output "
            f"has rank {output_rank}, but {len(axes)} axes were given."
        )
    return {f"{path}/output": axes}


def input_layouts(layer, batch_dim_name, axes):
    """The layouts of `prepare_input` for one layer (see there)."""
    path = layer_path(layer)
    nodes = getattr(layer, "_inbound_nodes", None)
    if not nodes:
        raise ValueError(
            f"prepare_input for layer '{path}': the layer has no "
            "recorded inputs. Input layouts can be set in functional "
            "models only; use prepare_output on the layer that produces "
            "the input instead."
        )
    entries = {}
    for node in nodes:
        for tensor in node.arguments.keras_tensors:
            producer = tensor._keras_history.operation
            if not isinstance(producer, Layer) or isinstance(
                producer, InputLayer
            ):
                raise ValueError(
                    f"prepare_input for layer '{path}': its input "
                    f"comes from '{producer.name}', a model input or an "
                    "operation that is not a layer, whose layout cannot be "
                    "set. Model inputs take the distribution's data layout."
                )
            if len(tensor.shape) != len(axes):
                raise ValueError(
                    f"prepare_input({axes}) for layer '{path}': the input "
                    f"from '{layer_path(producer)}' has rank "
                    f"{len(tensor.shape)}, but {len(axes)} axes were given."
                )
            entries[f"{layer_path(producer)}/output"] = axes
    return entries


def _with_output(entries, layer, output_rank, dim, entry, batch):
    """Adds the layer output's layout when its rank is known.

    The batch dimension keeps the batch axis, `dim` (negative or positive)
    gets `entry`, the rest is replicated.
    """
    if not output_rank:
        return entries
    axes = [None] * output_rank
    if dim is not None:
        axes[dim] = entry
    if axes[0] is None:
        axes[0] = batch
    entries[f"{layer_path(layer)}/output"] = tuple(axes)
    return entries


def _batch_entry(batch_dim_name, axis):
    if batch_dim_name == axis:
        return None
    return batch_dim_name


def _variable_path(layer, name):
    for variable in layer.weights:
        if variable.name == name:
            return variable.path
    raise ValueError(
        f"Layer '{layer_path(layer)}' ({type(layer).__name__}) has no "
        f"variable named '{name}'. Build the layer before applying the plan."
    )


def _check_dense(layer, style_name):
    if not isinstance(layer, Dense):
        raise ValueError(
            f"{style_name} supports Dense, EinsumDense and Embedding layers. "
            f"Layer '{layer_path(layer)}' is a {type(layer).__name__}."
        )
    if getattr(layer, "quantization_mode", None) is not None:
        raise ValueError(
            f"{style_name} does not support quantized layers. Layer "
            f"'{layer_path(layer)}' is quantized ({layer.quantization_mode})."
        )


def _output_rank(layer):
    """The rank of the layer output, or `None` when it cannot be known.

    Read from the functional graph, else from the shapes the layer was
    built with.
    """
    for node in getattr(layer, "_inbound_nodes", None) or ():
        if len(node.outputs) == 1:
            return len(node.outputs[0].shape)
    shapes = getattr(layer, "_build_shapes_dict", None)
    if shapes and len(shapes) == 1:
        input_shape = tuple(shapes.values())[0]
        if input_shape is not None:
            return len(layer.compute_output_shape(input_shape))
    return None


def _einsum_spec(layer):
    """Parses an `EinsumDense` equation into input, kernel, output specs."""
    match = re.fullmatch(
        r"(\.\.\.)?([a-zA-Z]+)(\.\.\.)?,([a-zA-Z]+)->(\.\.\.)?([a-zA-Z]+)"
        r"(\.\.\.)?",
        layer.equation.replace(" ", ""),
    )
    if match is None:
        raise ValueError(_einsum_error(layer, "an unsupported equation"))
    return _EinsumSpec(
        inputs=match.group(2),
        kernel=match.group(4),
        output=match.group(6),
        output_left_elided=match.group(5) is not None,
    )


def _kernel_axes(spec, letter, axis):
    return tuple(axis if c == letter else None for c in spec.kernel)


def _einsum_output_dim(spec, letter):
    """The output dimension of `letter`, counted from the end if elided."""
    index = spec.output.index(letter)
    if spec.output_left_elided:
        return index - len(spec.output)
    return index


def _einsum_bias_axes(layer, spec, letter, axis):
    """The bias axes of a column split, or `None` without a bias."""
    if layer.bias is None:
        return None
    bias_letters = layer.bias_axes
    first = min(spec.output.find(c) for c in bias_letters)
    bias_spec = spec.output[first:]
    axes = [
        axis if c == letter and c in bias_letters else None for c in bias_spec
    ]
    axes += [None] * (len(layer.bias.shape) - len(axes))
    return tuple(axes)


def _einsum_error(layer, problem):
    return (
        f"Cannot split EinsumDense layer '{layer_path(layer)}' with equation "
        f"'{layer.equation}': it has {problem}."
    )
