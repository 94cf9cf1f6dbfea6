"""Tests for remat.py: activation recomputation chosen by layer path."""

import numpy as np
import pytest
import torch

from keras.src import layers
from keras.src import models
from keras.src import utils
from keras.src.backend.common.remat import RematScope
from keras.src.distribution import remat

# Calls of `CountingBlock.call`, split by whether autograd's backward pass
# was running (a recomputation) or not.
CALLS = {"forward": 0, "backward": 0}


class CountingBlock(layers.Layer):
    """A residual MLP block that counts its calls."""

    def __init__(self, dropout=None, **kwargs):
        super().__init__(**kwargs)
        self.up = layers.Dense(16, activation="relu", name="up")
        self.dropout = dropout
        self.down = layers.Dense(8, name="down")

    def call(self, x, training=None):
        in_backward = torch._C._current_graph_task_id() != -1
        CALLS["backward" if in_backward else "forward"] += 1
        h = self.up(x)
        if self.dropout is not None:
            h = self.dropout(h, training=training)
        return x + self.down(h)


def build_model(dropout_seed=False, blocks=2):
    """Two blocks in a functional model; equal weights on every build."""
    utils.set_random_seed(7)
    inputs = layers.Input((8,), name="features")
    x = inputs
    for i in range(blocks):
        dropout = None
        if dropout_seed is not False:
            dropout = layers.Dropout(0.5, seed=dropout_seed, name="drop")
        x = CountingBlock(dropout, name=f"block_{i}")(x)
    outputs = layers.Dense(3, name="head")(x)
    return models.Model(inputs, outputs, name="net")


def gradients(model, seed=11):
    """One forward and backward pass; returns (loss, gradients, calls)."""
    CALLS.update(forward=0, backward=0)
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    utils.set_random_seed(seed)
    outputs = model(torch.from_numpy(x), training=True)
    loss = (outputs**2).mean()
    loss.backward()
    grads = [v.value.grad.detach().numpy() for v in model.trainable_weights]
    return float(loss.detach()), grads, dict(CALLS)


def test_returns_the_matched_paths_and_sets_keras_full_mode():
    model = build_model()
    paths = remat.remat_layers(model, r"block_\d+")
    assert paths == ["block_0", "block_1"]
    with RematScope(mode="full"):
        expected = layers.Dense(1)._remat_mode
    for path in paths:
        assert model.get_layer(path)._remat_mode == expected
    assert model.get_layer("head")._remat_mode is None
    assert model.get_layer("block_0").up._remat_mode is None


def test_nested_paths_and_several_patterns():
    model = build_model()
    paths = remat.remat_layers(model, [r"block_0/up", r"block_1/(up|down)"])
    assert sorted(paths) == ["block_0/up", "block_1/down", "block_1/up"]
    assert model.get_layer("block_0")._remat_mode is None
    assert model.get_layer("block_0").up._remat_mode is not None
    assert model.get_layer("block_0").down._remat_mode is None


def test_patterns_fullmatch():
    model = build_model()
    # "block" alone matches no path: a full match is needed.
    with pytest.raises(ValueError, match="match no layer path"):
        remat.remat_layers(model, "block")
    assert remat.remat_layers(model, "block_1") == ["block_1"]


def test_unmatched_pattern_lists_the_layer_paths():
    model = build_model()
    with pytest.raises(ValueError) as info:
        remat.remat_layers(model, [r"block_\d+", r"decoder_\d+/mlp"])
    message = str(info.value)
    assert "decoder_\\\\d+/mlp" in message or r"decoder_\d+/mlp" in message
    assert "block_\\\\d+" not in message
    for path in ("block_0", "block_0/up", "block_1/down", "head"):
        assert f"'{path}'" in message
    # Nothing was changed.
    assert model.get_layer("block_0")._remat_mode is None


@pytest.mark.parametrize("patterns", ["block_(", [], [3]])
def test_invalid_patterns(patterns):
    with pytest.raises(ValueError, match="patterns"):
        remat.remat_layers(build_model(), patterns)


def test_seeded_random_layer_is_refused():
    model = build_model(dropout_seed=3)
    with pytest.raises(ValueError, match="'block_0'.*seeded SeedGenerator"):
        remat.remat_layers(model, r"block_\d+")
    assert model.get_layer("block_0")._remat_mode is None


def test_matched_layers_recompute_in_backward():
    model = build_model()
    _, _, calls = gradients(model)
    assert calls == {"forward": 2, "backward": 0}
    remat.remat_layers(model, "block_1")
    _, _, calls = gradients(model)
    assert calls == {"forward": 2, "backward": 1}
    remat.remat_layers(model, r"block_\d+")
    _, _, calls = gradients(model)
    assert calls == {"forward": 2, "backward": 2}


@pytest.mark.parametrize("dropout_seed", [False, None])
def test_gradients_equal_the_model_without_remat(dropout_seed):
    # dropout_seed=None: an unseeded Dropout in each block, drawn from
    # torch's generator, whose state the recomputation restores.
    loss, grads, _ = gradients(build_model(dropout_seed))
    model = build_model(dropout_seed)
    remat.remat_layers(model, r"block_\d+")
    remat_loss, remat_grads, calls = gradients(model)
    assert calls["backward"] == 2
    assert remat_loss == loss
    assert len(remat_grads) == len(grads) == 10
    for expected, actual in zip(grads, remat_grads):
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-7)


def test_fit_trains_as_without_remat():
    x = np.random.default_rng(1).normal(size=(16, 8)).astype("float32")
    y = np.random.default_rng(2).normal(size=(16, 3)).astype("float32")
    histories = []
    for use_remat in (False, True):
        model = build_model()
        if use_remat:
            remat.remat_layers(model, r"block_\d+")
        model.compile(optimizer="sgd", loss="mse")
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        histories.append(history.history["loss"])
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-6)
