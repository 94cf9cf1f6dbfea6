"""The torch.distributed process group and the random seed it shares.

One process drives one device. `initialize` joins the job's process group
(torchrun's environment, or keras's `initialize` arguments) with gloo on
CPU and NCCL on CUDA, and makes every process use the same random seed.
`KERAS_DTENSOR_CUDA_BACKEND=gloo` runs CUDA tensors' collectives on gloo
instead (gloo copies them through host memory): then several processes
may share one GPU, which NCCL refuses, so that a machine with one GPU can
run a job's multi-process CUDA paths.
DTensor needs a process group even for one process, so the first mesh
creates a single-process one when nothing else did
(`ensure_process_group`).

The process groups are torn down when the interpreter exits
(`destroy_at_exit`, registered by `initialize` and by the group that
`ensure_process_group` creates), however the script ends: falling off
its end, `sys.exit`, or an exception.

Collectives here: the seed broadcast of `initialize_rng`, issued only from
`initialize` and `share_seed_once` (called by `set_distribution`), which
every process calls in the same order. Tearing down issues none.
"""

import atexit
import datetime
import os
import time

import torch
import torch.distributed as dist

from keras.src.backend.torch import gloo_groups

TIMEOUT_ENV_VAR = "KERAS_DTENSOR_TIMEOUT_SECONDS"
# The backend of CUDA tensors' collectives: "nccl" (default) or "gloo".
CUDA_BACKEND_ENV_VAR = "KERAS_DTENSOR_CUDA_BACKEND"
CUDA_BACKENDS = ("nccl", "gloo")
# How long `destroy_process_group` lets gloo's threads drop their works.
WORKER_DRAIN_SECONDS = 0.2
DEFAULT_TIMEOUT_SECONDS = 600


class SharedSeed:
    """Whether this process uses the job's random seed.

    Attributes:
        synchronized: whether `initialize_rng` ran: variables are created
            from the shared seed.
    """

    def __init__(self):
        self.synchronized = False


# Per process, as the process group is. Not in keras's `global_state`:
# that is per thread, and `clear_session` clears it, after which
# `share_seed_once` would broadcast a seed again.
_SHARED_SEED = SharedSeed()


def initialize(job_addresses=None, num_processes=None, process_id=None):
    """Joins the job's process group and shares the random seed.

    See `keras.src.backend.torch.distribution_lib.initialize`.
    """
    if not dist.is_initialized():
        init_process_group(job_addresses, num_processes, process_id)
    destroy_at_exit()
    initialize_rng()


