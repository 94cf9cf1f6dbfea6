"""The environment that the harness gives its worker processes.

Workers run on CPU and gloo whatever GPUs are visible, unless
`KERAS_DTENSOR_TEST_NCCL=1` asks for NCCL and there is one GPU per
process; every launch checks its collectives with
`TORCH_DISTRIBUTED_DEBUG=DETAIL`. A failed launch keeps its whole output.
Reference runs that share a launch must agree on every process.
"""

import harness
import pytest

BASE = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1"}


def test_default_hides_gpus_and_checks_collectives():
    env = harness.worker_env("/results", 240, base=BASE, nprocs=2, gpu_count=2)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    assert env["PYTHONFAULTHANDLER"] == "1"
    assert env["KERAS_BACKEND"] == "torch"
    assert env["KERAS_DTENSOR_TIMEOUT_SECONDS"] == "120"
    assert env[harness.RESULT_DIR_ENV] == "/results"
    assert env["PATH"] == "/usr/bin"


def test_nccl_opt_in_keeps_gpus_when_there_are_enough():
    base = dict(BASE, **{harness.NCCL_ENV_VAR: "1"})
    env = harness.worker_env("/results", 240, base=base, nprocs=2, gpu_count=2)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"


def test_debug_level_may_be_set_for_the_workers():
    base = dict(BASE, **{harness.DEBUG_ENV_VAR: "OFF"})
    env = harness.worker_env("/results", 240, base=base, nprocs=2, gpu_count=2)
    assert env["TORCH_DISTRIBUTED_DEBUG"] == "OFF"


def test_nccl_opt_in_falls_back_to_cpu_with_too_few_gpus():
    base = dict(BASE, **{harness.NCCL_ENV_VAR: "1"})
    env = harness.worker_env("/results", 240, base=base, nprocs=4, gpu_count=2)
    assert env["CUDA_VISIBLE_DEVICES"] == ""


def test_extra_env_applies_last():
    env = harness.worker_env(
        "/results",
        240,
        env={"TORCH_DISTRIBUTED_DEBUG": "OFF"},
        base=BASE,
        gpu_count=0,
    )
    assert env["TORCH_DISTRIBUTED_DEBUG"] == "OFF"


def test_os_environ_is_the_default_base(monkeypatch):
    monkeypatch.setenv("KERAS_DTENSOR_HARNESS_PROBE", "x")
    monkeypatch.delenv(harness.NCCL_ENV_VAR, raising=False)
    env = harness.worker_env("/results", 20)
    assert env["KERAS_DTENSOR_HARNESS_PROBE"] == "x"
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["KERAS_DTENSOR_TIMEOUT_SECONDS"] == "30"


def test_a_failed_launch_keeps_its_whole_output(tmp_path):
    script = tmp_path / "noisy_worker.py"
    script.write_text(
        "import sys\n"
        "for i in range(200):\n"
        "    print('line', i, file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    with pytest.raises(harness.WorkerFailure) as failure:
        harness.launch(str(script), 1, tmp_path, timeout=120)
    message = str(failure.value)
    assert "line 199" in message and "line 0\n" not in message
    assert "line 0\n" in failure.value.output
    assert "line 199" in failure.value.output


def test_reference_runs_must_agree_on_every_process(tmp_path):
    # Reports as `worker_utils.report` writes them, without importing
    # torch or keras: `same` is equal on both ranks, `ref` is each rank's.
    script = tmp_path / "rank_worker.py"
    script.write_text(
        "import json, os\n"
        "rank = int(os.environ['RANK'])\n"
        "path = os.path.join(\n"
        "    os.environ['KERAS_DTENSOR_TEST_RESULT_DIR'], f'rank{rank}.json'\n"
        ")\n"
        "with open(path, 'w') as f:\n"
        "    json.dump({'same/value': 7, 'ref/value': rank}, f)\n"
    )
    reports = harness.launch_references_first(
        str(script), 2, tmp_path / "agree", ["same"], ["ref"], timeout=120
    )
    assert [report["ref/value"] for report in reports] == [0, 1]
    with pytest.raises(harness.WorkerFailure, match="processes 0 and 1"):
        harness.launch_references_first(
            str(script), 2, tmp_path / "differ", ["ref"], [], timeout=120
        )
