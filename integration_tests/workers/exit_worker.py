"""A user's training script, ended one way: how the process exits.

Usage: exit_worker.py ENDING (under torchrun), ENDING being:
- `end`: the script falls off its end;
- `sys_exit`: it calls `sys.exit(0)`;
- `destroy`: it calls `torch.distributed.destroy_process_group()` (as
  torch asks scripts to) and falls off its end;
- `raise`: every process raises a `ValueError`.

Before ending, it trains a small model under `DataParallel` with one
gradient per bucket (`KERAS_DTENSOR_BUCKET_CAP_MB=0`: every bucket's
all-reduce is asynchronous), predicts, and prints a line; where
`EXIT_WORKER_LOSSES` names a folder, each process writes its losses
there (`rank<N>.json`). The process group is the one
`keras.distribution.initialize()` made; but under `destroy`, the script
leaves its teardown to Keras.
"""

import json
import os
import sys

os.environ["KERAS_DTENSOR_BUCKET_CAP_MB"] = "0"

import numpy as np  # noqa: E402

import keras  # noqa: E402


def train():
    keras.distribution.initialize()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(
            devices=keras.distribution.list_devices()
        )
    )
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(4),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    y = np.random.default_rng(1).normal(size=(32, 4)).astype("float32")
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    print("predicted", model.predict(x, verbose=0).shape, flush=True)
    folder = os.environ.get("EXIT_WORKER_LOSSES")
    if folder:
        path = os.path.join(folder, f"rank{os.environ['RANK']}.json")
        with open(path, "w") as f:
            json.dump(history.history["loss"], f)


def main(ending):
    train()
    if ending == "sys_exit":
        sys.exit(0)
    if ending == "destroy":
        import torch.distributed

        torch.distributed.destroy_process_group()
    if ending == "raise":
        raise ValueError("the script's own error")


if __name__ == "__main__":
    main(sys.argv[1])
