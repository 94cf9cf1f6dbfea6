"""Saves, loads and resumes a sharded model.

Run on CPU with two gloo processes:

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 examples/save_and_resume.py

Every process makes every call; the files go to a temporary folder.
"""

import os
import shutil
import tempfile

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402

import keras  # noqa: E402
import keras_dtensor as kd  # noqa: E402


def build_model():
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, activation="relu", name="dense_1")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(x))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("simulated failure")


def main():
    keras.distribution.initialize()
    keras.utils.set_random_seed(0)
    rank = int(os.environ.get("RANK", "0"))
    mesh = kd.make_device_mesh({"batch": 1, "model": -1})
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense_1/kernel"] = (None, "model")
    layout_map["head/kernel"] = ("model", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )
    # Every process needs the same paths: torchrun gives them one run id.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "1")
    folder = os.path.join(tempfile.gettempdir(), f"save_and_resume_{run_id}")

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype("float32")
    y = rng.normal(size=(32, 4)).astype("float32")
    model = build_model()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    expected = model.predict(x, verbose=0)

    # Keras formats: ordinary Keras files, written by process 0.
    model.save(os.path.join(folder, "model.keras"))
    loaded = keras.saving.load_model(os.path.join(folder, "model.keras"))
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
    print(f"[rank {rank}] {loaded.get_layer('dense_1').kernel}", flush=True)

    # A sharded checkpoint: each process writes the shards it holds.
    kd.save_checkpoint(model, os.path.join(folder, "checkpoint"))
    fresh = build_model()
    kd.load_checkpoint(fresh, os.path.join(folder, "checkpoint"))
    np.testing.assert_array_equal(fresh.predict(x, verbose=0), expected)
    assert int(fresh.optimizer.iterations.numpy()) == 8

    # Resuming: fit fails in epoch 2; the next fit resumes from the backup.
    backup = keras.callbacks.BackupAndRestore(os.path.join(folder, "backup"))
    model = build_model()
    try:
        model.fit(x, y, epochs=4, verbose=0, callbacks=[backup, Interrupt()])
    except RuntimeError as error:
        print(f"[rank {rank}] fit stopped: {error}", flush=True)
    history = model.fit(x, y, epochs=4, verbose=0, callbacks=[backup])
    print(f"[rank {rank}] resumed at epoch {history.epoch[0]}", flush=True)

    model.evaluate(x, y, verbose=0)  # every process is done reading files
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
