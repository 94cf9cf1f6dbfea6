"""Smoke test of `benchmarks/keras_hub_step.py`, the keras-hub harness.

Runs its tiny preset (Llama only: its attention takes
`scaled_dot_product_attention` on CPU too) on 2 gloo processes under a
hard timeout, without a distribution, under DataParallel and under
ModelParallel (1, 2) with the backbone's own layout map, and the native
Llama twin without a distribution and under `parallelize_module`, and
checks its report: the distributed runs within float32 summation order
of the run without a distribution, the attention kernels read from the
profiler, step times positive, and the CPU peak memory above the bytes
held. It asserts nothing about timing.
"""

import json
import math
import os

import harness
import pytest

harness.require("keras_hub")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "keras_hub_step.py")
TIMEOUT = 240


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("keras_hub_step")
    args = [
        "--preset=tiny",
        "--models=llama,native_llama",
        "--modes=dp,mp",
        "--warmup=1",
        "--steps=1",
        f"--out={out}",
        "--tag=smoke",
    ]
    harness.run_script(SCRIPT, 2, args, TIMEOUT, ROOT)
    with open(os.path.join(out, "smoke.json")) as f:
        return json.load(f)


def test_runs_every_mode_with_the_header(report):
    rows = report["rows"]
    # The native twin has no `dp`.
    assert [(row["model"], row["mode"]) for row in rows] == [
        ("llama", "none"),
        ("llama", "dp"),
        ("llama", "mp"),
        ("native_llama", "none"),
        ("native_llama", "mp"),
    ]
    assert "2 process(es)" in report["header"]
    assert "preset tiny, float32" in report["header"]


def test_distributed_runs_match_the_run_without_one(report):
    for row in report["rows"]:
        if row["mode"] == "none":
            continue
        assert "error" not in row, row
        assert len(row["losses"]) == 3
        assert row["loss_rel_diff"] < 1e-5, row
        assert row["weight_abs_diff"] < 1e-5, row


def test_reports_attention_kernels_and_times(report):
    for row in report["rows"]:
        if row["model"] == "llama":
            # The native twin computes its attention with matmuls.
            assert "aten::scaled_dot_product_attention" in row["kernels"]
            assert any("flash_attention_for_cpu" in k for k in row["kernels"])
        assert math.isfinite(row["step_ms"]) and row["step_ms"] > 0
        # Host reads of a value (`.item()`), which wait for a GPU.
        assert isinstance(row["device_waits"], int)
        assert row["device_waits"] >= 0
        # On CPU: the parameters and optimizer state held, plus the
        # step's own peak.
        assert row["peak_bytes"] > row["held_bytes"] > 0
        assert row["python_calls"] > 0
