"""Collectives in lockstep, and what happens when a process leaves them.

`workers/lockstep_worker.py` runs six scenarios on 2 gloo processes:
the first four in one launch, the failing two in a launch each (every
launch of the harness runs with `TORCH_DISTRIBUTED_DEBUG=DETAIL`, which
fails a collective that another rank pairs with a different one):

- `hidden`: with a process group made by `dist.init_process_group` and no
  seed, rank 0 alone reads its mesh's `backend_mesh` (as a log line
  would) while rank 1 is late, then both all-reduce a tensor of their own.
  Reading a property must issue no collective: the seed is shared by
  `set_distribution`, where every rank is. (Before, the mesh conversion
  broadcast the seed on rank 0 alone: DETAIL reported BROADCAST on rank 0
  against ALLREDUCE on rank 1, and without DETAIL the job hung.)
- `buckets`: with one gradient per bucket
  (`KERAS_DTENSOR_BUCKET_CAP_MB=0`) and rank 1 slowed down in backward,
  every rank sends the same buckets in the same order (fixed by the graph,
  not by timing), all from the main thread (on CPU, autograd runs the
  gradient hooks on the thread that called backward).
- `async_logs`: `evaluate` and `predict` (130 rows, a short last batch)
  with rank 1 slow, by random delays, in converting batch-end logs (which
  gathers the predictions): under a distribution an `async_safe`
  callback's batch ends run on the main thread (without one, upstream
  runs them on a worker thread), and the loss, the predictions and the
  outputs the batch ends logged are those of the same weights run
  without a distribution.
- `raised`: the first backward pass of a `fit` raises (on every rank),
  after some gradients were sent in their buckets; the caller catches the
  error and calls `fit` again, which must train as the same model does
  without a distribution: the failed pass's buckets are dropped.
- `skip`: rank 0 alone calls `model.evaluate`, then both `model.predict`.
- `die`: rank 1 is killed (SIGKILL) in the middle of a training step.

The last two must end every rank within `KERAS_DTENSOR_TIMEOUT_SECONDS`
(set to 20 s here) of the faulty call, with an error naming the Keras
call on the surviving process; never a hang.
"""

import os
import time

import harness
import numpy as np
import pytest

TIMEOUT_SECONDS = 20
# Time for torchrun to notice the failure and end the other processes.
SLACK_SECONDS = 15


def launch_failing(scenario, tmp_path):
    """Runs `scenario`, expecting failure; returns (the failure's message
    and the launch's whole output, seconds from the first rank's start of
    the faulty part to the launch's end).

    The whole output too, not only the message's last lines: torchrun
    names the first failure it observed last, so the other rank's failure
    may be further up."""
    result_dir = os.path.join(str(tmp_path), "results_lockstep_worker.py_2")
    with pytest.raises(harness.WorkerFailure) as failure:
        harness.launch(
            "lockstep_worker.py",
            2,
            tmp_path,
            args=[scenario],
            timeout=180,
            env={"KERAS_DTENSOR_TIMEOUT_SECONDS": str(TIMEOUT_SECONDS)},
        )
    end = time.time()
    starts = []
    for rank in range(2):
        with open(os.path.join(result_dir, f"rank{rank}.start")) as f:
            starts.append(float(f.read()))
    text = f"{failure.value}\n{failure.value.output}"
    return text, end - min(starts)


@pytest.fixture(scope="module")
def ordered(tmp_path_factory):
    """One launch of the `hidden`, `buckets`, `async_logs` and `raised`
    scenarios.

    `hidden` comes first: it makes the process group itself.
    """
    return harness.launch(
        "lockstep_worker.py",
        2,
        tmp_path_factory.mktemp("ordered"),
        args=["hidden", "buckets", "async_logs", "raised"],
        timeout=240,
        env={"KERAS_DTENSOR_BUCKET_CAP_MB": "0"},
    )


def test_reading_a_mesh_on_one_rank_issues_no_collective(ordered):
    for report in ordered:
        assert report["hidden/all_reduced"] == [3.0] * 4
    # The seed shared by `set_distribution`: replicas are identical.
    assert ordered[0]["hidden/weights"] == ordered[1]["hidden/weights"]


def test_buckets_are_sent_in_one_order_from_the_main_thread(ordered):
    sent = [report["buckets/buckets"] for report in ordered]
    # 2 epochs of 4 steps, 6 gradients each, one per bucket.
    assert len(sent[0]) == 2 * 4 * 6
    assert all(len(bucket["paths"]) == 1 for bucket in sent[0])
    assert sent[0] == sent[1]
    assert all(bucket["main_thread"] for bucket in sent[0])


def test_batch_end_logs_are_gathered_on_the_main_thread(ordered):
    # 33 batches of 4 rows, the last one short, in `evaluate` and
    # `predict`.
    batches = {"test": [True] * 33, "predict": [True] * 33}
    for report in ordered:
        single = report["async_logs/single"]
        distributed = report["async_logs/distributed"]
        # Without a distribution upstream runs the `async_safe` callback on
        # a worker thread (so the check below can fail); under one, every
        # batch end ran on the main thread.
        for kind, on_main in single["on_main_thread"].items():
            assert len(on_main) == 33 and not any(on_main), kind
        assert distributed["on_main_thread"] == batches
        # Against one process without a distribution: batches of 4 split
        # over 2 processes sum in another order (the project's float
        # tolerances).
        np.testing.assert_allclose(
            distributed["loss"], single["loss"], rtol=1e-5
        )
        np.testing.assert_allclose(
            distributed["predictions"],
            single["predictions"],
            rtol=1e-5,
            atol=1e-6,
        )
        # The outputs the batch ends logged are gathered: every batch's
        # full rows, on every rank.
        logged = [
            np.asarray(batch, dtype="float32")
            for batch in distributed["logged_outputs"]
        ]
        assert [len(batch) for batch in logged] == [4] * 32 + [2]
        np.testing.assert_allclose(
            np.concatenate(logged),
            single["predictions"],
            rtol=1e-5,
            atol=1e-6,
        )
    assert (
        ordered[0]["async_logs/distributed"]["loss"]
        == ordered[1]["async_logs/distributed"]["loss"]
    )


def test_a_step_that_raised_leaves_no_buckets_behind(ordered):
    for report in ordered:
        assert report["raised/error"] == "backward failed on purpose"
        losses, weights = report["raised/retried"]
        reference_losses, reference_weights = report["raised/reference"]
        assert len(losses) == len(reference_losses) == 8
        np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
        for got, expected in zip(weights, reference_weights):
            np.testing.assert_allclose(got, expected, atol=1e-6)
    assert ordered[0]["raised/retried"] == ordered[1]["raised/retried"]


def test_rank_skipping_a_call_ends_every_rank_in_time(tmp_path):
    text, elapsed = launch_failing("skip", tmp_path)
    assert "exited with 1" in text
    # Whichever rank fails first names its call: rank 0 is in `evaluate`,
    # rank 1 in `predict`.
    assert (
        "Raised in `evaluate` on process 0 of 2" in text
        or "Raised in `predict` on process 1 of 2" in text
    )
    assert "KERAS_DTENSOR_TIMEOUT_SECONDS" in text
    assert elapsed < TIMEOUT_SECONDS + SLACK_SECONDS


def test_rank_dying_mid_step_ends_every_rank_in_time(tmp_path):
    text, elapsed = launch_failing("die", tmp_path)
    assert "Raised in `fit` on process 0 of 2" in text
    assert "Signal 9 (SIGKILL)" in text
    assert elapsed < TIMEOUT_SECONDS + SLACK_SECONDS
