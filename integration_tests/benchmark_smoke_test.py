"""Smoke test of the benchmark harness (`benchmarks/run.py`).

Runs the smallest configuration on 2 gloo processes under a hard timeout
and checks that every figure is well-formed: step times positive and
finite, collective counts integers, memory in bytes, the mount really off
and on in the overhead runs, Keras computing the same global losses as
its native PyTorch twin over several steps in every cell, and memory
limits that follow from each mode's definition. It asserts nothing about
timing.
"""

import json
import math
import os
import sys

import harness
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "benchmarks", "run.py")
MODES = ("single", "dp", "tp", "2d", "fsdp")
TIMEOUT = 240


def _positive(value):
    number = isinstance(value, (int, float))
    return number and math.isfinite(value) and value > 0


def _count(value):
    return isinstance(value, int) and value >= 0


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = [
        "--workload=mlp",
        f"--modes={','.join(MODES)}",
        "--hidden=32",
        "--layers=1",
        "--batch=8",
        "--seq=8",
        "--vocab=16",
        "--steps=2",
        "--warmup=1",
        "--single-timeout=120",
        f"--out={out}",
        "--tag=smoke",
    ]
    harness.run_script(RUN, 2, args, TIMEOUT, ROOT)
    with open(out / "smoke.json") as f:
        data = json.load(f)
    data["markdown"] = (out / "smoke.md").read_text()
    return data


def test_every_cell_ran(results):
    cells = {(c["workload"], c["mode"]): c for c in results["cells"]}
    assert set(cells) == {("mlp", mode) for mode in MODES}
    for key, cell in cells.items():
        assert "error" not in cell, (key, cell["error"])


def test_step_times_are_positive_and_finite(results):
    for cell in results["cells"]:
        for name in ("keras", "native"):
            assert _positive(cell["step_ms"][name]), (cell["mode"], name)
        assert _positive(cell["ratio"])
        for name in ("keras", "native"):
            assert _count(cell["python_calls"][name]), (cell["mode"], name)


def test_collective_counts_are_integers(results):
    for cell in results["cells"]:
        for name in ("keras", "native", "minimum"):
            counts = cell["collectives"][name]
            for phase in ("forward", "total"):
                assert _count(counts[phase]), (cell["mode"], name, phase)
            assert counts["forward"] <= counts["total"]
        keras_ops = cell["collectives"]["keras"]["ops"]
        assert all(_count(n) for n in keras_ops.values())
        assert sum(keras_ops.values()) == cell["collectives"]["keras"]["total"]
        if cell["mode"] == "single":
            assert cell["collectives"]["keras"]["total"] == 0


def test_memory_is_in_bytes(results):
    for cell in results["cells"]:
        for name in ("keras", "native"):
            memory = cell["memory"][name]
            for key in ("params", "grads", "optimizer", "total", "limit"):
                assert _count(memory[key]) and memory[key] > 0, (name, key)
            assert _count(memory["buffers"])
            assert memory["total"] == (
                memory["params"]
                + memory["grads"]
                + memory["optimizer"]
                + memory["buffers"]
            )
            assert _positive(memory["ratio"])
            assert memory["limit"] == cell["memory"]["keras"]["limit"]


def test_memory_limits_follow_the_mode_definitions(results):
    """Replicated modes need the single-process bytes; fsdp a 1/N share;
    tp less than replicated. DDP's gradient buckets count natively."""
    memory = {c["mode"]: c["memory"] for c in results["cells"]}
    world = results["world"]
    single = memory["single"]["keras"]["limit"]
    assert memory["dp"]["keras"]["limit"] == single
    assert abs(memory["fsdp"]["keras"]["limit"] * world - single) <= world
    assert memory["tp"]["keras"]["limit"] < single
    for mode in ("single", "tp", "fsdp"):
        assert memory[mode]["native"]["buffers"] == 0, mode
        assert memory[mode]["keras"]["buffers"] == 0, mode
    for mode in ("dp", "2d"):
        assert memory[mode]["native"]["buffers"] > 0, mode
    # DDP's buckets hold a copy of every gradient it reduces.
    native = memory["dp"]["native"]
    assert native["buffers"] == native["grads"]


