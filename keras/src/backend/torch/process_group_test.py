"""Tests of the process-group set-up that need no second process."""

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

from keras.src import testing
from keras.src.backend.torch import process_group


class LocalDeviceTest(testing.TestCase):
    def test_local_rank_without_a_device_is_named(self):
        with mock.patch.object(torch.cuda, "device_count", return_value=1):
            with mock.patch.dict("os.environ", {"LOCAL_RANK": "1"}):
                with self.assertRaisesRegex(
                    ValueError,
                    r"LOCAL_RANK=1 \(rank 1\) has no CUDA device: 1 "
                    r"device\(s\) are visible.*--nproc_per_node=1",
                ):
                    process_group.local_cuda_device(1)
            with mock.patch.dict("os.environ", {"LOCAL_RANK": "0"}):
                self.assertEqual(process_group.local_cuda_device(1), 0)

    def test_shared_devices_wrap_around(self):
        """Under gloo's CUDA collectives, ranks share the devices."""
        with mock.patch.object(torch.cuda, "device_count", return_value=2):
            with mock.patch.dict("os.environ", {"LOCAL_RANK": "3"}):
                self.assertEqual(
                    process_group.local_cuda_device(3, shared=True), 1
                )

    def test_cuda_backend_is_read_and_checked(self):
        variable = process_group.CUDA_BACKEND_ENV_VAR
        with mock.patch.dict("os.environ", clear=True):
            self.assertEqual(process_group.cuda_collectives_backend(), "nccl")
        with mock.patch.dict("os.environ", {variable: " Gloo"}):
            self.assertEqual(process_group.cuda_collectives_backend(), "gloo")
        with mock.patch.dict("os.environ", {variable: "mpi"}):
            with self.assertRaisesRegex(
                ValueError, r"KERAS_DTENSOR_CUDA_BACKEND must be one of.*'mpi'"
            ):
                process_group.cuda_collectives_backend()


@pytest.mark.parametrize(
    "addresses,num_processes",
    [("10.0.0.1:1234,10.0.0.2:2345,10.0.0.3:1", 2)],
)
def test_job_addresses_must_match_num_processes(addresses, num_processes):
    with pytest.raises(ValueError, match="has 3 jobs"):
        process_group.init_process_group(addresses, num_processes, 0)


def test_a_host_alone_takes_master_port():
    calls = []
    environment = {"MASTER_PORT": "29999", "MASTER_ADDR": "elsewhere"}
    with mock.patch.dict("os.environ", environment):
        with mock.patch.object(
            process_group.dist,
            "init_process_group",
            lambda **kwargs: calls.append(kwargs),
        ):
            process_group.init_process_group("10.0.0.7", 1, 0)
            assert os.environ["MASTER_ADDR"] == "10.0.0.7"
            assert os.environ["MASTER_PORT"] == "29999"
        assert calls[0]["world_size"] == 1 and calls[0]["rank"] == 0
    with mock.patch.dict("os.environ", clear=True):
        with pytest.raises(ValueError, match="or a host with MASTER_PORT"):
            process_group.init_process_group("10.0.0.7", 1, 0)


def test_the_groups_are_destroyed_once_at_exit():
    """A process whose group `ensure_process_group` made, with the hook
    registered twice, destroys its groups once when it ends."""
    script = (
        "import torch.distributed as dist\n"
        "from keras.src.backend.torch import process_group\n"
        "destroy = dist.destroy_process_group\n"
        "def traced():\n"
        "    print('destroyed', flush=True)\n"
        "    destroy()\n"
        "dist.destroy_process_group = traced\n"
        "process_group.ensure_process_group()\n"
        "process_group.destroy_at_exit()\n"
        "print('initialized', dist.is_initialized(), flush=True)\n"
    )
    environment = dict(os.environ, KERAS_BACKEND="torch")
    environment.pop("WORLD_SIZE", None)
    completed = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.split() == ["initialized", "True", "destroyed"]


def test_the_teardown_destroys_the_groups_once_and_always_drains():
    calls = []
    with mock.patch.object(process_group, "WORKER_DRAIN_SECONDS", 0):
        with mock.patch.object(process_group.dist, "is_initialized") as up:
            with mock.patch.object(
                process_group.dist,
                "destroy_process_group",
                lambda: calls.append("destroyed"),
            ):
                with mock.patch.object(
                    process_group.time,
                    "sleep",
                    lambda seconds: calls.append("drained"),
                ):
                    up.return_value = True
                    process_group.destroy_process_group()
                    # Destroyed by the script itself: drained all the same.
                    up.return_value = False
                    process_group.destroy_process_group()
    assert calls == ["destroyed", "drained", "drained"]
