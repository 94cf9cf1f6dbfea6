"""Coordination of processes for saving and loading with the torch backend.

Saving and loading a distributed model are SPMD operations: every process
calls them, in the same order. The helpers here check that through the
`torch.distributed` store, with a bounded wait, and let process 0 tell the
other processes how the part of the work that only it does (writing a
file) ended. They issue no collectives: a process that calls a save alone
gets a clear error instead of a hang, and the process group stays usable.

Two entry points: `enter`, for a call that every process must make (a
load), and `process_zero_writes`, the context manager for a call in which
every process takes part and process 0 alone writes (a save, a checkpoint,
a callback's files).
"""

import contextlib
import datetime
import os
import uuid

import torch.distributed as dist

from keras.src.backend.torch import process_group
from keras.src.backend.torch import torch_runtime

SYNC_TIMEOUT_ENV_VAR = "KERAS_DTENSOR_SYNC_TIMEOUT_SECONDS"
DEFAULT_SYNC_TIMEOUT_SECONDS = 60
_KEY_PREFIX = "keras_io"


class CoordinatedCalls:
    """The coordinated calls this process has made so far.

    Every process makes the same calls in the same order, so equal counts
    name one call.

    Attributes:
        count: how many calls this process has entered.
        previous_operation: the operation of the last one, or None.
    """

    def __init__(self):
        self.count = 0
        self.previous_operation = None


# This process's calls, per process. Not in keras's `global_state`: that
# is per thread (a save from another thread would count apart) and
# `clear_session` clears it, while the call indices must stay in step
# with the other processes'.
_CALLS = CoordinatedCalls()


class CollectiveCall:
    """A save or load that every process has entered (see `enter`).

    Attributes:
        key: the store key prefix of the call (`None` without several
            processes).
        operation: the name of the call, e.g. `"save_model"`.
        target: the file or folder it works on, for messages.
        token: a random string chosen by process 0, equal on every process.
        is_writer: whether this process writes (process 0).
    """

    def __init__(self, key, operation, target, token, is_writer):
        self.key = key
        self.operation = operation
        self.target = target
        self.token = token
        self.is_writer = is_writer

    @property
    def is_coordinated(self):
        """Whether other processes take part (several processes)."""
        return self.key is not None

    def describe(self):
        if self.target is None:
            return f"`{self.operation}`"
        return f"`{self.operation}` of '{self.target}'"


