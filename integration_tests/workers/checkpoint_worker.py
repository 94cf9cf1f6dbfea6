"""Every 2-process checkpoint check that ends normally, in one launch.

Usage: checkpoint_worker.py WORK_DIR REFERENCE_DIR DISTRIBUTIONS

Starting processes is the slow part of a launch, so this runs, in order:
- `checkpoint_keras_worker.run` in WORK_DIR/keras (Keras formats, then
  saves and loads on one rank only),
- `checkpoint_sharded_worker.two` in WORK_DIR/sharded, loading
  REFERENCE_DIR/sharded (sharded checkpoints),
- `checkpoint_callbacks_worker.run` in WORK_DIR/callbacks (callbacks),
and reports what all of them recorded.
"""

import os
import sys

import checkpoint_callbacks_worker
import checkpoint_keras_worker
import checkpoint_sharded_worker
import worker_utils

import keras


def main():
    work_dir, reference_dir, names = sys.argv[1:]
    keras.distribution.initialize()
    parts = {
        name: os.path.join(work_dir, name)
        for name in ("keras", "sharded", "callbacks")
    }
    for directory in parts.values():
        os.makedirs(directory, exist_ok=True)
    checkpoint_keras_worker.run(parts["keras"], reference_dir, names)
    checkpoint_sharded_worker.two(
        parts["sharded"], os.path.join(reference_dir, "sharded")
    )
    checkpoint_callbacks_worker.run(parts["callbacks"], names)
    worker_utils.report()


if __name__ == "__main__":
    main()
