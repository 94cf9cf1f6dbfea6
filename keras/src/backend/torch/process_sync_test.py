"""Tests of `process_sync` in one process, playing one rank of two.

The other rank's part is written into the store by the test. Multi-process
behaviour is tested in `integration_tests/checkpoint_test.py`.
"""

import pytest
import torch.distributed as dist

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
    monkeypatch.setattr(
        process_sync, "_CALLS", {"count": 0, "previous_operation": None}
    )
    monkeypatch.setenv(process_sync.SYNC_TIMEOUT_ENV_VAR, "0.2")
    monkeypatch.setattr(process_sync.dist, "get_world_size", lambda: 2)
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
    assert process_sync._CALLS["count"] == 1


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
    assert process_sync._CALLS["count"] == 0
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
    assert process_sync._CALLS["count"] == 1
    assert call.operation == "save_model"


def test_outcome_of_process_zero(store, monkeypatch):
    play_rank(monkeypatch, 0)
    enter_as_other_rank(store, 1, "save_model")
    call = process_sync.enter("save_model", "m.keras")
    process_sync.share_outcome(call)
    process_sync.wait_for_outcome(call)
    process_sync.share_outcome(call, OSError("disk full"))
    with pytest.raises(RuntimeError, match="OSError: disk full"):
        process_sync.wait_for_outcome(call)


def test_keys_of_finished_calls_are_deleted(store, monkeypatch):
    play_rank(monkeypatch, 0)
    enter_as_other_rank(store, 1, "save_model", index=0)
    process_sync.enter("save_model")
    enter_as_other_rank(store, 1, "load_model", index=1)
    process_sync.enter("load_model")
    key = process_sync._call_key(0)
    assert not store.check([f"{key}/entered/0"])
    assert not store.check([f"{key}/count/save_model"])


def test_single_process_needs_no_coordination():
    assert process_sync.run_on_process_zero(lambda: 5, "op") == 5
    if not dist.is_initialized():
        assert not process_sync.is_multi_process()
        assert process_sync.process_id() == 0