def is_multi_process():
    """Returns whether the default process group has several processes."""
    return (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


def process_id():
    """Returns the rank of this process (0 without a process group)."""
    return process_group.process_id()


def sync_timeout():
    """Returns how long a process waits for the others to enter a call.

    Read from `KERAS_DTENSOR_SYNC_TIMEOUT_SECONDS` (default 60 seconds),
    and never longer than the process group timeout.
    """
    seconds = float(
        os.environ.get(SYNC_TIMEOUT_ENV_VAR, DEFAULT_SYNC_TIMEOUT_SECONDS)
    )
    return min(datetime.timedelta(seconds=seconds), process_group.timeout())


def enter(operation, target=None):
    """Waits until every process has entered the same call.

    Every process states that it entered `operation`; the call returns once
    all have, or raises after `sync_timeout()` naming the processes that did
    not, or that entered another operation. Nothing else is communicated,
    so a failed call leaves the process group usable.

    Args:
        operation: the name of the call, e.g. `"save_model"`. Every process
            must enter the same operation.
        target: the file or folder of the call, named in error messages.

    Returns:
        A `CollectiveCall`.

    Raises:
        RuntimeError: on every process that entered, if some process did
            not enter `operation` within the timeout.
    """
    store = _store()
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    index = _CALLS.count
    key = _call_key(index)
    token = uuid.uuid4().hex if rank == 0 else ""
    call = CollectiveCall(key, operation, target, token, rank == 0)
    store.set(f"{key}/entered/{rank}", f"{operation}|{token}")
    # Counting per operation: processes in different calls never complete.
    count_key = f"{key}/count/{operation}"
    if _add_to_count(store, count_key, 1, world_size) == world_size:
        store.set(f"{key}/all/{operation}", "1")
    timeout = sync_timeout()
    try:
        store.wait([f"{key}/all/{operation}"], timeout)
    except dist.DistStoreError:
        # Withdraw, unless the last process arrived in the meantime; the
        # call index is then free again, for the next call of every process.
        if _add_to_count(store, count_key, -1, world_size) < world_size:
            message = _not_entered_message(
                store, call, rank, world_size, timeout
            )
            store.delete_key(f"{key}/entered/{rank}")
            raise RuntimeError(message) from None
    _CALLS.count += 1
    call.token = store.get(f"{key}/entered/0").decode().rpartition("|")[2]
    _delete_call_keys(store, index - 1, rank)
    _CALLS.previous_operation = operation
    return call


@contextlib.contextmanager
def process_zero_writes(operation, target=None):
    """Every process enters, process 0 writes, all learn the outcome.

    The protocol of every save, checkpoint and callback write:

    1. Every process enters `operation` (`enter`), through the
       `torch.distributed` store: it waits at most `sync_timeout()`
       (`KERAS_DTENSOR_SYNC_TIMEOUT_SECONDS`, default 60 seconds, capped by
       the process group timeout). If a process does not enter, or enters
       another operation, every process that entered raises.
    2. Every process runs the `with` body: the part all must do (gathering
       sharded values), and the writing only where `call.is_writer`.
    3. Process 0 stores how its body ended, success or its exception's
       type and message, then re-raises any exception. The others wait for
       that at most the process group timeout
       (`KERAS_DTENSOR_TIMEOUT_SECONDS`) and raise if process 0 failed or
       did not finish; one whose own body raised re-raises without waiting.

    Only the store is used, no collectives: a process that saves alone gets
    an error instead of a hang, and the process group stays usable. With a
    single process nothing is communicated; the body runs as the writer.

    ```python
    with process_sync.process_zero_writes("save_model", path) as call:
        data = gather_values()  # every process
        if call.is_writer:
            write(path, data)  # process 0 only
    ```

    Args:
        operation: the name of the call, e.g. `"save_model"`; every process
            enters the same operations in the same order.
        target: the file or folder of the call, named in error messages.

    Returns:
        A context manager giving a `CollectiveCall`: `is_writer`, and
        `token`, a random string equal on every process.

    Raises:
        RuntimeError: on entering, if a process did not enter within
            `sync_timeout()`; on leaving, on processes other than 0, if
            process 0's body raised or did not finish in time.
    """
    if not is_multi_process():
        yield CollectiveCall(
            None, operation, target, uuid.uuid4().hex, process_id() == 0
        )
        return
    call = enter(operation, target)
    try:
        yield call
    except BaseException as error:
        if call.is_writer:
            _share_outcome(call, error)
        raise
    if call.is_writer:
        _share_outcome(call)
    else:
        _wait_for_outcome(call)


def _share_outcome(call, error=None):
    """Tells the other processes how process 0's part of `call` ended.

    Args:
        call: the `CollectiveCall` returned by `enter`.
        error: the exception process 0 raised, or `None` on success.
    """
    message = "" if error is None else f"{type(error).__name__}: {error}"
    _store().set(f"{call.key}/outcome", f"|{message}")


def _wait_for_outcome(call):
    """Waits for process 0's part of `call`; raises if it failed.

    Args:
        call: the `CollectiveCall` returned by `enter`.

    Raises:
        RuntimeError: if process 0 failed, or did not finish within the
            process group timeout.
    """
    store = _store()
    timeout = process_group.timeout()
    try:
        store.wait([f"{call.key}/outcome"], timeout)
    except dist.DistStoreError:
        raise RuntimeError(
            f"Process 0 did not finish {call.describe()} within "
            f"{timeout.total_seconds():g} seconds."
        ) from None
    message = store.get(f"{call.key}/outcome").decode()[1:]
    if message:
        raise RuntimeError(f"Process 0 failed in {call.describe()}: {message}")


def _store():
    return torch_runtime.default_store()


def _call_key(index):
    # Workers restarted by torchrun get new stores; the restart count keeps
    # keys apart should a store outlive a restart.
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"{_KEY_PREFIX}/{restart}/{index}"


def _add_to_count(store, key, delta, world_size):
    """Atomically adds `delta` to the count at `key`, unless it is complete.

    Returns:
        The count after the update, or `world_size` if it was complete.
    """
    # Values carry a random suffix so that `compare_set` tells a successful
    # update from a concurrent one that stored the same count.
    current = store.compare_set(key, "", "0:").decode()
    while True:
        count = int(current.partition(":")[0])
        if count >= world_size:
            return count
        desired = f"{count + delta}:{uuid.uuid4().hex}"
        current = store.compare_set(key, current, desired).decode()
        if current == desired:
            return count + delta


def _not_entered_message(store, call, rank, world_size, timeout):
    entered = {}
    for r in range(world_size):
        if store.check([f"{call.key}/entered/{r}"]):
            value = store.get(f"{call.key}/entered/{r}").decode()
            entered[r] = value.rpartition("|")[0]
    others = {r: op for r, op in entered.items() if op != call.operation}
    missing = [r for r in range(world_size) if r not in entered]
    message = f"{call.describe()} was called on process {rank}, but "
    parts = []
    if missing:
        parts.append(f"process(es) {missing} did not call it")
    if others:
        calls = ", ".join(
            f"process {r} called `{op}`" for r, op in others.items()
        )
        parts.append(calls)
    message += " and ".join(parts)
    message += (
        f" within {timeout.total_seconds():g} seconds. Under a multi-process "
        "distribution, call saving and loading functions on every process, "
        "in the same order, as SPMD code does (remove any "
        "`if process_id == 0:` guard): every process takes part in "
        "gathering and scattering sharded values, and only process 0 writes "
        f"files. The wait is set by {SYNC_TIMEOUT_ENV_VAR}."
    )
    return message


def _delete_call_keys(store, index, rank):
    """Deletes the keys of call `index`, which every process has left.

    Every process entered the call after `index`, so all of them are done
    waiting on the keys of `index`.
    """
    if index < 0:
        return
    key = _call_key(index)
    store.delete_key(f"{key}/entered/{rank}")
    operation = _CALLS.previous_operation
    if rank == 0 and operation is not None:
        for name in (f"count/{operation}", f"all/{operation}", "outcome"):
            store.delete_key(f"{key}/{name}")
