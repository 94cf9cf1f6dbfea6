"""`if rank == 0: model.save(...)`, uncaught: the job fails fast, no hang.

Usage: checkpoint_one_rank_worker.py WORK_DIR

Rank 0 alone saves a ModelParallel model, then both ranks train on. Rank 0's
save raises once the sync timeout passes; the error ends rank 0, which ends
rank 1's training step, and torchrun reports rank 0's error (recorded with
`torch.distributed.elastic`'s `@record`). The launch is expected to fail.
"""

import os
import sys

import checkpoint_models as cm
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import keras


@record
def main():
    keras.distribution.initialize()
    cm.use_distribution("mp")
    model = cm.build_model()
    cm.fit(model)
    if dist.get_rank() == 0:
        model.save(os.path.join(sys.argv[1], "model.keras"))
    cm.fit(model)


if __name__ == "__main__":
    main()
