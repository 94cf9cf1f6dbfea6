"""Tests of `run.sh`, the two commands a new user types.

The setup logic runs against a copy of the script and its requirement files
with a stand-in Python that only logs its arguments: what gets created and
installed on a first run, that a second run installs nothing (stamps), that
a changed requirement file or a failed install installs again, the number
of example processes, and that `./run.sh test` keeps pytest's exit status.
One test trains the real example through `./run.sh example --steps 2` on
two gloo processes in this environment and checks the losses.
"""

import math
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT_FILES = (
    "run.sh",
    "requirements.txt",
    "requirements-test.txt",
    "requirements-keras-hub.txt",
    "pyproject.toml",
)
# Logs its arguments; `-m venv DIR` makes DIR/bin/python a copy of itself.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >>"$FAKE_PYTHON_LOG"
if [[ "$1 $2" == "-m venv" ]]; then
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
fi
if [[ "$2" == pip ]]; then exit "${FAKE_PIP_RC:-0}"; fi
if [[ "$2" == pytest ]]; then exit "${FAKE_PYTEST_RC:-0}"; fi
"""
RUNTIME_INSTALL = [
    "-m pip install -q -r requirements.txt",
    "-m pip install -q -e .",
]
TEST_INSTALL = [
    "-m pip install -q -r requirements-test.txt",
    "-m pip install -q --no-deps -r requirements-keras-hub.txt",
]
# Two ranks share one pipe, and an unbuffered `print` writes its text and
# its newline separately: one rank's line may end right after the other's
# text, so lines are not anchored.
LOSSES = re.compile(r"\[rank (\d+)\] losses: \[([^\]]*)\]")
EXAMPLE_TIMEOUT = 300


class FakeCheckout:
    """A copy of run.sh and its inputs, run with a logging fake Python."""

    def __init__(self, tmp_path):
        self.root = tmp_path / "checkout"
        self.root.mkdir()
        for name in SCRIPT_FILES:
            shutil.copy2(os.path.join(ROOT, name), self.root / name)
        self.python = tmp_path / "python3"
        self.python.write_text(FAKE_PYTHON)
        self.python.chmod(0o755)
        self.log = tmp_path / "calls.log"

    def run(self, *args, **env):
        """Runs `run.sh ARGS`; returns (exit status, logged calls, stderr)."""
        self.log.write_text("")
        process_env = dict(os.environ)
        process_env.pop("KERAS_DTENSOR_VENV", None)
        process_env.pop("KERAS_DTENSOR_SETUP", None)
        process_env.update(
            KERAS_DTENSOR_PYTHON=str(self.python),
            FAKE_PYTHON_LOG=str(self.log),
            **env,
        )
        completed = subprocess.run(
            [str(self.root / "run.sh"), *args],
            env=process_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        calls = self.log.read_text().splitlines()
        return completed.returncode, calls, completed.stderr


def _example_call(nproc, *args):
    return " ".join(
        [
            "-m torch.distributed.run --standalone",
            f"--nproc_per_node={nproc}",
            "examples/transformer_2d.py",
            *args,
        ]
    )


def _default_processes():
    """4 example processes, or 2 below 4 usable cores (as `nproc` counts)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    cores = int(
        subprocess.run(
            ["nproc"], env=env, capture_output=True, text=True, check=True
        ).stdout
    )
    return 4 if cores >= 4 else 2


def test_first_run_sets_up_and_second_run_only_trains(tmp_path):
    checkout = FakeCheckout(tmp_path)
    venv = checkout.root / ".venv"
    nproc = _default_processes()

    status, calls, _ = checkout.run("example", "--steps", "3")
    assert status == 0
    assert calls == [
        f"-m venv {venv}",
        "-m pip install -q --upgrade pip",
        *RUNTIME_INSTALL,
        _example_call(nproc, "--steps", "3"),
    ]

    status, calls, stderr = checkout.run("example")
    assert status == 0
    assert calls == [_example_call(nproc)]
    assert "runtime: up to date" in stderr


