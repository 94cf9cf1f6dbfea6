"""Two torchrun invocations acting as two nodes train like one invocation.

`harness.launch_multi_node` starts two `torchrun --nnodes=2
--nproc_per_node=1` processes that meet through a c10d rendezvous on
127.0.0.1, as two machines would. Both run `workers/training_worker.py`
(DataParallel, MLP, SGD with momentum); every rank's report must equal,
value for value, the report of the same rank in one ordinary
`torchrun --nproc_per_node=2` launch.
"""

import os
import uuid

import harness
import numpy as np
import pytest

WORKER = "training_worker.py"
WORKER_ARGS = ["dp", "mlp", "sgd"]
TIMEOUT = 180
# Long enough for both nodes to rendezvous and start their workers.
HANG_TIMEOUT = 20
# A sitecustomize for `test_timeout_kills_every_node_and_worker`.
SLEEPING_WORKERS = """
import os
import time

if "LOCAL_RANK" in os.environ:
    with open(os.path.join(os.environ["STARTED_DIR"], str(os.getpid())), "w"):
        pass
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def single_invocation(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("single_invocation")
    return harness.launch(
        WORKER, 2, tmp_path, args=WORKER_ARGS, timeout=TIMEOUT
    )


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("two_nodes")
    return harness.launch_multi_node(
        WORKER, 2, tmp_path, args=WORKER_ARGS, timeout=TIMEOUT
    )


def assert_same_values(actual, expected, key):
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), key
        for name in expected:
            assert_same_values(actual[name], expected[name], f"{key}/{name}")
    elif (
        isinstance(expected, list)
        and expected
        and isinstance(expected[0], list)
    ):
        # A list of arrays (weights) or a nested array.
        assert len(actual) == len(expected), key
        for i, (a, e) in enumerate(zip(actual, expected)):
            np.testing.assert_array_equal(
                np.asarray(a), np.asarray(e), err_msg=f"{key}[{i}]"
            )
    else:
        np.testing.assert_array_equal(
            np.asarray(actual), np.asarray(expected), err_msg=key
        )


def test_every_rank_reports_the_same_keys(single_invocation, two_nodes):
    assert len(two_nodes) == len(single_invocation) == 2
    for node_report, reference in zip(two_nodes, single_invocation):
        assert sorted(node_report) == sorted(reference)


@pytest.mark.parametrize("key", ["initial_weights", "final_weights"])
def test_weights_equal_single_invocation(single_invocation, two_nodes, key):
    for rank, (node_report, reference) in enumerate(
        zip(two_nodes, single_invocation)
    ):
        assert_same_values(node_report[key], reference[key], f"rank{rank}")


def test_training_moved_the_weights(two_nodes):
    for report in two_nodes:
        moved = [
            np.abs(np.asarray(final) - np.asarray(initial)).max()
            for initial, final in zip(
                report["initial_weights"], report["final_weights"]
            )
        ]
        assert max(moved) > 1e-3


def test_losses_and_metrics_equal_single_invocation(
    single_invocation, two_nodes
):
    for rank, (node_report, reference) in enumerate(
        zip(two_nodes, single_invocation)
    ):
        assert reference["batch_losses"]
        for key in ("batch_losses", "history", "iterations", "evaluate"):
            assert_same_values(
                node_report[key], reference[key], f"rank{rank}/{key}"
            )


def test_predictions_equal_single_invocation(single_invocation, two_nodes):
    for rank, (node_report, reference) in enumerate(
        zip(two_nodes, single_invocation)
    ):
        assert_same_values(
            node_report["predict"], reference["predict"], f"rank{rank}"
        )


def test_every_reported_value_equals_single_invocation(
    single_invocation, two_nodes
):
    for rank, (node_report, reference) in enumerate(
        zip(two_nodes, single_invocation)
    ):
        for key in reference:
            assert_same_values(
                node_report[key], reference[key], f"rank{rank}/{key}"
            )


def processes_with_env(name, value):
    """Ids of live processes whose environment has `name=value`."""
    entry = f"{name}={value}".encode()
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if entry in environ:
            pids.append(int(pid))
    return pids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_timeout_kills_every_node_and_worker(tmp_path):
    # Workers (torchrun gives them LOCAL_RANK) note their start and hang.
    site_dir = tmp_path / "site"
    started_dir = tmp_path / "started"
    site_dir.mkdir()
    started_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text(SLEEPING_WORKERS)
    marker = uuid.uuid4().hex
    python_path = os.pathsep.join(
        p for p in (str(site_dir), os.environ.get("PYTHONPATH")) if p
    )
    with pytest.raises(harness.WorkerFailure, match="did not finish within"):
        harness.launch_multi_node(
            WORKER,
            2,
            tmp_path,
            args=WORKER_ARGS,
            timeout=HANG_TIMEOUT,
            env={
                "KERAS_DTENSOR_TEST_MARKER": marker,
                "PYTHONPATH": python_path,
                "STARTED_DIR": str(started_dir),
            },
        )
    started = [int(pid) for pid in os.listdir(started_dir)]
    assert len(started) == 2, "both nodes' workers should have started"
    assert processes_with_env("KERAS_DTENSOR_TEST_MARKER", marker) == []
