"""A process killed while it writes a checkpoint.

Usage: checkpoint_killed_worker.py MODE WORK_DIR

MODE "keras": saves `model.keras` and `model.weights.h5`, trains on, and
saves `model.weights.h5` again; process 0, the writer, kills itself with
SIGKILL after writing part of the file.
MODE "sharded": saves the sharded checkpoint `sharded`, trains on, and saves
it again; rank 1 kills itself with SIGKILL right after writing its shards,
before the checkpoint's metadata is written.

Before the second save, process 0 writes the state of the first save to
WORK_DIR/expected.json. The launch is expected to fail.
"""

import json
import os
import signal
import sys

import checkpoint_models as cm
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import keras
import keras_dtensor
from keras.src.saving import saving_lib

MODE, WORK_DIR = sys.argv[1], sys.argv[2]
WRITES_BEFORE_KILL = 3


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def write_expected(expected):
    if dist.get_rank() != 0:
        return
    path = os.path.join(WORK_DIR, "expected.json")
    with open(path + ".tmp", "w") as f:
        json.dump(expected, f)
    os.replace(path + ".tmp", path)


def kill_writer_mid_h5_write():
    """Process 0 dies after writing a few datasets of the next H5 file."""
    upstream_setitem = saving_lib.H5IOStore.__setitem__
    writes = []

    def __setitem__(self, key, value):
        upstream_setitem(self, key, value)
        writes.append(key)
        if len(writes) == WRITES_BEFORE_KILL and dist.get_rank() == 0:
            self.h5_file.flush()
            kill_self()

    saving_lib.H5IOStore.__setitem__ = __setitem__


def kill_rank_one_after_its_shards():
    """Rank 1 dies once its shard file is written."""
    upstream_write_data = dcp.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        future = upstream_write_data(self, plan, planner)
        future.wait()
        if dist.get_rank() == 1:
            kill_self()
        return future

    dcp.FileSystemWriter.write_data = write_data


def main():
    keras.distribution.initialize()
    cm.use_distribution("mp")
    model = cm.build_model()
    cm.fit(model)
    if MODE == "keras":
        model.save(os.path.join(WORK_DIR, "model.keras"))
        weights_path = os.path.join(WORK_DIR, "model.weights.h5")
        model.save_weights(weights_path)
        write_expected(cm.state(model))
        cm.fit(model)
        kill_writer_mid_h5_write()
        model.save_weights(weights_path)
    else:
        checkpoint = os.path.join(WORK_DIR, "sharded")
        keras_dtensor.save_checkpoint(model, checkpoint)
        write_expected(cm.keyed_state(model))
        cm.fit(model)
        kill_rank_one_after_its_shards()
        keras_dtensor.save_checkpoint(model, checkpoint)
    raise AssertionError("The second save should not return.")


if __name__ == "__main__":
    main()
