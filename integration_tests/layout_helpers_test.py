"""Layout helpers on 4 gloo processes: a transformer on a 2x2 fsdp x model mesh.

One launch of `workers/layout_helpers_worker.py` trains a 2-block
transformer laid out only by `tensor_parallel_layouts`,
`fully_sharded_layouts` and `merge_layouts`, next to a single-process run
of the same model on every rank. The tests compare layouts, placements,
shard contents, per-rank parameter bytes and losses. The same helper
calls are then run on the JAX backend when JAX is installed.
"""

import ast
import importlib.util
import json
import math
import os
import subprocess
import sys

import harness
import numpy as np
import pytest

MESH_SHAPE = (2, 2)
AXES = ("fsdp", "model")
SIZES = dict(zip(AXES, MESH_SHAPE))
NPROCS = math.prod(MESH_SHAPE)
WORKER = os.path.join(harness.WORKERS_DIR, "layout_helpers_worker.py")
DISTRIBUTION_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "keras",
    "src",
    "distribution",
)
HELPER_MODULES = ("tensor_parallel", "fully_sharded", "layout_composition")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The page that shows the layout helpers' example, and the example's file.
DOCS_PAGE = os.path.join("docs", "layout_helpers.md")
DOCS_EXAMPLE = "examples/layout_helpers.py"
# Runs the page's example, imported as `layout_helpers_example`, and
# records what it built: its model (through `build_model`) and the layout
# map of the distribution it set.
DOCS_EXAMPLE_DRIVER = """
import keras
import worker_utils

import layout_helpers_example as example

built = []
build_model = example.build_model


def recording_build_model():
    built.append(build_model())
    return built[-1]


example.build_model = recording_build_model
example.main()
(model,) = built
layout_map = keras.distribution.distribution()._layout_map

worker_utils.record("losses", model.history.history["loss"])
worker_utils.record(
    "layouts",
    {
        key: [list(a) if isinstance(a, tuple) else a for a in axes]
        for key, axes in example.kd.layout_map_axes(layout_map).items()
    },
)
for variable in model.weights:
    local = variable.value.to_local()
    worker_utils.record(f"local_shape/{variable.path}", list(local.shape))
    worker_utils.record(
        f"placements/{variable.path}",
        [str(p) for p in variable.value.placements],
    )
worker_utils.report()
"""


def load_worker():
    spec = importlib.util.spec_from_file_location(
        "layout_helpers_worker", WORKER
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def worker():
    return load_worker()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("layout_helpers")
    shape = ",".join(str(s) for s in MESH_SHAPE)
    return harness.launch(
        "layout_helpers_worker.py", NPROCS, tmp_path, args=[shape], timeout=300
    )


@pytest.fixture(scope="module")
def single_process_layouts(worker):
    """The helpers' layouts in this process, on a mesh of fake devices."""
    import keras

    devices = [f"cpu:{i}" for i in range(NPROCS)]
    mesh = keras.distribution.DeviceMesh(MESH_SHAPE, AXES, devices)
    with keras.StatelessScope(initialize_variables=False):
        model = worker.build_model()
    return worker.layouts_json(worker.layout_map_for(model, mesh))


def variable_paths(report):
    return [
        key[len("placements/") :]
        for key in report
        if key.startswith("placements/")
    ]


def axis_names(entry):
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, list) else (entry,)


def shards(axes):
    if axes is None:
        return 1
    return math.prod(SIZES[name] for e in axes for name in axis_names(e))


def expected_local(full, axes, rank):
    """The slice of `full` that `rank` holds: major axes split first."""
    coordinate = dict(zip(AXES, np.unravel_index(rank, MESH_SHAPE)))
    local = np.asarray(full)
    for dim, entry in enumerate(axes or ()):
        index = 0
        parts = 1
        for name in axis_names(entry):
            index = index * SIZES[name] + int(coordinate[name])
            parts *= SIZES[name]
        local = np.split(local, parts, axis=dim)[index]
    return local


def test_layouts_are_the_single_process_layouts(
    reports, single_process_layouts
):
    for report in reports:
        assert report["layouts"] == single_process_layouts


def test_two_d_layouts_of_the_transformer(single_process_layouts):
    layouts = single_process_layouts
    for block in ("block_0", "block_1"):
        attention = f"{block}/attention"
        for name in ("query", "key", "value"):
            # Column split on heads, FSDP on the hidden dimension.
            assert layouts[f"{attention}/{name}/kernel"] == [
                "fsdp",
                "model",
                None,
            ]
            assert layouts[f"{attention}/{name}/bias"] == ["model", None]
            assert layouts[f"{attention}/{name}/output"] == [
                "fsdp",
                None,
                "model",
                None,
            ]
        assert layouts[f"{attention}/attention_output/kernel"] == [
            "model",
            None,
            "fsdp",
        ]
        assert layouts[f"{attention}/attention_output/output"] == [
            "fsdp",
            None,
            None,
        ]
        # The largest dimension is already on "model": it takes "fsdp" too.
        assert layouts[f"{block}/ffn_in/kernel"] == [None, ["model", "fsdp"]]
        assert layouts[f"{block}/ffn_in/bias"] == ["model"]
        assert layouts[f"{block}/ffn_out/kernel"] == [["model", "fsdp"], None]
        assert layouts[f"{block}/ffn_out/bias"] == [None]
        # Below min_size: replicated.
        assert f"{block}/ln_1/gamma" not in layouts
    assert layouts["embed/embeddings"] == ["fsdp", None]
    assert layouts["head/kernel"] == [None, "fsdp"]
    assert "head/bias" not in layouts


