"""Tests for layer_calls.py: the layer calls of one symbolic model call."""

import pytest

from keras.src import backend
from keras.src import layers
from keras.src import models
from keras.src import ops
from keras.src.distribution import distribution_lib
from keras.src.distribution import layer_calls
from keras.src.distribution.distribution_lib import DeviceMesh


class Pair(layers.Layer):
    """Two projections of one input, then a third of their product."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a = layers.Dense(8, name="a")
        self.b = layers.Dense(8, name="b")
        self.c = layers.Dense(4, name="c")

    def call(self, x):
        return self.c(self.a(x) * self.b(x))


class Failing(layers.Layer):
    """Fails once `fail` is set (after the functional model is built)."""

    fail = False

    def call(self, x):
        if self.fail:
            raise RuntimeError("no call")
        return x


def model_of(block):
    inputs = layers.Input((None, 4), name="x")
    norm = layers.LayerNormalization(name="norm")
    return models.Model(inputs, block(norm(inputs)))


def test_sublayer_calls_in_order_with_shared_inputs():
    with backend.StatelessScope():
        model = model_of(Pair(name="pair"))
        calls = layer_calls.traced_calls(model)
    assert [call.layer.path for call in calls] == [
        "norm",
        "pair/a",
        "pair/b",
        "pair/c",
    ]
    assert calls[1].input is calls[2].input is calls[0].output
    assert calls[3].input is not calls[1].input
    # Unknown dimensions take the trace's batch and sequence sizes.
    assert layer_calls.shape_of(calls[3].output) == (
        layer_calls.TRACE_BATCH_SIZE,
        layer_calls.TRACE_SEQUENCE_LENGTH,
        4,
    )
    for layer in model._flatten_layers():
        assert "call" not in layer.__dict__


def test_call_restored_after_a_failed_trace_and_own_call_kept():
    model = model_of(Failing(name="failing"))
    model.get_layer("failing").fail = True
    norm = model.get_layer("norm")

    def own_call(x):
        return ops.copy(x)

    object.__setattr__(norm, "call", own_call)
    with pytest.raises(RuntimeError, match="no call"):
        layer_calls.traced_calls(model)
    assert norm.__dict__["call"] is own_call
    assert "call" not in model.get_layer("failing").__dict__


def test_explicit_inputs_for_a_subclassed_model():
    pair = Pair(name="pair")
    pair(ops.ones((2, 3, 4)))
    with pytest.raises(ValueError, match="no recorded inputs"):
        layer_calls.traced_calls(pair)
    calls = layer_calls.traced_calls(pair, backend.KerasTensor((None, 3, 4)))
    assert [call.layer.name for call in calls] == ["a", "b", "c"]


def test_refused_under_a_distribution():
    model = model_of(Pair(name="pair"))
    mesh = DeviceMesh((1,), ("batch",), ["cpu:0"])
    distribution_lib.set_distribution(distribution_lib.DataParallel(mesh))
    try:
        with pytest.raises(ValueError, match="plan before `set_distribution`"):
            layer_calls.traced_calls(model)
    finally:
        distribution_lib.set_distribution(None)
