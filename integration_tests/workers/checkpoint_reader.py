"""Single-process side of the checkpoint tests: plain keras, no torchrun.

Usage: checkpoint_reader.py JOBS_JSON OUT_JSON

JOBS_JSON holds a list of jobs, each a list `[name, command, *args]`:
    write-reference DIR: trains the model without any distribution and
        saves `DIR/model.keras`, `DIR/model.weights.h5` and the sharded
        checkpoint `DIR/sharded`.
    read-keras MODEL_KERAS WEIGHTS_H5: loads both files (on the backend in
        KERAS_BACKEND).
    read-sharded DIR: loads a sharded checkpoint without a process group.

OUT_JSON receives a dict: job name -> what the job found. One process runs
all jobs, as starting keras and torch is the slow part.
"""

import json
import os
import sys

import checkpoint_models as cm

import keras


def write_reference(directory):
    model = cm.build_model()
    cm.fit(model, epochs=2)
    model.save(os.path.join(directory, "model.keras"))
    model.save_weights(os.path.join(directory, "model.weights.h5"))
    import keras_dtensor

    keras_dtensor.save_checkpoint(model, os.path.join(directory, "sharded"))
    return {"state": cm.state(model), "keyed": cm.keyed_state(model)}


def read_keras(model_path, weights_path):
    loaded = keras.saving.load_model(model_path)
    fresh = cm.build_model()
    cm.build_optimizer(fresh)
    fresh.load_weights(weights_path)
    return {
        "backend": keras.backend.backend(),
        "load_model": cm.state(loaded),
        "load_weights": cm.state(fresh),
    }


def read_sharded(directory):
    import torch.distributed as dist

    import keras_dtensor

    model = cm.build_model()
    keras_dtensor.load_checkpoint(model, directory)
    return {
        "process_group": dist.is_initialized(),
        "keyed": cm.keyed_state(model),
    }


COMMANDS = {
    "write-reference": write_reference,
    "read-keras": read_keras,
    "read-sharded": read_sharded,
}


def main():
    jobs_path, out = sys.argv[1:]
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = {}
    for name, command, *args in jobs:
        results[name] = COMMANDS[command](*args)
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