def test_placements_and_local_shards(reports, single_process_layouts):
    layouts = single_process_layouts
    for rank, report in enumerate(reports):
        paths = variable_paths(report)
        assert len(paths) == 35
        for path in paths:
            axes = layouts.get(path)
            full = np.asarray(report[f"full/{path}"])
            local = np.asarray(report[f"local/{path}"])
            expected = expected_local(full, axes, rank)
            assert local.shape == expected.shape, path
            np.testing.assert_array_equal(local, expected, err_msg=path)
            # Initial weights equal the single-process model's.
            np.testing.assert_array_equal(
                np.asarray(report[f"gathered/{path}"]), full, err_msg=path
            )
        placements = {p: report[f"placements/{p}"] for p in paths}
        assert placements["embed/embeddings"] == ["S(0)", "R"]
        assert placements["block_0/attention/query/kernel"] == ["S(0)", "S(1)"]
        assert placements["block_0/attention/query/bias"] == ["R", "S(0)"]
        assert placements["block_0/attention/attention_output/kernel"] == [
            "S(2)",
            "S(0)",
        ]
        # "fsdp" is the minor axis of a dimension split major on "model".
        assert placements["block_1/ffn_in/kernel"][1] == "S(1)"
        assert placements["block_1/ffn_in/kernel"][0].startswith("_S(1")
        assert placements["block_1/ffn_out/kernel"][0].startswith("_S(0")
        assert placements["head/kernel"] == ["S(1)", "R"]
        assert placements["head/bias"] == ["R", "R"]
        assert placements["block_0/ln_1/gamma"] == ["R", "R"]


def test_parameter_memory_is_at_the_sharding_limit(
    reports, single_process_layouts
):
    layouts = single_process_layouts
    for report in reports:
        by_shards = {}
        for path in variable_paths(report):
            size = math.prod(report[f"global_shape/{path}"])
            nbytes = size * report[f"element_size/{path}"]
            count = shards(layouts.get(path))
            by_shards[count] = by_shards.get(count, 0) + nbytes
            local_size = math.prod(report[f"local_shape/{path}"])
            assert local_size * count == size, path
        total = sum(by_shards.values())
        limit = sum(nbytes / count for count, nbytes in by_shards.items())
        # Sharded over all 4: a quarter; over one axis: a half; the rest
        # (small variables) in full.
        assert set(by_shards) == {1, 2, 4}
        assert report["local_parameter_bytes"] == limit
        assert limit < 0.35 * total


def test_losses_match_a_single_process_run(reports):
    reference = reports[0]["reference_losses"]
    assert len(reference) == 3
    assert reference[2] < reference[0]
    for report in reports:
        assert report["reference_losses"] == reference
        np.testing.assert_allclose(report["losses"], reference, rtol=1e-5)
        assert report["losses"] == reports[0]["losses"]


REMAT_MODES = ("single", "dp", "tp", "2d")
# Parity tolerance, relative; absolute, times the largest gradient of the
# model (the key biases' gradients are zero up to rounding: softmax does
# not change when every score of a query moves alike).
REMAT_RTOL = 1e-5


def gradients_of(report, prefix):
    start = f"{prefix}gradients/"
    return {
        key[len(start) :]: np.asarray(value)
        for key, value in report.items()
        if key.startswith(start)
    }


def test_remat_recomputes_every_block_in_backward(reports):
    steps = len(reports[0]["reference_losses"])
    for report in reports:
        # Without remat, no block runs during backward...
        assert report["reference_backward_calls"] == 0
        assert report["backward_calls"] == 0
        # ...with it, each block once per step, on every rank alike.
        for mode in REMAT_MODES:
            assert report[f"remat/{mode}/paths"] == ["block_0", "block_1"]
            assert report[f"remat/{mode}/backward_calls"] == 2 * steps


@pytest.mark.parametrize("mode", REMAT_MODES)
def test_remat_losses_and_gradients_match_one_process(reports, mode):
    reference_losses = reports[0]["reference_losses"]
    reference = gradients_of(reports[0], "reference_")
    assert len(reference) == 35
    without_remat = gradients_of(reports[0], "")
    atol = REMAT_RTOL * max(float(np.abs(g).max()) for g in reference.values())
    for report in reports:
        losses = report[f"remat/{mode}/losses"]
        assert len(losses) == len(reference_losses)
        np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
        assert losses == reports[0][f"remat/{mode}/losses"]
        gradients = gradients_of(report, f"remat/{mode}/")
        assert sorted(gradients) == sorted(reference)
        for path, expected in reference.items():
            np.testing.assert_allclose(
                gradients[path],
                expected,
                rtol=REMAT_RTOL,
                atol=atol,
                err_msg=f"{mode} {path}",
            )
            if mode == "2d":
                # The same layouts without remat: the same gradients.
                np.testing.assert_allclose(
                    gradients[path],
                    without_remat[path],
                    rtol=REMAT_RTOL,
                    atol=atol,
                    err_msg=f"{mode} {path}",
                )


