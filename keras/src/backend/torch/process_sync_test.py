"""Tests of `process_sync` in one process, playing one rank of two.

The other rank's part is written into the store by the test, or played
before on the same store (`play_call_as_rank`). Multi-process behaviour is
tested in `integration_tests/checkpoint_test.py`.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

import keras
from keras.src.backend.torch import distribution_lib
from keras.src.backend.torch import process_sync


class Store:
    """A `HashStore` whose `wait` can be made to time out."""

    def __init__(self):
        self._store = dist.HashStore()
        self.fail_waits = False

    def wait(self, keys, timeout):
        if self.fail_waits:
            raise dist.DistStoreError("wait timeout")
        return self._store.wait(keys, timeout)

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.fixture
def store(monkeypatch):
    store = Store()
    monkeypatch.setattr(process_sync, "_store", lambda: store)
    monkeypatch.setattr(process_sync, "_CALLS", process_sync.CoordinatedCalls())
    monkeypatch.setenv(process_sync.SYNC_TIMEOUT_ENV_VAR, "0.2")
    monkeypatch.setattr(process_sync.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(process_sync, "is_multi_process", lambda: True)
    return store


def play_rank(monkeypatch, rank):
    monkeypatch.setattr(process_sync.dist, "get_rank", lambda: rank)


def enter_as_other_rank(store, rank, operation, index=0, token=""):
    key = process_sync._call_key(index)
    store.set(f"{key}/entered/{rank}", f"{operation}|{token}")
    if process_sync._add_to_count(store, f"{key}/count/{operation}", 1, 2) == 2:
        store.set(f"{key}/all/{operation}", "1")


def test_enter_returns_once_every_process_entered(store, monkeypatch):
    play_rank(monkeypatch, 1)
    enter_as_other_rank(store, 0, "save_model", token="abc")
    call = process_sync.enter("save_model", "m.keras")
    assert call.token == "abc"
    assert call.operation == "save_model"
    assert process_sync._CALLS.count == 1


def test_process_zero_chooses_the_token(store, monkeypatch):
    play_rank(monkeypatch, 0)
    enter_as_other_rank(store, 1, "save_model")
    call = process_sync.enter("save_model")
    assert len(call.token) == 32


def test_enter_alone_fails_with_advice_and_withdraws(store, monkeypatch):
    play_rank(monkeypatch, 0)
    with pytest.raises(RuntimeError) as error:
        process_sync.enter("save_model", "m.keras")
    message = str(error.value)
    assert "`save_model` of 'm.keras' was called on process 0" in message
    assert "process(es) [1] did not call it within 0.2 seconds" in message
    assert "on every process" in message
    assert process_sync.SYNC_TIMEOUT_ENV_VAR in message
    # Withdrawn: the call index is free for the next call of every process.
    assert process_sync._CALLS.count == 0
    key = process_sync._call_key(0)
    assert not store.check([f"{key}/entered/0"])
    enter_as_other_rank(store, 1, "save_model")
    process_sync.enter("save_model", "m.keras")


def test_enter_another_operation_fails_on_every_process(store, monkeypatch):
    play_rank(monkeypatch, 0)
    enter_as_other_rank(store, 1, "load_weights")
    with pytest.raises(RuntimeError, match="process 1 called `load_weights`"):
        process_sync.enter("save_weights")


def test_last_arrival_during_the_timeout_completes_the_call(store, monkeypatch):
    play_rank(monkeypatch, 0)
    enter_as_other_rank(store, 1, "save_model")
    store.fail_waits = True
    call = process_sync.enter("save_model")
    assert process_sync._CALLS.count == 1
    assert call.operation == "save_model"


def play_call_as_rank(monkeypatch, rank, body, operation="save_model"):
    """Plays `rank` in call 0 of `process_zero_writes`, running `body`.

    Both ranks play call 0 in turn on one store, as two processes would.

    Returns:
        Whether this rank was the writer.
    """
    play_rank(monkeypatch, rank)
    monkeypatch.setattr(process_sync, "_CALLS", process_sync.CoordinatedCalls())
    with process_sync.process_zero_writes(operation, "m.keras") as call:
        body(call)
    return call.is_writer


def fail_writing(call):
    if call.is_writer:
        raise OSError("disk full")


def test_the_writers_error_reaches_every_process(store, monkeypatch):
    enter_as_other_rank(store, 1, "save_model")
    # Process 0 re-raises its own error ...
    with pytest.raises(OSError, match="disk full"):
        play_call_as_rank(monkeypatch, 0, fail_writing)
    # ... and the other process learns it when it leaves the call.
    with pytest.raises(RuntimeError) as error:
        play_call_as_rank(monkeypatch, 1, fail_writing)
    assert str(error.value) == (
        "Process 0 failed in `save_model` of 'm.keras': OSError: disk full"
    )


def test_every_process_returns_once_the_writer_succeeded(store, monkeypatch):
    enter_as_other_rank(store, 1, "save_model")
    tokens = []
    assert play_call_as_rank(monkeypatch, 0, lambda c: tokens.append(c.token))
    assert not play_call_as_rank(
        monkeypatch, 1, lambda c: tokens.append(c.token)
    )
    # One token, chosen by process 0, on every process.
    assert len(tokens[0]) == 32 and tokens[0] == tokens[1]


def test_a_process_that_does_not_enter_fails_the_others(store, monkeypatch):
    # Process 1 never enters: process 0 fails within the sync timeout, with
    # the message of `enter`, before running the body.
    bodies = []
    start = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        play_call_as_rank(monkeypatch, 0, bodies.append)
    elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 5
    assert not bodies
    message = str(error.value)
    assert message.startswith(
        "`save_model` of 'm.keras' was called on process 0, but process(es) "
        "[1] did not call it within 0.2 seconds. Under a multi-process "
        "distribution, call saving and loading functions on every process"
    )
    assert process_sync.SYNC_TIMEOUT_ENV_VAR in message
    assert not store.check([f"{process_sync._call_key(0)}/outcome"])


def test_a_writer_that_does_not_finish_fails_the_others(store, monkeypatch):
    monkeypatch.setenv(distribution_lib.TIMEOUT_ENV_VAR, "0.3")
    enter_as_other_rank(store, 0, "save_model")
    start = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        play_call_as_rank(monkeypatch, 1, lambda call: None)
    assert 0.3 <= time.monotonic() - start < 5
    assert str(error.value) == (
        "Process 0 did not finish `save_model` of 'm.keras' within 0.3 seconds."
    )


def test_a_non_writers_own_error_does_not_wait(store, monkeypatch):
    enter_as_other_rank(store, 0, "save_model")

    def fail(call):
        raise ValueError("gather failed")

    with pytest.raises(ValueError, match="gather failed"):
        play_call_as_rank(monkeypatch, 1, fail)
    # Process 0's outcome was never stored: process 1 did not wait for it.
    assert not store.check([f"{process_sync._call_key(0)}/outcome"])


def test_keys_of_finished_calls_are_deleted(store, monkeypatch):
    play_rank(monkeypatch, 0)
    enter_as_other_rank(store, 1, "save_model", index=0)
    process_sync.enter("save_model")
    enter_as_other_rank(store, 1, "load_model", index=1)
    process_sync.enter("load_model")
    key = process_sync._call_key(0)
    assert not store.check([f"{key}/entered/0"])
    assert not store.check([f"{key}/count/save_model"])


# Run in a fresh interpreter: earlier tests of a suite leave a one-device
# process group initialized, which this check must not see.
SINGLE_PROCESS_CHECK = """
import json
import torch.distributed as dist
import keras
from keras.src.backend.torch import process_sync

