"""`ModelCheckpoint` and `BackupAndRestore` under distributions.

Usage: checkpoint_callbacks_worker.py WORK_DIR DISTRIBUTIONS

For each distribution (comma-separated names, see `checkpoint_models`):
1. `fit` for 4 epochs with `ModelCheckpoint` saving weights every epoch
   and `ModelCheckpoint` saving the whole model when the loss improves;
   the state at each epoch end is recorded, and every file is loaded back.
   Its losses are reported as `checkpointed_losses`.
2. `fit` for 4 epochs with `BackupAndRestore(double_checkpoint=True)`,
   interrupted by an exception at the start of epoch 2 (its type and
   message reported as `interrupted`); then `fit` again, which resumes at
   epoch 2. The same model is also trained for 4 epochs without any
   callback, the uninterrupted reference (`uninterrupted_losses` and
   `uninterrupted_state`).
"""

import os
import sys

import checkpoint_models as cm
import worker_utils
from worker_utils import record

import keras

EPOCHS = 4
INTERRUPT_AT_EPOCH = 2
INTERRUPTION = "Interrupting training"


class EpochStates(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.states = []
        self.losses = []

    def on_epoch_end(self, epoch, logs=None):
        self.states.append(cm.state(self.model))
        self.losses.append(float(logs["loss"]))


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == INTERRUPT_AT_EPOCH:
            raise RuntimeError(INTERRUPTION)


def check_model_checkpoint(name, directory):
    model = cm.build_model()
    states = EpochStates()
    weights_pattern = os.path.join(
        directory, "ckpt", "w-{epoch:02d}.weights.h5"
    )
    best_path = os.path.join(directory, "best", "best.keras")
    losses = cm.fit(
        model,
        epochs=EPOCHS,
        callbacks=[
            keras.callbacks.ModelCheckpoint(
                weights_pattern, save_weights_only=True
            ),
            keras.callbacks.ModelCheckpoint(
                best_path, monitor="loss", save_best_only=True
            ),
            states,
        ],
    )
    record(f"{name}/checkpointed_losses", losses)
    record(f"{name}/epoch_states", states.states)
    record(f"{name}/epoch_losses", states.losses)
    loaded = []
    for epoch in range(1, EPOCHS + 1):
        fresh = cm.build_model()
        cm.build_optimizer(fresh)
        fresh.load_weights(weights_pattern.format(epoch=epoch))
        loaded.append(cm.state(fresh))
    record(f"{name}/checkpoint_states", loaded)
    record(f"{name}/best_state", cm.state(keras.saving.load_model(best_path)))
    record(
        f"{name}/checkpoint_listing",
        sorted(os.listdir(os.path.join(directory, "ckpt"))),
    )


def check_backup_and_restore(name, directory):
    backup_dir = os.path.join(directory, "backup")

    def backup():
        return keras.callbacks.BackupAndRestore(
            backup_dir, double_checkpoint=True
        )

    model = cm.build_model()
    try:
        cm.fit(model, epochs=EPOCHS, callbacks=[backup(), Interrupt()])
        record(f"{name}/interrupted", None)
    except RuntimeError as error:
        record(f"{name}/interrupted", f"{type(error).__name__}: {error}")
    record(f"{name}/backup_listing", sorted(os.listdir(backup_dir)))

    resumed = cm.build_model()
    epochs_run = []

    class Epochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs_run.append(epoch)

    record(
        f"{name}/resumed_losses",
        cm.fit(resumed, epochs=EPOCHS, callbacks=[backup(), Epochs()]),
    )
    record(f"{name}/resumed_epochs", epochs_run)
    record(f"{name}/resumed_state", cm.state(resumed))
    record(f"{name}/backup_deleted", not os.path.exists(backup_dir))

    uninterrupted = cm.build_model()
    record(f"{name}/uninterrupted_losses", cm.fit(uninterrupted, epochs=EPOCHS))
    record(f"{name}/uninterrupted_state", cm.state(uninterrupted))


def run(work_dir, names):
    for name in names.split(","):
        cm.use_distribution(name)
        directory = os.path.join(work_dir, name)
        check_model_checkpoint(name, directory)
        check_backup_and_restore(name, directory)


def main():
    keras.distribution.initialize()
    run(*sys.argv[1:])
    worker_utils.report()


if __name__ == "__main__":
    main()
