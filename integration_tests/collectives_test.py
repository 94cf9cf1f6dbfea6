"""Collectives per training step, counted with `CommDebugMode`.

`workers/collectives_worker.py` runs one `train_on_batch` under
`CommDebugMode` on 2 gloo processes after two warm-up steps, and reports
the count of each collective (counts, not times):
- `DataParallel` MLP: the gradients of all 6 variables are reduced in one
  bucketed all-reduce (`c10d.allreduce_`), and the loss in one DTensor
  all-reduce; AdamW adds nothing to SGD with momentum (the optimizer never
  meets a partial gradient). With a bucket cap of 0 MB, each gradient is
  its own bucket.
- A Megatron MLP block (column- then row-parallel kernels, the block's
  input and output replicated by `<layer>/output` layouts) under
  `ModelParallel` on a (1, 2) mesh: 1 all-reduce forward (counted when
  the loss function is called) and 1 backward (the rest of the step), the
  minimum; no gradient needs a reduction after backward.
The losses equal a single-process run's.
"""

import harness
import numpy as np
import pytest

RUNS = ["dp:sgd", "dp:adamw", "dp:sgd:0", "tp:sgd", "tp:adamw"]
BUCKETED = "c10d.allreduce_"
DTENSOR_ALL_REDUCE = "c10d_functional.all_reduce"


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return harness.launch(
        "collectives_worker.py",
        2,
        tmp_path_factory.mktemp("collectives"),
        args=RUNS,
    )


def counts(report, run):
    return report[f"{run}/counts"]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_data_parallel_step_has_one_gradient_bucket(reports, optimizer):
    for report in reports:
        assert counts(report, f"dp:{optimizer}") == {
            BUCKETED: 1,
            DTENSOR_ALL_REDUCE: 1,
        }


def test_zero_bucket_cap_reduces_each_gradient_once(reports):
    for report in reports:
        trainable = report["dp:sgd:0/trainable"]
        assert trainable == 6
        assert counts(report, "dp:sgd:0") == {
            BUCKETED: trainable,
            DTENSOR_ALL_REDUCE: 1,
        }


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_tensor_parallel_block_needs_one_all_reduce_each_way(
    reports, optimizer
):
    """One all-reduce in forward (up to the loss), one in backward, none
    after."""
    for report in reports:
        run = f"tp:{optimizer}"
        assert report[f"{run}/forward_counts"] == {DTENSOR_ALL_REDUCE: 1}
        assert counts(report, run) == {DTENSOR_ALL_REDUCE: 2}


@pytest.mark.parametrize("run", RUNS)
def test_losses_equal_single_process(reports, run):
    for report in reports:
        np.testing.assert_allclose(
            report[f"{run}/losses"],
            report[f"{run}/reference_losses"],
            rtol=1e-5,
        )