result = {"file": process_sync.__file__}
result["initialized"] = dist.is_initialized()
result["multi_process"] = process_sync.is_multi_process()
result["process_id"] = process_sync.process_id()
with process_sync.process_zero_writes("op") as call:
    result["is_writer"] = call.is_writer
    result["is_coordinated"] = call.is_coordinated
    result["token_length"] = len(call.token)
try:
    with process_sync.process_zero_writes("op"):
        raise OSError("disk full")
except OSError as error:
    result["raised"] = str(error)
result["initialized_after"] = dist.is_initialized()
print(json.dumps(result))
"""


def test_single_process_needs_no_coordination():
    # The keras this test imported, wherever it was imported from.
    keras_root = os.path.dirname(os.path.dirname(keras.__file__))
    path = [keras_root] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    completed = subprocess.run(
        [sys.executable, "-c", SINGLE_PROCESS_CHECK],
        env=dict(
            os.environ, KERAS_BACKEND="torch", PYTHONPATH=os.pathsep.join(path)
        ),
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    # The fresh interpreter ran this checkout's module, with no process
    # group before or after: no store, nothing to coordinate.
    assert result.pop("file") == process_sync.__file__
    assert result == {
        "initialized": False,
        "multi_process": False,
        "process_id": 0,
        "is_writer": True,
        "is_coordinated": False,
        "token_length": 32,
        "raised": "disk full",
        "initialized_after": False,
    }
