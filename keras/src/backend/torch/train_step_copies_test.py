"""Single-process tests of `train_step_copies`.

A one-process mesh makes every value a DTensor, as on many processes.
"""

import hashlib
import inspect

import numpy as np
import pytest

import keras
from keras.src.backend.torch import distributed_trainer_test
from keras.src.backend.torch import distribution_lib
from keras.src.backend.torch import train_step_copies
from keras.src.backend.torch.trainer import TorchTrainer


def test_upstream_train_step_is_a_copied_one():
    source = inspect.getsource(TorchTrainer.train_step)
    digest = hashlib.sha256(source.encode()).hexdigest()
    assert digest == train_step_copies.installed_train_step_sha256()
    assert digest in train_step_copies.TRAIN_STEP_COPIES, (
        "The installed keras changed `TorchTrainer.train_step`. Copy it "
        "into `train_step_copies` (keeping `y_pred` detached before the "
        "gradients and backward called through `torch.compiler.disable`), "
        f"and add the copy to `TRAIN_STEP_COPIES` under {digest!r}."
    )


def test_the_installed_train_steps_copy_is_used(monkeypatch):
    digest = train_step_copies.installed_train_step_sha256()
    calls = []

    def copy(trainer, eager=False):
        calls.append((trainer, eager))
        return "the copy's step"

    monkeypatch.setitem(train_step_copies.TRAIN_STEP_COPIES, digest, copy)
    step = train_step_copies.train_step_with_detached_predictions("model")
    assert step == "the copy's step" and calls == [("model", False)]
    train_step_copies.train_step_with_detached_predictions("model", eager=True)
    assert calls[-1] == ("model", True)


def test_an_unknown_train_step_runs_as_installed_with_a_warning(
    monkeypatch,
):
    monkeypatch.setattr(
        train_step_copies, "installed_train_step_sha256", lambda: "f" * 64
    )
    model = distributed_trainer_test.make_model(jit_compile=False)
    with pytest.warns(UserWarning) as warned:
        step = train_step_copies.train_step_with_detached_predictions(model)
    assert step == model.train_step
    (message,) = [str(w.message) for w in warned]
    assert f"keras {keras.__version__}'s" in message
    assert "f" * 64 in message


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
        model = distributed_trainer_test.make_model(jit_compile=jit_compile)
        if detached:
            step = train_step_copies.train_step_with_detached_predictions(
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
