"""The calls of a model's layers, in order, from one symbolic call.

`traced_calls(model)` runs the model once on abstract inputs (through
`backend.compute_output_spec`, so no memory is touched and the model may
be built under `keras.StatelessScope()`) and records every call of each
layer that owns variables: the layer, its first input and its output.
Tensors are kept, not copied, so two calls that received the same tensor
object can be told apart from two calls that received equal shapes.

This sees inside subclassed layers, which a functional graph does not:
a decoder block's attention and MLP sublayers are recorded as they are
called. It does not see the operations between layer calls.

The recording replaces each such layer's `call` on the instance for the
duration of the trace and restores it afterwards, even on error.
"""

import collections
import functools

from keras.src import backend
from keras.src import tree
from keras.src.backend.common.keras_tensor import KerasTensor
from keras.src.distribution import distribution_lib

LayerCall = collections.namedtuple("LayerCall", ["layer", "input", "output"])

# The sizes that stand in for unknown dimensions of a model's inputs: a
# batch of 2 sequences of 8, enough for every shape to be seen.
TRACE_BATCH_SIZE = 2
TRACE_SEQUENCE_LENGTH = 8


def traced_calls(model, inputs=None):
    """Returns the `LayerCall`s of one symbolic call of `model`, in order.

    A layer that calls sublayers is listed before them.

    Args:
        model: a built Keras model or layer.
        inputs: the structure of `KerasTensor`s (or shapes) to call the
            model on. Defaults to `model.inputs`, with unknown
            dimensions set to `TRACE_BATCH_SIZE` (the first) and
            `TRACE_SEQUENCE_LENGTH` (the others).

    Returns:
        A list of `LayerCall`s.

    Raises:
        ValueError: under a distribution, or when `inputs` is not given
            and the model has no `inputs` (a subclassed model).
    """
    if distribution_lib.distribution() is not None:
        # Under a distribution, variables and layer outputs are laid out
        # on the mesh, which abstract inputs are not.
        raise ValueError(
            f"Cannot trace the layer calls of model '{model.name}' under "
            f"the distribution {distribution_lib.distribution()}: plan "
            "before `set_distribution`, or call "
            "`set_distribution(None)` first."
        )
    inputs = _trace_inputs(model, inputs)
    records = []
    layers = [
        layer
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if layer._trainable_variables or layer._non_trainable_variables
    ]

    def run(*args):
        # A backend may retry the call (torch on the meta device, then on
        # the CPU): only the last, complete call counts.
        records.clear()
        return model.call(*args)

    # An instance may already hold its own `call`: it is put back.
    saved = [(layer, layer.__dict__.get("call")) for layer in layers]
    for layer in layers:
        object.__setattr__(layer, "call", _recording(layer, records))
    try:
        backend.compute_output_spec(run, inputs)
    finally:
        for layer, call in saved:
            if call is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", call)
    return records


def _recording(layer, records):
    """`layer.call`, recording each call into `records`."""
    call = layer.call

    @functools.wraps(call)
    def recorded(*args, **kwargs):
        start = len(records)
        try:
            outputs = call(*args, **kwargs)
        except BaseException:
            # A failed attempt records nothing (the backend may retry).
            del records[start:]
            raise
        first = args[0] if args else next(iter(kwargs.values()), None)
        records.insert(start, LayerCall(layer, first, outputs))
        return outputs

    return recorded


def _trace_inputs(model, inputs):
    if inputs is None:
        inputs = getattr(model, "inputs", None)
        if not inputs:
            raise ValueError(
                f"Model '{model.name}' has no recorded inputs (a subclassed "
                "model). Pass `inputs`: the KerasTensors to call it on."
            )
        inputs = getattr(model, "_inputs_struct", inputs)
    return tree.map_structure(_concrete, inputs)


def _concrete(tensor):
    """A `KerasTensor` like `tensor` with every dimension known."""
    shape = [
        dim
        if dim is not None
        else TRACE_BATCH_SIZE
        if index == 0
        else TRACE_SEQUENCE_LENGTH
        for index, dim in enumerate(tensor.shape)
    ]
    return KerasTensor(tuple(shape), dtype=tensor.dtype)


def shape_of(value):
    """The shape of a traced tensor as a tuple, or `None`."""
    shape = getattr(value, "shape", None)
    return None if shape is None else tuple(shape)
