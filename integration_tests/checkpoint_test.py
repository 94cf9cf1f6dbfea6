"""Checkpoints on 2 and 4 gloo processes, compared with single-process keras.

Each launch runs many checks (see the worker scripts `workers/checkpoint_*`);
single-process keras reads what they wrote, on the torch and numpy backends,
in one `checkpoint_reader.py` process per backend. Values are compared
exactly. Every launch and every reader has a hard timeout.
"""

import json
import os
import subprocess
import sys

import harness
import numpy as np
import pytest

KERAS_DISTRIBUTIONS = ["dp", "mp", "mp2d"]
EXPECTED_KERNEL_PLACEMENTS = {
    "dp": ["R"],
    "mp": ["S(1)"],
    "mp2d": ["R", "S(1)"],
}
SYNC_ENV = {"KERAS_DTENSOR_SYNC_TIMEOUT_SECONDS": "5"}
READER_TIMEOUT = 240
STEPS_PER_EPOCH = 4


def assert_same_arrays(actual, expected):
    """Exact equality of two lists of (nested-list) arrays."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def assert_same_state(actual, expected):
    """Exact equality of `checkpoint_models.state` results."""
    assert_same_arrays(actual["weights"], expected["weights"])
    assert_same_arrays(actual["optimizer"], expected["optimizer"])


def assert_same_keyed(actual, expected):
    """Exact equality of `checkpoint_models.keyed_state` results."""
    assert list(actual) == list(expected)
    for key in expected:
        np.testing.assert_array_equal(
            np.asarray(actual[key]), np.asarray(expected[key]), err_msg=key
        )


def run_reader(jobs, tmp_path, backend):
    """Runs single-process keras jobs (see `workers/checkpoint_reader.py`)."""
    os.makedirs(tmp_path, exist_ok=True)
    jobs_path = os.path.join(tmp_path, f"jobs_{backend}.json")
    out_path = os.path.join(tmp_path, f"results_{backend}.json")
    with open(jobs_path, "w") as f:
        json.dump(jobs, f)
    env = dict(os.environ, KERAS_BACKEND=backend, OMP_NUM_THREADS="1")
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    completed = subprocess.run(
        [
            sys.executable,
            os.path.join(harness.WORKERS_DIR, "checkpoint_reader.py"),
            jobs_path,
            out_path,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=READER_TIMEOUT,
    )
    assert completed.returncode == 0, completed.stderr[-5000:]
    with open(out_path) as f:
        return json.load(f)


def launch_expecting_failure(worker, nprocs, tmp_path, args, env=None):
    """Launches a worker that must fail; returns the failure message."""
    with pytest.raises(harness.WorkerFailure) as failure:
        harness.launch(worker, nprocs, f"{tmp_path}_launch", args=args, env=env)
    message = str(failure.value)
    # A failure, not a hang: the launch ended before its hard timeout.
    assert "did not finish within" not in message
    return message


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def reference(work):
    """A model trained and saved by single-process keras, no distribution."""
    directory = os.path.join(work, "reference")
    os.makedirs(directory)
    jobs = [["reference", "write-reference", directory]]
    return run_reader(jobs, directory, "torch")["reference"]


@pytest.fixture(scope="module")
def two_process_run(work, reference):
    """Keras formats, sharded checkpoints and callbacks on 2 processes."""
    return harness.launch(
        "checkpoint_worker.py",
        2,
        work,
        args=[
            os.path.join(work, "two"),
            os.path.join(work, "reference"),
            ",".join(KERAS_DISTRIBUTIONS),
        ],
    )


@pytest.fixture(scope="module")
def keras_run(two_process_run):
    return two_process_run


@pytest.fixture(scope="module")
def sharded_two(two_process_run):
    return two_process_run


@pytest.fixture(scope="module")
def callbacks_run(two_process_run):
    return two_process_run


@pytest.fixture(scope="module")
def sharded_four(work, sharded_two):
    return harness.launch(
        "checkpoint_sharded_worker.py",
        4,
        work,
        args=["four", os.path.join(work, "two", "sharded")],
        timeout=360,
    )


@pytest.fixture(scope="module")
def killed_keras(work):
    directory = os.path.join(work, "killed_keras")
    os.makedirs(directory)
    message = launch_expecting_failure(
        "checkpoint_killed_worker.py", 2, directory, ["keras", directory]
    )
    return directory, message


@pytest.fixture(scope="module")
def killed_sharded(work):
    directory = os.path.join(work, "killed_sharded")
    os.makedirs(directory)
    message = launch_expecting_failure(
        "checkpoint_killed_worker.py", 2, directory, ["sharded", directory]
    )
    return directory, message


def keras_files(work):
    """Name -> (model.keras, model.weights.h5) written under distributions."""
    files = {
        name: os.path.join(work, "two", "keras", name)
        for name in KERAS_DISTRIBUTIONS
    }
    files["mp2x2"] = os.path.join(work, "two", "sharded", "mp2x2")
    files["killed"] = os.path.join(work, "killed_keras")
    return {
        name: (
            os.path.join(directory, "model.keras"),
            os.path.join(directory, "model.weights.h5"),
        )
        for name, directory in files.items()
    }


@pytest.fixture(scope="module")
def torch_reads(work, keras_run, sharded_four, killed_keras, killed_sharded):
    jobs = [
        [name, "read-keras", *paths]
        for name, paths in keras_files(work).items()
    ]
    for name in ("sharded_mp", "sharded_mp2x2"):
        directory = os.path.join(work, "two", "sharded", name)
        jobs.append([name, "read-sharded", directory])
    jobs.append(
        [
            "killed_sharded",
            "read-sharded",
            os.path.join(work, "killed_sharded", "sharded"),
        ]
    )
    return run_reader(jobs, os.path.join(work, "reads"), "torch")


@pytest.fixture(scope="module")
def numpy_reads(work, keras_run, sharded_four):
    jobs = [
        [name, "read-keras", *paths]
        for name, paths in keras_files(work).items()
        if name != "killed"
    ]
    return run_reader(jobs, os.path.join(work, "reads"), "numpy")


# Keras formats.


@pytest.mark.parametrize("name", KERAS_DISTRIBUTIONS)
def test_keras_files_round_trip_under_distribution(keras_run, name):
    trained = keras_run[0][f"{name}/trained"]
    for report in keras_run:
        assert_same_state(report[f"{name}/trained"], trained)
        assert_same_state(report[f"{name}/load_model"], trained)
        assert_same_state(report[f"{name}/load_weights"], trained)
        expected = EXPECTED_KERNEL_PLACEMENTS[name]
        assert report[f"{name}/kernel_placements"] == expected
        assert report[f"{name}/loaded_kernel_placements"] == expected


@pytest.mark.parametrize("name", KERAS_DISTRIBUTIONS)
def test_process_zero_alone_writes_then_renames(keras_run, work, name):
    directory = os.path.join(work, "two", "keras", name)
    writer, other = keras_run
    # Process 0 writes into a staging folder beside each destination.
    assert len(writer[f"{name}/written"]) == 2
    for path, final in zip(
        writer[f"{name}/written"], ["model.keras", "model.weights.h5"]
    ):
        staging, file_name = os.path.split(path)
        assert file_name == final
        assert os.path.dirname(staging) == directory
        assert os.path.basename(staging).startswith(f".{final}.staging-")
    # The other process writes the same two files, each into a temporary
    # folder of its own outside the destination folder, deleted after.
    assert len(other[f"{name}/written"]) == 2
    for path, final in zip(
        other[f"{name}/written"], ["model.keras", "model.weights.h5"]
    ):
        scratch, file_name = os.path.split(path)
        assert file_name == final
        assert not path.startswith(str(work))
        assert os.path.basename(scratch).startswith("keras_discarded_save_")
        assert not os.path.exists(scratch)
    for report in keras_run:
        assert report[f"{name}/listing"] == ["model.keras", "model.weights.h5"]
        # No prompt under several processes: every process raises.
        error = report[f"{name}/overwrite_false"]
        assert error.startswith("FileExistsError: Not overwriting")


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("name", KERAS_DISTRIBUTIONS + ["mp2x2"])
def test_keras_files_load_in_single_process_keras(
    keras_run, sharded_four, torch_reads, numpy_reads, backend, name
):
    reads = {"torch": torch_reads, "numpy": numpy_reads}[backend][name]
    assert reads["backend"] == backend
    if name == "mp2x2":
        trained = sharded_four[0]["mp2x2/state"]
        for report in sharded_four:
            assert_same_state(report["mp2x2/load_model"], trained)
    else:
        trained = keras_run[0][f"{name}/trained"]
    assert_same_state(reads["load_model"], trained)
    assert_same_state(reads["load_weights"], trained)


@pytest.mark.parametrize("name", KERAS_DISTRIBUTIONS)
def test_single_process_files_load_into_sharded_models(
    keras_run, reference, name
):
    for report in keras_run:
        assert_same_state(
            report[f"{name}/reference_load_model"], reference["state"]
        )
        assert_same_state(
            report[f"{name}/reference_load_weights"], reference["state"]
        )


@pytest.mark.parametrize("name", KERAS_DISTRIBUTIONS)
def test_training_goes_on_identically_after_loading(keras_run, name):
    for report in keras_run:
        after_save = report[f"{name}/losses_after_save"]
        assert len(after_save) == STEPS_PER_EPOCH
        assert report[f"{name}/losses_after_load"] == after_save


def test_one_rank_save_or_load_fails_fast_and_ranks_carry_on(keras_run):
    save_error = keras_run[0]["one_rank/save"]
    load_error = keras_run[1]["one_rank/load"]
    assert save_error.startswith("RuntimeError: `save_model`")
    assert "process(es) [1] did not call it" in save_error
    assert load_error.startswith("RuntimeError: `load_weights`")
    assert "process(es) [0] did not call it" in load_error
    for error in (save_error, load_error):
        assert "call saving and loading functions on every process" in error
        assert "KERAS_DTENSOR_SYNC_TIMEOUT_SECONDS" in error
    for key in ("one_rank/predict_1", "one_rank/predict_2"):
        assert_same_arrays([keras_run[0][key]], [keras_run[1][key]])
    listing = keras_run[0]["one_rank/listing"]
    assert "alone.keras" not in listing
    assert "after.weights.h5" in listing


def test_one_rank_save_uncaught_ends_the_job_fast(work):
    directory = os.path.join(work, "one_rank")
    os.makedirs(directory)
    message = launch_expecting_failure(
        "checkpoint_one_rank_worker.py",
        2,
        directory,
        [directory],
        env=SYNC_ENV,
    )
    assert "RuntimeError: `save_model`" in message
    assert "process(es) [1] did not call it within 5 seconds" in message
    assert "remove any `if process_id == 0:` guard" in message
    assert os.listdir(directory) == []


# Sharded checkpoints.


def test_sharded_keys_are_stable(sharded_two, sharded_four, reference):
    keys = sharded_two[0]["mp/saved/keys"]
    assert keys == list(reference["keyed"])
    assert "layers/dense/kernel" in keys
    assert "optimizer/iteration" in keys
    assert "optimizer/layers/dense_2/bias/velocity" in keys
    for report in sharded_two:
        # Two instances: auto-generated paths differ, keys do not.
        assert report["mp/saved/paths"] != report["dp/loaded/paths"]
        for prefix in ("mp/saved", "dp/loaded", "mp2d/loaded_reference"):
            assert report[f"{prefix}/keys"] == keys
    for report in sharded_four:
        for prefix in ("mp4/loaded_from_mp", "mp2x2/saved"):
            assert report[f"{prefix}/keys"] == keys


def test_each_rank_writes_only_its_own_shards(sharded_two, sharded_four):
    # Every kernel and bias (and their optimizer slots) is sharded in two on
    # the `model` axis, the last mesh axis, of size 2: rank r holds shard
    # r % 2. Each shard is written once, by a rank that holds it; rank r
    # writes the file `__r_0.distcp`.
    for chunks in (
        sharded_two[0]["mp/chunk_files"],
        sharded_four[0]["mp2x2/chunk_files"],
    ):
        assert "layers/dense/kernel" in chunks
        for key, key_chunks in chunks.items():
            if key in ("optimizer/iteration", "optimizer/learning_rate"):
                assert len(key_chunks) == 1
                continue
            key_chunks = sorted(key_chunks, key=lambda c: max(c[0]))
            assert len(key_chunks) == 2, key
            for index, (_, file_name) in enumerate(key_chunks):
                writer = int(file_name.split("_")[2])
                assert writer % 2 == index, (key, key_chunks)


def test_sharded_checkpoint_is_replaced_atomically(sharded_two):
    for report in sharded_two:
        assert report["sharded/listing"] == ["sharded_mp"]


def test_sharded_load_onto_another_layout_same_world(sharded_two):
    saved = sharded_two[0]["mp/saved/state"]
    for report in sharded_two:
        assert_same_keyed(report["mp/saved/state"], saved)
        assert report["dp/loaded/kernel_placements"] == ["R"]
        assert_same_keyed(report["dp/loaded/state"], saved)


def test_sharded_load_1_to_2(sharded_two, reference):
    for report in sharded_two:
        assert report["mp2d/loaded_reference/kernel_placements"] == [
            "R",
            "S(1)",
        ]
        assert_same_keyed(
            report["mp2d/loaded_reference/state"], reference["keyed"]
        )


def test_sharded_load_2_to_1_without_process_group(sharded_two, torch_reads):
    read = torch_reads["sharded_mp"]
    assert read["process_group"] is False
    assert_same_keyed(read["keyed"], sharded_two[0]["mp/saved/state"])


def test_sharded_load_2_to_4(sharded_two, sharded_four):
    saved = sharded_two[0]["mp/saved/state"]
    for report in sharded_four:
        assert report["mp4/loaded_from_mp/kernel_placements"] == ["S(1)"]
        assert_same_keyed(report["mp4/loaded_from_mp/state"], saved)


def test_sharded_load_2x2_to_4_and_to_1(sharded_four, torch_reads):
    saved = sharded_four[0]["mp2x2/saved/state"]
    for report in sharded_four:
        assert report["mp2x2/saved/kernel_placements"] == ["R", "S(1)"]
        assert_same_keyed(report["mp2x2/saved/state"], saved)
        assert_same_keyed(report["mp4/loaded_from_mp2x2/state"], saved)
    assert_same_keyed(torch_reads["sharded_mp2x2"]["keyed"], saved)


def test_training_goes_on_identically_after_sharded_load(sharded_two):
    for report in sharded_two:
        after_save = report["sharded/losses_after_save"]
        assert len(after_save) == STEPS_PER_EPOCH
        assert report["sharded/losses_after_load"] == after_save


# Callbacks.


@pytest.mark.parametrize("name", KERAS_DISTRIBUTIONS)
def test_model_checkpoint(callbacks_run, name):
    epoch_states = callbacks_run[0][f"{name}/epoch_states"]
    losses = callbacks_run[0][f"{name}/epoch_losses"]
    best_epoch = int(np.argmin(losses))
    for report in callbacks_run:
        assert report[f"{name}/epoch_losses"] == losses
        assert len(report[f"{name}/checkpoint_states"]) == len(epoch_states)
        for loaded, expected in zip(
            report[f"{name}/checkpoint_states"], epoch_states
        ):
            assert_same_state(loaded, expected)
        assert_same_state(
            report[f"{name}/best_state"], epoch_states[best_epoch]
        )
        assert report[f"{name}/checkpoint_listing"] == [
            f"w-{epoch:02d}.weights.h5"
            for epoch in range(1, len(epoch_states) + 1)
        ]


@pytest.mark.parametrize("name", KERAS_DISTRIBUTIONS)
def test_backup_and_restore(callbacks_run, name):
    for report in callbacks_run:
        # The worker's own interruption, not some other error of `fit`.
        assert (
            report[f"{name}/interrupted"]
            == "RuntimeError: Interrupting training"
        )
        assert report[f"{name}/backup_listing"] == [
            "latest.weights.h5",
            "latest.weights.h5.bkp",
            "training_metadata.json",
            "training_metadata.json.bkp",
        ]
        assert report[f"{name}/resumed_epochs"] == [2, 3]
        uninterrupted = report[f"{name}/uninterrupted_losses"]
        assert len(uninterrupted) == 4 * STEPS_PER_EPOCH
        # The checkpointing callbacks do not change training.
        assert report[f"{name}/checkpointed_losses"] == uninterrupted
        assert (
            report[f"{name}/resumed_losses"]
            == uninterrupted[2 * STEPS_PER_EPOCH :]
        )
        assert_same_state(
            report[f"{name}/resumed_state"],
            report[f"{name}/uninterrupted_state"],
        )
        assert_same_state(
            report[f"{name}/resumed_state"], report[f"{name}/epoch_states"][-1]
        )
        assert report[f"{name}/backup_deleted"] is True


# Resume and killed saves.


def test_resume_after_kill_under_torchrun_restart(work):
    directory = os.path.join(work, "resume")
    os.makedirs(directory)
    reports = harness.launch(
        "checkpoint_resume_worker.py",
        2,
        work,
        args=[directory],
        torchrun_args=["--standalone", "--max-restarts=1"],
        # A fresh store for each attempt: restarted workers must not find
        # the addresses of the killed ones.
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        timeout=360,
    )
    for report in reports:
        assert report["restart_count"] == 1
        # Killed in epoch 2: resumed from the backup of epoch 1.
        assert report["resumed_epochs"] == [2, 3]
        resumed = report["resumed_losses"]
        assert len(resumed) == 2 * STEPS_PER_EPOCH
        assert resumed == report["uninterrupted_losses"][2 * STEPS_PER_EPOCH :]
        assert_same_state(
            report["resumed_state"], report["uninterrupted_state"]
        )


def read_expected(directory):
    with open(os.path.join(directory, "expected.json")) as f:
        return json.load(f)


def test_killed_keras_save_leaves_previous_file(killed_keras, torch_reads):
    directory, message = killed_keras
    assert "exited with" in message
    expected = read_expected(directory)
    # The writer died mid-write: its partial file is in a staging folder.
    staging = [e for e in os.listdir(directory) if ".staging-" in e]
    assert len(staging) == 1
    assert staging[0].startswith(".model.weights.h5.staging-")
    partial = os.path.join(directory, staging[0], "model.weights.h5")
    final = os.path.join(directory, "model.weights.h5")
    assert os.path.getsize(partial) < os.path.getsize(final)
    # The destination holds the previous save, complete.
    read = torch_reads["killed"]
    assert_same_state(read["load_weights"], expected)
    assert_same_state(read["load_model"], expected)


def test_killed_sharded_save_leaves_previous_checkpoint(
    killed_sharded, torch_reads
):
    directory, message = killed_sharded
    assert "exited with" in message
    expected = read_expected(directory)
    staging = [e for e in os.listdir(directory) if ".staging-" in e]
    assert len(staging) == 1
    written = sorted(os.listdir(os.path.join(directory, staging[0])))
    # Shards were written, the metadata never was.
    assert "__1_0.distcp" in written
    assert ".metadata" not in written
    assert_same_keyed(torch_reads["killed_sharded"]["keyed"], expected)
