"""Trains like `training_worker.py` and also reports what was compiled.

Usage: jit_compile_worker.py RUN [RUN ...], with RUN as in
`training_worker.py` (`MODE:MODEL:OPTIMIZER[:EXTRA]`, `jit` among the
EXTRA options compiles the model with `jit_compile=True`). Besides the
values `training_worker.train` reports, each run reports `<RUN>/compiled`:
how many frames, graphs and AOT-autograd graphs torch.compile produced
while it ran (all 0 for an eager run), and for a jit run under a
distribution whether `fit`, `evaluate` and `predict` used the compiled
steps of `keras/src/backend/torch/distributed_trainer.py`.
"""

import sys

import training_worker
import worker_utils
from training_worker import Run


def compile_counts():
    from torch._dynamo.utils import counters

    return {
        "frames": counters["frames"]["ok"],
        "graphs": counters["stats"]["unique_graphs"],
        "aot_graphs": counters["aot_autograd"]["ok"],
    }


def train(run):
    """`training_worker.train`, then the compile counts and step kinds."""
    models = []
    build_model = training_worker.build_model

    def build_and_keep(run):
        models.append(build_model(run))
        return models[-1]

    before = compile_counts()
    training_worker.build_model = build_and_keep
    try:
        training_worker.train(run)
    finally:
        training_worker.build_model = build_model
    after = compile_counts()
    compiled = {name: after[name] - before[name] for name in after}
    for attribute in ("train_function", "test_function", "predict_function"):
        function = getattr(models[-1], attribute)
        compiled[attribute] = bool(
            getattr(function, "compiled_for_distribution", False)
        )
    run.record("compiled", compiled)


def main():
    runs = [Run(spec) for spec in sys.argv[1:]]
    worker_utils.run_all(train, runs, mode_of=lambda run: run.mode)


if __name__ == "__main__":
    main()
