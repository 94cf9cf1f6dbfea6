"""Keras formats under distributions: save, load, one writer, one-rank calls.

Usage: checkpoint_keras_worker.py WORK_DIR REFERENCE_DIR DISTRIBUTIONS
    DISTRIBUTIONS is a comma-separated list of names from
    `checkpoint_models.MESHES` or "dp". REFERENCE_DIR holds `model.keras`
    and `model.weights.h5` saved by single-process keras.

For each distribution, every rank trains a model, saves it as `.keras` and
`.weights.h5` into WORK_DIR/<name>/, loads both back, loads the reference
files, and trains on. Then, with the last distribution, one rank alone calls
a save and another alone calls a load (with a sync timeout of 3 seconds):
both get an error, all ranks carry on, and a save on every rank then works.
"""

import os
import sys

import checkpoint_models as cm
import torch.distributed as dist
import worker_utils
from worker_utils import record
from worker_utils import record_error

import keras
from keras.src.saving import saving_lib

SYNC_TIMEOUT_ENV_VAR = "KERAS_DTENSOR_SYNC_TIMEOUT_SECONDS"
ONE_RANK_SYNC_TIMEOUT = 3

# The paths that upstream saving wrote to, on this rank.
WRITTEN = []


def spy_on_writes():
    upstream_save_model = saving_lib.save_model
    upstream_save_weights_only = saving_lib.save_weights_only

    def save_model(model, filepath, *args, **kwargs):
        WRITTEN.append(str(filepath))
        return upstream_save_model(model, filepath, *args, **kwargs)

    def save_weights_only(model, filepath, *args, **kwargs):
        WRITTEN.append(str(filepath))
        return upstream_save_weights_only(model, filepath, *args, **kwargs)

    saving_lib.save_model = save_model
    saving_lib.save_weights_only = save_weights_only


def check_distribution(name, work_dir, reference_dir):
    cm.use_distribution(name)
    directory = os.path.join(work_dir, name)
    os.makedirs(directory, exist_ok=True)
    model_path = os.path.join(directory, "model.keras")
    weights_path = os.path.join(directory, "model.weights.h5")

    model = cm.build_model()
    cm.fit(model)
    record(f"{name}/trained", cm.state(model))
    record(f"{name}/kernel_placements", cm.placements(model.layers[0].kernel))

    del WRITTEN[:]
    model.save(model_path)
    model.save_weights(weights_path)
    record(f"{name}/written", list(WRITTEN))
    record_error(
        f"{name}/overwrite_false",
        lambda: model.save(model_path, overwrite=False),
    )
    record(f"{name}/listing", sorted(os.listdir(directory)))

    loaded = keras.saving.load_model(model_path)
    record(f"{name}/load_model", cm.state(loaded))
    record(
        f"{name}/loaded_kernel_placements",
        cm.placements(loaded.layers[0].kernel),
    )
    fresh = cm.build_model()
    cm.build_optimizer(fresh)
    fresh.load_weights(weights_path)
    record(f"{name}/load_weights", cm.state(fresh))

    reference = keras.saving.load_model(
        os.path.join(reference_dir, "model.keras")
    )
    record(f"{name}/reference_load_model", cm.state(reference))
    fresh = cm.build_model()
    cm.build_optimizer(fresh)
    fresh.load_weights(os.path.join(reference_dir, "model.weights.h5"))
    record(f"{name}/reference_load_weights", cm.state(fresh))

    # Nothing lost: the loaded model trains on exactly as the original.
    record(f"{name}/losses_after_save", cm.fit(model))
    record(f"{name}/losses_after_load", cm.fit(loaded))
    return model


def check_one_rank_calls(model, directory):
    """A save on rank 0 alone and a load on rank 1 alone fail; all go on."""
    os.environ[SYNC_TIMEOUT_ENV_VAR] = str(ONE_RANK_SYNC_TIMEOUT)
    try:
        one_rank_calls(model, directory)
    finally:
        del os.environ[SYNC_TIMEOUT_ENV_VAR]


def one_rank_calls(model, directory):
    x, _ = cm.data()
    rank = dist.get_rank()
    if rank == 0:
        record_error(
            "one_rank/save",
            lambda: model.save(os.path.join(directory, "alone.keras")),
        )
    record("one_rank/predict_1", model.predict(x, verbose=0))
    if rank == 1:
        record_error(
            "one_rank/load",
            lambda: model.load_weights(
                os.path.join(directory, "model.weights.h5")
            ),
        )
    record("one_rank/predict_2", model.predict(x, verbose=0))
    # The failed calls left the processes in step for the next call.
    model.save_weights(os.path.join(directory, "after.weights.h5"))
    record("one_rank/listing", sorted(os.listdir(directory)))


def run(work_dir, reference_dir, names):
    spy_on_writes()
    names = names.split(",")
    model = None
    for name in names:
        model = check_distribution(name, work_dir, reference_dir)
    check_one_rank_calls(model, os.path.join(work_dir, names[-1]))


def main():
    keras.distribution.initialize()
    run(*sys.argv[1:])
    worker_utils.report()


if __name__ == "__main__":
    main()
