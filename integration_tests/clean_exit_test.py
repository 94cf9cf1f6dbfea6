"""A process set up by `keras.distribution.initialize()` exits cleanly.

`workers/exit_worker.py` trains under `DataParallel` on 2 gloo
processes (asynchronous bucket all-reduces), then ends as a user's script
does: falling off its end, `sys.exit(0)`, or tearing the process group
down itself (`torch.distributed.destroy_process_group()`, as torch asks)
must give status 0 on every process, and an exception on every process
its own status (1), never an abort at exit
("terminate called without an active exception", SIGABRT) as happened
when the process group was left to the interpreter's finalization. The
script run again under glibc's heap checks, with freed memory filled
(`MALLOC_PERTURB_`), gives the same losses: no buffer of an asynchronous
all-reduce is freed, or read after it is freed, while the all-reduce
runs.
"""

import json
import os

import harness
import pytest

WORKER = os.path.join(harness.WORKERS_DIR, "exit_worker.py")
ROOT = os.path.dirname(harness.WORKERS_DIR)
TIMEOUT = 180
ABORTS = ("terminate called", "SIGABRT", "Signal 6", "Fatal Python error")
MALLOC_DEBUG = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"


@pytest.mark.parametrize("ending", ["end", "sys_exit", "destroy"])
def test_script_ends_with_status_zero(ending):
    harness.run_script(WORKER, 2, [ending], TIMEOUT, ROOT)


def test_an_exception_on_every_process_gives_its_status():
    with pytest.raises(harness.WorkerFailure) as failure:
        harness.run_script(WORKER, 2, ["raise"], TIMEOUT, ROOT)
    output = failure.value.output
    assert "ValueError: the script's own error" in output
    assert "exitcode  : 1 " in output, output[-3000:]
    for abort in ABORTS:
        assert abort not in output, abort


def losses(folder, monkeypatch, heap_checks):
    """Each process's losses of the script, run to its end."""
    os.makedirs(folder)
    monkeypatch.setenv("EXIT_WORKER_LOSSES", str(folder))
    if heap_checks:
        monkeypatch.setenv("LD_PRELOAD", MALLOC_DEBUG)
        monkeypatch.setenv("MALLOC_CHECK_", "3")
        monkeypatch.setenv("MALLOC_PERTURB_", "165")
    harness.run_script(WORKER, 2, ["end"], TIMEOUT, ROOT)
    result = []
    for rank in range(2):
        with open(os.path.join(folder, f"rank{rank}.json")) as f:
            result.append(json.load(f))
    return result


@pytest.mark.skipif(
    not os.path.exists(MALLOC_DEBUG), reason="glibc's malloc debug library"
)
def test_heap_checks_and_freed_memory_filled_give_the_same_losses(
    tmp_path, monkeypatch
):
    plain = losses(tmp_path / "plain", monkeypatch, heap_checks=False)
    checked = losses(tmp_path / "checked", monkeypatch, heap_checks=True)
    assert len(plain[0]) == 2
    assert plain[0] == plain[1]
    assert checked == plain
