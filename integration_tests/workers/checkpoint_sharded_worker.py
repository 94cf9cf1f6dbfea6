"""Sharded checkpoints: per-rank shards, stable keys, resharding on load.

Usage:
    checkpoint_sharded_worker.py two WORK_DIR REFERENCE_CHECKPOINT
        On 2 processes. Saves a ModelParallel model twice into
        WORK_DIR/sharded_mp (the second save replaces the first), loads it
        into a second instance under DataParallel and under ModelParallel,
        and loads REFERENCE_CHECKPOINT (saved by one process) on a 2-D mesh.
    checkpoint_sharded_worker.py four WORK_DIR
        On 4 processes. Loads WORK_DIR/sharded_mp (saved on 2) on a (4,)
        mesh; saves a model on a (2, 2) mesh as a sharded checkpoint and as
        Keras files, and loads that checkpoint on a (4,) mesh.
"""

import os
import sys

import checkpoint_models as cm
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import worker_utils
from worker_utils import record

import keras
import keras_dtensor


def record_model(prefix, model):
    record(f"{prefix}/keys", list(keras_dtensor.checkpoint_variables(model)))
    record(f"{prefix}/paths", [v.path for v in model.variables])
    record(f"{prefix}/state", cm.keyed_state(model))
    record(f"{prefix}/kernel_placements", cm.placements(model.layers[0].kernel))


def record_chunk_files(prefix, directory):
    """Which file holds each chunk of each tensor (read on rank 0)."""
    if dist.get_rank() != 0:
        return
    metadata = dcp.FileSystemReader(directory).read_metadata()
    chunks = {}
    for index, info in metadata.storage_data.items():
        chunks.setdefault(index.fqn, []).append(
            [list(index.offset), info.relative_path]
        )
    record(f"{prefix}/chunk_files", chunks)


def two(work_dir, reference_checkpoint):
    checkpoint = os.path.join(work_dir, "sharded_mp")
    cm.use_distribution("mp")
    original = cm.build_model()
    cm.fit(original)
    keras_dtensor.save_checkpoint(original, checkpoint)
    cm.fit(original)
    keras_dtensor.save_checkpoint(original, checkpoint)
    record_model("mp/saved", original)
    record_chunk_files("mp", checkpoint)
    record("sharded/listing", sorted(os.listdir(work_dir)))

    cm.use_distribution("dp")
    replicated = cm.build_model()
    keras_dtensor.load_checkpoint(replicated, checkpoint)
    record_model("dp/loaded", replicated)

    cm.use_distribution("mp2d")
    from_one = cm.build_model()
    keras_dtensor.load_checkpoint(from_one, reference_checkpoint)
    record_model("mp2d/loaded_reference", from_one)

    cm.use_distribution("mp")
    resumed = cm.build_model()
    keras_dtensor.load_checkpoint(resumed, checkpoint)
    record("sharded/losses_after_save", cm.fit(original))
    record("sharded/losses_after_load", cm.fit(resumed))


def four(work_dir):
    cm.use_distribution("mp4")
    from_two = cm.build_model()
    keras_dtensor.load_checkpoint(
        from_two, os.path.join(work_dir, "sharded_mp")
    )
    record_model("mp4/loaded_from_mp", from_two)

    checkpoint = os.path.join(work_dir, "sharded_mp2x2")
    cm.use_distribution("mp2x2")
    original = cm.build_model()
    cm.fit(original)
    keras_dtensor.save_checkpoint(original, checkpoint)
    record_model("mp2x2/saved", original)
    record_chunk_files("mp2x2", checkpoint)
    keras_dir = os.path.join(work_dir, "mp2x2")
    os.makedirs(keras_dir, exist_ok=True)
    original.save(os.path.join(keras_dir, "model.keras"))
    original.save_weights(os.path.join(keras_dir, "model.weights.h5"))
    record("mp2x2/state", cm.state(original))
    loaded = keras.saving.load_model(os.path.join(keras_dir, "model.keras"))
    record("mp2x2/load_model", cm.state(loaded))

    cm.use_distribution("mp4")
    resharded = cm.build_model()
    keras_dtensor.load_checkpoint(resharded, checkpoint)
    record_model("mp4/loaded_from_mp2x2", resharded)


def main():
    keras.distribution.initialize()
    mode, *args = sys.argv[1:]
    {"two": two, "four": four}[mode](*args)
    worker_utils.report()


if __name__ == "__main__":
    main()