def test_optimizer_slots_take_their_variables_layouts(reports):
    for report in reports:
        slots = report["slot_placements"]
        assert len(slots) == 35
        by_name = {key.split("/", 1)[1]: value for key, value in slots.items()}
        for path in variable_paths(report):
            slot = f"{path.replace('/', '_')}_momentum"
            assert by_name[slot] == report[f"placements/{path}"], path


def test_helpers_import_nothing_from_a_backend():
    for name in HELPER_MODULES:
        path = os.path.join(DISTRIBUTION_DIR, f"{name}.py")
        with open(path) as f:
            tree = ast.parse(f.read())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module)
        for module in imported:
            assert not module.startswith(
                ("torch", "jax", "keras.src.backend")
            ), f"{name}.py imports {module}"


def jax_available():
    return importlib.util.find_spec("jax") is not None


@pytest.mark.skipif(
    not jax_available(), reason="JAX is not installed (it is optional)."
)
def test_same_helper_calls_on_jax(single_process_layouts, worker):
    import keras

    env = dict(os.environ)
    env.update(
        {
            "KERAS_BACKEND": "jax",
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={NPROCS}",
        }
    )
    shape = ",".join(str(s) for s in MESH_SHAPE)
    completed = subprocess.run(
        [sys.executable, WORKER, "--print-layouts", shape, "--apply"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["backend"] == "jax"
    assert result["layouts"] == single_process_layouts
    # JAX created every variable in its layout...
    for path, spec in result["specs"].items():
        expected = single_process_layouts.get(path)
        if expected is None:
            assert all(entry is None for entry in spec), path
        else:
            assert spec == expected, path
    # ...and trains as without a distribution, and as torch does.
    np.testing.assert_allclose(
        result["losses"], result["reference_losses"], rtol=1e-5
    )
    assert keras.backend.backend() == "torch"
    torch_losses = worker.numpy_weight_losses()
    np.testing.assert_allclose(result["losses"], torch_losses, rtol=1e-5)


def docs_example():
    """The ```python block under the page's `<!-- example: ... -->` marker
    of `DOCS_EXAMPLE`."""
    with open(os.path.join(ROOT, DOCS_PAGE), encoding="utf-8") as f:
        lines = f.read().splitlines()
    marker = f"<!-- example: {DOCS_EXAMPLE} -->"
    if marker not in lines:
        pytest.fail(f"No '{marker}' in {DOCS_PAGE}.")
    start = lines.index(marker) + 1
    assert lines[start] == "```python", f"No ```python block under {marker}"
    end = lines.index("```", start + 1)
    return "\n".join(lines[start + 1 : end]) + "\n"


def test_docs_example_runs_as_written(tmp_path):
    """docs/layout_helpers.md's example, as the page shows it, on 2
    processes: a (1, 2) fsdp x model mesh."""
    code = docs_example()
    with open(os.path.join(ROOT, DOCS_EXAMPLE), encoding="utf-8") as f:
        assert code == f.read()
    (tmp_path / "layout_helpers_example.py").write_text(code)
    script = tmp_path / "docs_example_driver.py"
    script.write_text(DOCS_EXAMPLE_DRIVER)
    python_path = os.pathsep.join(
        p
        for p in (
            str(tmp_path),
            harness.WORKERS_DIR,
            os.environ.get("PYTHONPATH"),
        )
        if p
    )
    reports = harness.launch(
        str(script), 2, tmp_path, timeout=240, env={"PYTHONPATH": python_path}
    )
    for report in reports:
        # Two processes: a (1, 2) fsdp x model mesh.
        assert report["losses"] == reports[0]["losses"]
        assert len(report["losses"]) == 2
        assert report["losses"][1] < report["losses"][0]
        assert report["layouts"] == reports[0]["layouts"]
        # "fsdp" has size 1 here, so only the plan shards.
        layouts = report["layouts"]
        for i in range(2):
            assert layouts[f"ffn_{i}_in/kernel"] == [None, "model"]
            assert layouts[f"ffn_{i}_out/kernel"] == ["model", None]
            assert report[f"local_shape/ffn_{i}_in/kernel"] == [64, 128]
            assert report[f"local_shape/ffn_{i}_out/kernel"] == [128, 64]
            assert report[f"placements/ffn_{i}_in/kernel"] == ["R", "S(1)"]
            assert report[f"placements/ffn_{i}_out/kernel"] == ["R", "S(0)"]
        assert "head/kernel" not in layouts
        assert report["placements/head/kernel"] == ["R", "R"]
