"""Tests of gloo groups made with one worker thread."""

import datetime
import subprocess
import sys
import textwrap

import torch.distributed as dist
from torch.distributed import distributed_c10d

from keras.src import testing
from keras.src.backend.torch import gloo_groups


def _group(timeout=datetime.timedelta(seconds=30)):
    """A one-process gloo backend, made as torch makes them."""
    return distributed_c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout)


class OneWorkerThreadTest(testing.TestCase):
    def test_groups_made_inside_have_one_worker_thread(self):
        with gloo_groups.one_worker_thread():
            inside = _group()
        self.assertEqual(inside.options._threads, 1)
        self.assertEqual(
            inside.options._timeout, datetime.timedelta(seconds=30)
        )
        # Torch's class is back, and its groups have two threads.
        self.assertIs(distributed_c10d.ProcessGroupGloo, dist.ProcessGroupGloo)
        self.assertEqual(_group().options._threads, 2)

    def test_reentrant(self):
        with gloo_groups.one_worker_thread():
            with gloo_groups.one_worker_thread():
                pass
            self.assertEqual(_group().options._threads, 1)
        self.assertIs(distributed_c10d.ProcessGroupGloo, dist.ProcessGroupGloo)

    def test_the_groups_keras_makes_have_one_worker_thread(self):
        """The default group, its mesh's groups, and DETAIL's helper."""
        script = textwrap.dedent(
            """
            import os
            os.environ["KERAS_BACKEND"] = "torch"
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
            import keras
            from keras.src.backend.torch import gloo_groups
            import torch.distributed as dist
            mesh = keras.distribution.DeviceMesh(
                (1, 1), ("batch", "model"), ["cpu:0"]
            ).backend_mesh
            groups = [dist.group.WORLD, mesh.get_group(0), mesh.get_group(1)]
            print([gloo_groups.worker_threads(g) for g in groups])
            """
        )
        result = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stdout.strip().splitlines()[-1], "[1, 1, 1]")
