"""Single-process tests of sharded checkpoints: keys, round trips, failures.

Multi-process saving, resharding and killed saves are tested in
`integration_tests/checkpoint_test.py`.
"""

import os

import numpy as np
import pytest

import keras
from keras.src.backend.torch import distributed_checkpoint as checkpoint


def sequential():
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8),
            keras.layers.Dropout(0.1, seed=3),
            keras.layers.Dense(2),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def functional():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="up")(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    outputs = keras.layers.Dense(2)(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    return model


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(4)
        self.scale = self.add_weight(shape=(4,), name="scale")

    def call(self, x):
        return self.inner(x) * self.scale


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = keras.layers.Dense(2)

    def call(self, x):
        return self.head(self.block(x))


def subclassed():
    model = Subclassed()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model(np.zeros((1, 4), "float32"))
    return model


def data():
    x = np.linspace(-1, 1, 32, dtype="float32").reshape(8, 4)
    y = np.stack([x.sum(1), x[:, 0] * x[:, 1]], axis=1)
    return x, y


def train(model, epochs=1):
    x, y = data()
    history = model.fit(
        x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0
    )
    return history.history["loss"]


def values(model):
    return {
        key: np.asarray(variable.numpy())
        for key, variable in checkpoint.checkpoint_variables(model).items()
    }


def assert_same_values(actual, expected):
    assert list(actual) == list(expected)
    for key in expected:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


@pytest.mark.parametrize("make", [sequential, functional, subclassed])
def test_keys_are_the_same_for_two_instances(make):
    first, second = make(), make()
    train(first)
    second.optimizer.build(second.trainable_variables)
    first_keys = list(checkpoint.checkpoint_variables(first))
    assert first_keys == list(checkpoint.checkpoint_variables(second))
    assert [v.path for v in first.variables] != [
        v.path for v in second.variables
    ]
    assert len(first_keys) == len(set(first_keys))


def test_keys_follow_the_model_structure():
    model = sequential()
    train(model)
    keys = list(checkpoint.checkpoint_variables(model))
    assert keys == [
        "layers/dense/kernel",
        "layers/dense/bias",
        "layers/dropout/seed_generator_state",
        "layers/dense_1/kernel",
        "layers/dense_1/bias",
        "optimizer/iteration",
        "optimizer/learning_rate",
        "optimizer/layers/dense/kernel/momentum",
        "optimizer/layers/dense/kernel/velocity",
        "optimizer/layers/dense/bias/momentum",
        "optimizer/layers/dense/bias/velocity",
        "optimizer/layers/dense_1/kernel/momentum",
        "optimizer/layers/dense_1/kernel/velocity",
        "optimizer/layers/dense_1/bias/momentum",
        "optimizer/layers/dense_1/bias/velocity",
    ]
    nested = list(checkpoint.checkpoint_variables(subclassed()))
    assert nested[:4] == [
        "block/scale",
        "block/inner/kernel",
        "block/inner/bias",
        "head/kernel",
    ]
    no_optimizer = checkpoint.checkpoint_variables(
        model, include_optimizer=False
    )
    assert list(no_optimizer) == keys[:5]


@pytest.mark.parametrize("make", [sequential, functional, subclassed])
def test_round_trip_into_another_instance(make, tmp_path):
    original = make()
    train(original, epochs=2)
    checkpoint.save_checkpoint(original, tmp_path / "ckpt")
    restored = make()
    checkpoint.load_checkpoint(restored, tmp_path / "ckpt")
    assert_same_values(values(restored), values(original))
    assert int(restored.optimizer.iterations.numpy()) == 4
    # Nothing lost: training goes on exactly as it would have.
    assert train(restored) == train(original)


def test_without_optimizer(tmp_path):
    original = sequential()
    train(original)
    checkpoint.save_checkpoint(
        original, tmp_path / "ckpt", include_optimizer=False
    )
    restored = sequential()
    checkpoint.load_checkpoint(
        restored, tmp_path / "ckpt", include_optimizer=False
    )
    np.testing.assert_array_equal(
        restored.layers[0].kernel.numpy(), original.layers[0].kernel.numpy()
    )
    assert not restored.optimizer.built
    with pytest.raises(ValueError, match="optimizer/iteration"):
        checkpoint.load_checkpoint(restored, tmp_path / "ckpt")


def test_mismatches_are_named(tmp_path):
    checkpoint.save_checkpoint(functional(), tmp_path / "ckpt")
    with pytest.raises(ValueError, match="Missing keys.*layers/dropout"):
        checkpoint.load_checkpoint(sequential(), tmp_path / "ckpt")
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(16)(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    wider = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    wider.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"layers/dense/kernel: saved \(4, 8"):
        checkpoint.load_checkpoint(wider, tmp_path / "ckpt")


def test_unbuilt_model_is_rejected(tmp_path):
    model = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="not built"):
        checkpoint.save_checkpoint(model, tmp_path / "ckpt")


def test_save_replaces_the_previous_checkpoint_whole(tmp_path):
    model = sequential()
    checkpoint.save_checkpoint(model, tmp_path / "ckpt")
    train(model)
    checkpoint.save_checkpoint(model, tmp_path / "ckpt")
    assert os.listdir(tmp_path) == ["ckpt"]
    restored = sequential()
    checkpoint.load_checkpoint(restored, tmp_path / "ckpt")
    assert_same_values(values(restored), values(model))


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = sequential()
    train(model)
    checkpoint.save_checkpoint(model, tmp_path / "ckpt")
    expected = values(model)
    train(model)

    def failing_save(state, storage_writer, **kwargs):
        os.makedirs(storage_writer.path, exist_ok=True)
        with open(os.path.join(storage_writer.path, "__0_0.distcp"), "w"):
            pass
        raise OSError("killed while writing")

    monkeypatch.setattr(checkpoint.dcp, "save", failing_save)
    with pytest.raises(OSError, match="killed while writing"):
        checkpoint.save_checkpoint(model, tmp_path / "ckpt")
    restored = sequential()
    checkpoint.load_checkpoint(restored, tmp_path / "ckpt")
    assert_same_values(values(restored), expected)


def test_load_restores_an_interrupted_replace(tmp_path):
    model = sequential()
    train(model)
    checkpoint.save_checkpoint(model, tmp_path / "ckpt")
    # As if killed between renaming the old folder aside and the new in.
    os.rename(tmp_path / "ckpt", tmp_path / ".ckpt.previous-token")
    restored = sequential()
    checkpoint.load_checkpoint(restored, tmp_path / "ckpt")
    assert_same_values(values(restored), values(model))
    assert os.listdir(tmp_path) == ["ckpt"]