def test_test_command_adds_test_dependencies_once(tmp_path):
    checkout = FakeCheckout(tmp_path)
    status, calls, _ = checkout.run("test", "-x")
    assert status == 0
    assert calls[2:] == [*RUNTIME_INSTALL, *TEST_INSTALL, "-m pytest -q -x"]

    status, calls, _ = checkout.run("test")
    assert (status, calls) == (0, ["-m pytest -q"])
    # The example needs no more than the test set-up installed.
    status, calls, _ = checkout.run("example", KERAS_DTENSOR_NPROC="2")
    assert (status, calls) == (0, [_example_call(2)])


def test_changed_requirements_install_again(tmp_path):
    checkout = FakeCheckout(tmp_path)
    assert checkout.run("test")[0] == 0
    with open(checkout.root / "requirements.txt", "a") as f:
        f.write("# changed\n")
    status, calls, _ = checkout.run("test")
    # requirements-test.txt includes requirements.txt only by name: its
    # stamp is unchanged, the runtime's is not.
    assert (status, calls) == (0, [*RUNTIME_INSTALL, "-m pytest -q"])

    with open(checkout.root / "requirements-keras-hub.txt", "a") as f:
        f.write("# changed\n")
    status, calls, _ = checkout.run("test")
    assert (status, calls) == (0, [*TEST_INSTALL, "-m pytest -q"])


def test_failed_install_is_retried_and_stops_the_command(tmp_path):
    checkout = FakeCheckout(tmp_path)
    status, calls, _ = checkout.run("example", FAKE_PIP_RC="1")
    assert status == 1
    # pip's upgrade fails first: no install, no training.
    assert calls[1:] == ["-m pip install -q --upgrade pip"]

    status, calls, _ = checkout.run("example", KERAS_DTENSOR_NPROC="2")
    assert (status, calls) == (0, [*RUNTIME_INSTALL, _example_call(2)])


@pytest.mark.parametrize("pytest_status", [0, 1, 5])
def test_test_command_keeps_pytest_exit_status(tmp_path, pytest_status):
    checkout = FakeCheckout(tmp_path)
    status, calls, _ = checkout.run("test", FAKE_PYTEST_RC=str(pytest_status))
    assert status == pytest_status
    assert calls[-1] == "-m pytest -q"


def test_setup_0_and_another_venv_install_nothing(tmp_path):
    checkout = FakeCheckout(tmp_path)
    venv = tmp_path / "other_venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy2(checkout.python, venv / "bin" / "python")
    status, calls, _ = checkout.run(
        "example",
        KERAS_DTENSOR_VENV=str(venv),
        KERAS_DTENSOR_SETUP="0",
        KERAS_DTENSOR_NPROC="3",
    )
    assert (status, calls) == (0, [_example_call(3)])
    assert not (checkout.root / ".venv").exists()

    status, calls, stderr = checkout.run("test", KERAS_DTENSOR_SETUP="0")
    assert (status, calls) == (1, [])
    assert "has no bin/python" in stderr


def test_unknown_command_prints_usage(tmp_path):
    checkout = FakeCheckout(tmp_path)
    status, calls, stderr = checkout.run("train")
    assert (status, calls) == (2, [])
    assert "./run.sh example" in stderr and "./run.sh test" in stderr


def test_example_trains_through_run_sh():
    """`./run.sh example --steps 2` on 2 processes in this environment."""
    venv = sys.prefix
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        pytest.skip(f"{venv} is not a virtual environment with bin/python")
    env = dict(os.environ)
    env.update(
        KERAS_DTENSOR_VENV=venv,
        KERAS_DTENSOR_SETUP="0",
        KERAS_DTENSOR_NPROC="2",
        PYTHONUNBUFFERED="1",
        KERAS_DTENSOR_TIMEOUT_SECONDS=str(EXAMPLE_TIMEOUT // 2),
    )
    process = subprocess.Popen(
        [os.path.join(ROOT, "run.sh"), "example", "--steps", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=EXAMPLE_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"run.sh example timed out:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    assert "mesh: {'batch': 1, 'model': 2}" in output
    losses = {
        int(rank): [float(v) for v in values.split(",")]
        for rank, values in LOSSES.findall(output)
    }
    assert sorted(losses) == [0, 1], output[-4000:]
    assert len(losses[0]) == 2
    assert all(math.isfinite(v) for v in losses[0])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
