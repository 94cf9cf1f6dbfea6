"""Gloo process groups that run one collective at a time.

Contract: a gloo group that torch creates inside `one_worker_thread()`
runs its collectives on one worker thread, where torch gives it two.
`process_group` creates the default group in it, and `distribution_lib`
its meshes' groups; groups created elsewhere are left as torch makes
them.

Why: after running a work, each of a gloo group's worker threads writes
the group's status without holding the group's lock
(`ProcessGroupGloo::runLoop`: `pgStatus_->lastCompletedWorkName =
opTypeToString(...)`). Two works that finish together assign one
`std::string` from two threads; where the name does not fit the string's
inline buffer ("ALLGATHER_COALESCED", what DTensor's all-gathers run as on
gloo), both threads may free its heap buffer. The heap is then corrupt:
the stress runs' mid-work crashes ("malloc(): unaligned tcache chunk
detected" on a gloo worker thread, a SIGSEGV) were this.
`scripts/torch_gloo_status_race.py` reproduces it with torch alone.
With one worker thread, a group's works run one after the other: they
still run beside the step's own computation, but no longer beside each
other.

Torch gap: torch 2.13 (found by the script; not reported upstream yet).
It can go once `runLoop` writes the status under the group's lock.
"""

import contextlib
import datetime
import os

from torch.distributed import distributed_c10d

from keras.src.backend.torch import torch_runtime

WORKER_THREADS = 1


@contextlib.contextmanager
def one_worker_thread():
    """Gloo groups created inside have one worker thread; re-entrant."""
    torch_class = distributed_c10d.ProcessGroupGloo
    if getattr(torch_class, "keras_one_worker_thread", False):
        yield
        return
    distributed_c10d.ProcessGroupGloo = _one_thread_class(torch_class)
    try:
        yield
    finally:
        distributed_c10d.ProcessGroupGloo = torch_class


def _one_thread_class(torch_class):
    """`torch_class` (torch's `ProcessGroupGloo`), constructed with the
    options that give it one worker thread. Torch constructs gloo groups
    with a store, rank, size and timeout; the options carry the timeout
    and the devices torch would pick (`_devices`)."""

    class OneWorkerThreadGloo(torch_class):
        keras_one_worker_thread = True

        def __init__(
            self, store, rank, size, timeout=datetime.timedelta(minutes=30)
        ):
            options = torch_runtime.gloo_options(
                torch_class, _devices(torch_class), WORKER_THREADS, timeout
            )
            super().__init__(store, rank, size, options)

    return OneWorkerThreadGloo


def _devices(torch_class):
    """The devices torch gives a gloo group: one per interface named in
    `GLOO_SOCKET_IFNAME`, else the default one."""
    names = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if len(names) > 1:
        return [
            torch_class.create_device(interface=name)
            for name in names.split(",")
        ]
    return [torch_class.create_default_device()]


def worker_threads(group):
    """The worker threads of `group`'s gloo backend."""
    return torch_runtime.gloo_worker_threads(group)
