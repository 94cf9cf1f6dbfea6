"""The edits that keep collectives in lockstep, on one process.

`set_distribution` converts the distribution's mesh (so that reading
`backend_mesh` later communicates nothing) and shares the seed only where
`initialize` did not; an error ending a trainer call under a multi-process
distribution names the call. The multi-process behaviour is tested in
`integration_tests/lockstep_test.py`.
"""

import numpy as np
import pytest

import keras
from keras.src.backend.torch import distribution_lib
from keras_dtensor import _step_edits


@pytest.fixture
def data_parallel():
    distribution = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()
    )
    yield distribution
    keras.distribution.set_distribution(None)


def test_set_distribution_converts_the_mesh(data_parallel):
    mesh = data_parallel.device_mesh
    assert not hasattr(mesh, "_backend_mesh")
    keras.distribution.set_distribution(data_parallel)
    assert hasattr(mesh, "_backend_mesh")


def test_scope_goes_through_the_edited_set_distribution(data_parallel):
    with data_parallel.scope():
        assert hasattr(data_parallel.device_mesh, "_backend_mesh")
    assert keras.distribution.distribution() is None


def test_no_note_without_a_multi_process_distribution(data_parallel):
    assert _step_edits.collective_failure_note("fit") is None
    keras.distribution.set_distribution(data_parallel)
    assert _step_edits.collective_failure_note("fit") is None


class Failing(keras.layers.Layer):
    """Raises what gloo raises when a peer died, once called on values."""

    def call(self, inputs):
        raise RuntimeError("Connection closed by peer")

    def compute_output_shape(self, input_shape):
        return input_shape


def test_trainer_error_names_the_call(data_parallel, monkeypatch):
    keras.distribution.set_distribution(data_parallel)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.add(Failing())
    monkeypatch.setattr(distribution_lib, "num_processes", lambda: 2)
    with pytest.raises(RuntimeError) as error:
        model.predict_on_batch(np.ones((4, 3), "float32"))
    assert error.value.__notes__ == [
        "Raised in `predict_on_batch` on process 0 of 2. If a collective "
        "failed: under a multi-process distribution every process must "
        "call `predict_on_batch`, in the same order; a collective fails after "
        "KERAS_DTENSOR_TIMEOUT_SECONDS seconds when a process died or "
        "skipped the call (e.g. `if process_id == 0:`)."
    ]


def test_other_errors_get_no_note(data_parallel, monkeypatch):
    keras.distribution.set_distribution(data_parallel)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    monkeypatch.setattr(distribution_lib, "num_processes", lambda: 2)
    with pytest.raises(ValueError) as error:
        model.predict_on_batch(np.ones((4, 5), "float32"))
    assert not getattr(error.value, "__notes__", [])
