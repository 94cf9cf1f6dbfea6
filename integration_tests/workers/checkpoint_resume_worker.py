"""Resume under `torchrun --max-restarts=1` after a rank is killed.

Usage: checkpoint_resume_worker.py WORK_DIR

Trains a ModelParallel model for 4 epochs with `BackupAndRestore`. On the
first attempt (TORCHELASTIC_RESTART_COUNT 0), rank 1 kills itself with
SIGKILL in the middle of epoch 2, after the backup of epoch 1; torchrun
restarts both ranks, and the second attempt resumes from that backup. It
then trains an uninterrupted model from scratch, for comparison.
"""

import os
import signal
import sys

import checkpoint_models as cm
import torch.distributed as dist
import worker_utils
from worker_utils import record

import keras

WORK_DIR = sys.argv[1]
EPOCHS = 4
KILL_AT = (2, 1)  # (epoch, batch) after which rank 1 is killed.


class KillRankOne(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == KILL_AT and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


class Epochs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)


def main():
    keras.distribution.initialize()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    cm.use_distribution("mp")
    backup_dir = os.path.join(WORK_DIR, "backup")
    model = cm.build_model()
    epochs = Epochs()
    callbacks = [keras.callbacks.BackupAndRestore(backup_dir), epochs]
    if restart == 0:
        callbacks.append(KillRankOne())
    losses = cm.fit(model, epochs=EPOCHS, callbacks=callbacks)
    record("restart_count", restart)
    record("resumed_epochs", epochs.epochs)
    record("resumed_losses", losses)
    record("resumed_state", cm.state(model))

    uninterrupted = cm.build_model()
    record("uninterrupted_losses", cm.fit(uninterrupted, epochs=EPOCHS))
    record("uninterrupted_state", cm.state(uninterrupted))
    worker_utils.report()


if __name__ == "__main__":
    main()