def test_keras_and_native_train_the_same_model(results):
    """Global losses agree over several steps, in every cell."""
    for cell in results["cells"]:
        twin = cell["twin"]
        assert twin["steps"] >= 3
        assert len(twin["keras"]) == len(twin["native"]) == twin["steps"]
        assert twin["ok"], (cell["mode"], twin)
        assert twin["max_rel_diff"] < 1e-4, (cell["mode"], twin)
        # Training moved the loss: the steps after the first compare the
        # updates too.
        assert twin["keras"][-1] != twin["keras"][0]


def test_mount_overhead_runs_toggle_the_mount(results):
    (row,) = results["overhead"]
    assert "error" not in row, row
    assert _positive(row["ratio"]) and _positive(row["native_ratio"])
    assert _positive(row["corrected_ratio"])
    for key in ("ratio_quartiles", "native_quartiles", "corrected_quartiles"):
        assert all(_positive(q) for q in row[key]), key
    assert row["pairs"] == 2
    assert all(_count(n) and n > 0 for n in row["python_calls"].values())
    off, on = row["mount"]["off"], row["mount"]["on"]
    assert not off["finder_armed"] and not off["distribution_lib_bound"]
    assert on["finder_armed"] and on["distribution_lib_bound"]


def test_markdown_has_every_table(results):
    text = results["markdown"]
    for title in ("Step time", "Collectives", "Per-rank memory", "Overhead"):
        assert title in text
    assert "twin check" in text
    assert text.count(" steps, ") == len(MODES)
    assert text.count("| mlp |") >= 3 * len(MODES)


def test_results_record_the_code_measured(results):
    code = results["code"]
    assert set(code) == {"commit", "modified"}
    assert code["commit"] is None or isinstance(code["commit"], str)
    assert all(isinstance(path, str) for path in code["modified"])
    assert "Code: commit" in results["markdown"]


def test_local_batch_cell_gives_the_data_parallel_floor(results):
    # One local-batch cell per workload: the single-process model on one
    # process's share (8 / 2 examples), run in every process at once.
    (local,) = results["local_cells"]
    assert "error" not in local, local.get("error")
    assert (local["workload"], local["mode"]) == ("mlp", "single")
    assert local["local_batch"] == 4
    for name in ("keras", "native"):
        assert _positive(local["step_ms"][name])
    assert local["twin"]["ok"]
    # The report divides by the single-process ratio and shows the floor
    # of the data-parallel row only.
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import report

    single = report.single_cells(results["cells"])["mlp"]
    dp = next(c for c in results["cells"] if c["mode"] == "dp")
    floor = report.floor_ratio(dp, single, local)
    expected = (
        (
            local["step_ms"]["keras"]
            + dp["step_ms"]["native"]
            - local["step_ms"]["native"]
        )
        / dp["step_ms"]["native"]
        / single["ratio"]
    )
    assert math.isclose(floor, expected)
    row = next(
        line
        for line in results["markdown"].splitlines()
        if line.startswith("| mlp | dp |")
    )
    assert f"| {floor:.2f} |" in row
    assert "**Local batch**" in results["markdown"]


def test_jit_column_gives_the_first_step_against_single_processes():
    # `--jit` compiles for minutes, so the smoke run leaves it off; the
    # column is checked on cells shaped as `cell.py` fills them.
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import report

    def cell(keras_jit_ms, first_step_s):
        return {
            "step_ms": {"keras": 20.0, "keras_jit": keras_jit_ms},
            "jit_speedup": 20.0 / keras_jit_ms,
            "jit_compile_s": first_step_s,
        }

    single, dp = cell(10.0, 30.0), cell(8.0, 42.0)
    assert report.jit_text(dp, single) == (
        "8.00 (2.50x); first step 42.0 s (1.40x single's)"
    )
    assert report.jit_text(single, single) == (
        "10.0 (2.00x); first step 30.0 s"
    )
    assert report.jit_text({"step_ms": {"keras": 20.0}}) == "not run"