def initialize_rng():
    """Makes every process use the same global random seed.

    If no seed was set with `keras.utils.set_random_seed`, process 0 draws
    one and broadcasts it, as the JAX backend does in `initialize`.
    """
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils

    _SHARED_SEED.synchronized = True
    if rng_utils.get_random_seed() is not None:
        return
    seed = torch.tensor(
        [seed_generator.make_default_seed()],
        dtype=torch.int64,
        device=collective_device(),
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    rng_utils.set_random_seed(int(seed.item()))


def share_seed_once():
    """Shares the global random seed, unless `initialize` already did.

    Called by `keras.distribution.set_distribution` for each distribution
    it sets: every process reaches it in the same order, so the broadcast
    of `initialize_rng` is issued in lockstep. It covers a process group
    created outside `initialize` (e.g. by `dist.init_process_group`);
    with a single process nothing is shared.
    """
    if _SHARED_SEED.synchronized:
        return
    maybe_auto_initialize()
    if dist.is_initialized() and dist.get_world_size() > 1:
        initialize_rng()


def num_processes():
    """The number of processes of the job (1 without a process group)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return 1


def process_id():
    """The rank of this process (0 without a process group)."""
    if dist.is_initialized():
        return dist.get_rank()
    return 0


def collective_device():
    """The device of tensors that collectives exchange: CUDA under NCCL."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def timeout():
    """How long a collective may wait (`KERAS_DTENSOR_TIMEOUT_SECONDS`)."""
    seconds = float(os.environ.get(TIMEOUT_ENV_VAR, DEFAULT_TIMEOUT_SECONDS))
    return datetime.timedelta(seconds=seconds)


def launched_multi_process():
    """Whether a launcher (torchrun) started several processes."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def maybe_auto_initialize():
    """Joins torchrun's process group if the user did not call initialize."""
    if not dist.is_initialized() and launched_multi_process():
        initialize()


def ensure_process_group():
    """DTensor needs a process group, even for a single process.

    Under torchrun this joins the job's group without sharing the seed:
    it runs from a mesh's first conversion, which a property access may
    reach on some processes only (the seed is shared by
    `set_distribution`).
    """
    if dist.is_initialized():
        return
    destroy_at_exit()
    if launched_multi_process():
        init_process_group(None, None, None)
        return
    with gloo_groups.one_worker_thread():
        dist.init_process_group(
            backend="gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timeout(),
        )


def init_process_group(job_addresses, num_processes, process_id):
    """Creates the default process group from arguments and environment."""
    if job_addresses:
        addresses = job_addresses.split(",")
        if num_processes is not None and len(addresses) > 1:
            if num_processes != len(addresses):
                raise ValueError(
                    f"The provided job_addresses {addresses} has "
                    f"{len(addresses)} jobs, but num_processes is "
                    f"{num_processes}"
                )
        host, _, port = addresses[0].rpartition(":")
        if not host:
            # A host alone takes its port from `MASTER_PORT`, as upstream
            # master's torch backend does.
            host, port = addresses[0], os.environ.get("MASTER_PORT")
        if not host or not port:
            raise ValueError(
                "Expected job addresses as 'host:port', or a host with "
                f"MASTER_PORT set. Received: job_addresses={job_addresses}"
            )
        os.environ["MASTER_ADDR"] = host
        os.environ["MASTER_PORT"] = port
    world_size = (
        num_processes
        if num_processes is not None
        else int(os.environ.get("WORLD_SIZE", "1"))
    )
    rank = (
        process_id
        if process_id is not None
        else int(os.environ.get("RANK", "0"))
    )
    kwargs = {"timeout": timeout(), "rank": rank, "world_size": world_size}
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        kwargs["store"] = dist.HashStore()
    backend = "gloo"
    if torch.cuda.is_available():
        cuda_backend = cuda_collectives_backend()
        torch.cuda.set_device(
            local_cuda_device(rank, shared=cuda_backend == "gloo")
        )
        if cuda_backend == "nccl":
            backend = "cpu:gloo,cuda:nccl"
    # Gloo's worker threads race on the group's status (`gloo_groups`).
    with gloo_groups.one_worker_thread():
        dist.init_process_group(backend=backend, **kwargs)


def destroy_at_exit():
    """Tears the process groups down at interpreter exit, once.

    Left to the interpreter's finalization, gloo's worker threads were
    still running when C++ static destructors ran, and the process ended
    in "terminate called without an active exception" (SIGABRT) after all
    its work: torchrun then reports the job failed. Torch asks scripts to
    call `destroy_process_group` themselves (pytorch#190489; pytorch#179291
    proposed this same exit hook for torch and was abandoned). An exit
    hook runs while the interpreter is whole; a group the script destroyed
    already is not destroyed twice.
    """
    atexit.unregister(destroy_process_group)
    atexit.register(destroy_process_group)


def destroy_process_group():
    """Destroys every process group, if the default one is still up, then
    lets gloo's threads drop their works; both at exit.

    It issues no collective, so a process may reach it alone: when one
    process raised and the others wait in a collective, the others fail
    at its timeout, then tear down. A script that destroyed its groups
    itself, as torch asks, still gets the pause: its groups' threads
    outlive the destruction as much.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    # Gloo's worker threads outlive `destroy_process_group` (they stop
    # with the group's C++ object, freed with its last reference) and drop
    # each work they ran after marking it done. A work dropped once the
    # interpreter finalizes needs the GIL for its tensors, and the thread
    # is ended under a noexcept frame: "terminate called without an
    # active exception" (a core read with gdb: `runLoop` ->
    # `~AsyncAllgatherCoalescedWork` -> `take_gil` -> `pthread_exit`;
    # pytorch#179291). Torch offers no wait for those drops; a pause with
    # the GIL released lets the threads finish them. It can go once
    # destroying a gloo group stops its threads.
    time.sleep(WORKER_DRAIN_SECONDS)


def cuda_collectives_backend():
    """The backend of CUDA tensors' collectives (`CUDA_BACKEND_ENV_VAR`).

    Raises:
        ValueError: for a name other than "nccl" or "gloo".
    """
    name = os.environ.get(CUDA_BACKEND_ENV_VAR, "nccl").strip().lower()
    if name not in CUDA_BACKENDS:
        raise ValueError(
            f"{CUDA_BACKEND_ENV_VAR} must be one of {CUDA_BACKENDS}. "
            f"Received: {name!r}"
        )
    return name


def local_cuda_device(rank, shared=False):
    """The CUDA device of this process: its `LOCAL_RANK`.

    Args:
        rank: the process's global rank.
        shared: whether processes may share a device (gloo collectives):
            local ranks beyond the device count wrap around.

    Raises:
        ValueError: when this machine has no device for that local rank
            and devices are not shared.
    """
    count = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", rank % count))
    if shared:
        return local_rank % count
    if local_rank >= count:
        raise ValueError(
            f"Process with LOCAL_RANK={local_rank} (rank {rank}) has no CUDA "
            f"device: {count} device(s) are visible on this machine "
            f"(CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}). Start at most "
            f"{count} process(es) per machine (`torchrun "
            f"--nproc_per_node={count}`), make more GPUs visible, run on "
            'CPU with gloo (CUDA_VISIBLE_DEVICES=""), or share the GPUs '
            f"with gloo's CUDA collectives ({CUDA_BACKEND_ENV_VAR}=gloo; "
            "for tests: gloo copies through host memory)."
        )
    return local_rank
