"""Foundation on 2 and 4 gloo processes, compared with one process.

Meshes (2,), (1, 2), (2, 1) on 2 processes and (2, 2) on 4. A 1-D mesh has
the axis `model`; a 2-D mesh has `batch` and `model`. One launch per
process count runs all checks of `workers/foundation_worker.py` on each of
its meshes, and the assertions below compare every rank's values with the
others and with the single-process run.
"""

import harness
import numpy as np
import pytest

MESHES = [(2, "2"), (2, "1,2"), (2, "2,1"), (4, "2,2")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Plain Keras on one process, without any distribution."""
    tmp_path = tmp_path_factory.mktemp("reference")
    (report,) = harness.launch("foundation_worker.py", 1, tmp_path, ["single"])
    return harness.run_values(report, "single")


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """One launch per process count, checking all of its meshes.

    Returns a function of the process count giving every rank's report;
    a count is launched the first time it is asked for, and a failed
    launch fails every later test of that count without launching again.
    """
    reports = {}

    def reports_of(nprocs):
        if nprocs not in reports:
            meshes = [mesh for n, mesh in MESHES if n == nprocs]
            try:
                reports[nprocs] = harness.launch(
                    "foundation_worker.py",
                    nprocs,
                    tmp_path_factory.mktemp(f"p{nprocs}"),
                    meshes,
                    timeout=360,
                )
            except harness.WorkerFailure as failure:
                reports[nprocs] = failure
        if isinstance(reports[nprocs], harness.WorkerFailure):
            raise harness.WorkerFailure(str(reports[nprocs]))
        return reports[nprocs]

    return reports_of


def run_on(mesh_param, launches):
    nprocs, mesh = mesh_param
    reports = [harness.run_values(r, mesh) for r in launches(nprocs)]
    shape = tuple(int(s) for s in mesh.split(","))
    return nprocs, shape, reports


@pytest.fixture(params=MESHES, ids=lambda p: f"mesh{p[1]}")
def run(request, launches):
    return run_on(request.param, launches)


@pytest.fixture(
    params=[p for p in MESHES if "," in p[1]], ids=lambda p: f"mesh{p[1]}"
)
def run_2d(request, launches):
    """`run` on the 2-D meshes only."""
    return run_on(request.param, launches)


def axis_sizes(shape):
    """Returns (batch axis size, model axis size, model mesh dim)."""
    if len(shape) == 1:
        return shape[0], shape[0], 0
    return shape[0], shape[1], 1


def coordinate(rank, shape):
    return np.unravel_index(rank, shape)


def expected_placements(shape, shard_dim, variable=True):
    """Placements split on the model axis. A variable's are replicated
    where that axis has one process (the whole dimension either way); a
    distributed tensor keeps its layout's."""
    _, model_size, model_dim = axis_sizes(shape)
    placements = ["R"] * len(shape)
    if shard_dim is not None and (model_size > 1 or not variable):
        placements[model_dim] = f"S({shard_dim})"
    return placements


def chunk(full, dim, index, parts):
    return np.split(np.asarray(full), parts, axis=dim)[index]


def test_devices(run):
    nprocs, _, reports = run
    for rank, report in enumerate(reports):
        assert report["devices"] == [f"cpu:{i}" for i in range(nprocs)]
        assert report["device_count"] == nprocs
        assert report["num_processes"] == nprocs
        assert report["process_id"] == rank


@pytest.mark.parametrize(
    "path,shard_dim",
    [
        ("up/kernel", 1),
        ("up/bias", 0),
        ("down/kernel", 0),
        ("down/bias", None),
        ("head/kernel", None),
        ("head/bias", None),
    ],
)
def test_variable_layouts_and_values(run, reference, path, shard_dim):
    _, shape, reports = run
    _, model_size, model_dim = axis_sizes(shape)
    full_reference = np.asarray(reference[f"full/{path}"])
    for rank, report in enumerate(reports):
        assert report[f"placements/{path}"] == expected_placements(
            shape, shard_dim
        )
        full = np.asarray(report[f"full/{path}"])
        # Same seed: the distributed values are the single-process values.
        np.testing.assert_array_equal(full, full_reference)
        local = np.asarray(report[f"local/{path}"])
        if shard_dim is None:
            expected_local = full_reference
        else:
            index = coordinate(rank, shape)[model_dim]
            expected_local = chunk(full_reference, shard_dim, index, model_size)
        assert list(local.shape) == list(expected_local.shape)
        assert report[f"local_shape/{path}"] == list(expected_local.shape)
        np.testing.assert_array_equal(local, expected_local)
    np.testing.assert_array_equal(
        np.asarray(reports[0]["weights"][0]),
        np.asarray(reference["weights"][0]),
    )


def test_optimizer_slots_follow_their_parameter(run):
    _, shape, reports = run
    for report in reports:
        slots = report["slot_placements"]
        assert slots["sgd/up_kernel_momentum"] == report["placements/up/kernel"]
        assert slots["sgd/up_bias_momentum"] == report["placements/up/bias"]
        assert (
            slots["sgd/down_kernel_momentum"]
            == report["placements/down/kernel"]
        )
        assert slots["sgd/head_kernel_momentum"] == ["R"] * len(shape)


def test_multi_axis_dimension_order(run_2d):
    nprocs, shape, reports = run_2d
    batch_size, model_size, _ = axis_sizes(shape)
    full = np.arange(24, dtype="float32").reshape(8, 3)
    parts = batch_size * model_size
    # Split over (batch, model), the mesh's own order: a `Shard` on each
    # axis. Over (model, batch): the batch axis comes after the model
    # axis in the split but first in the mesh, so DTensor splits it with
    # the model axis's size as a stride, a `_StridedShard` (a plain
    # `Shard` where the other axis has one process). An axis of one
    # process holds the whole dimension: replicated.
    strided = batch_size > 1 and model_size > 1
    batch_major_placements = [
        "S(0)" if batch_size > 1 else "R",
        "S(0)" if model_size > 1 else "R",
    ]
    model_major_placements = [
        f"_S(0, {model_size})" if strided else batch_major_placements[0],
        batch_major_placements[1],
    ]
    for rank, report in enumerate(reports):
        b, m = report["mesh_coordinate"]
        assert (b, m) == tuple(coordinate(rank, shape))
        placements = report["multi_axis/batch_major/placements"]
        assert placements == batch_major_placements
        placements = report["multi_axis/model_major/placements"]
        assert placements == model_major_placements
        batch_major = np.asarray(report["multi_axis/batch_major/local"])
        model_major = np.asarray(report["multi_axis/model_major/local"])
        np.testing.assert_array_equal(
            batch_major, chunk(full, 0, b * model_size + m, parts)
        )
        np.testing.assert_array_equal(
            model_major, chunk(full, 0, m * batch_size + b, parts)
        )
        for name in ("batch_major", "model_major"):
            np.testing.assert_array_equal(
                np.asarray(report[f"multi_axis/{name}/full"]), full
            )


def test_assign_keeps_layout(run):
    _, shape, reports = run
    _, model_size, model_dim = axis_sizes(shape)
    new_value = np.arange(8 * 16, dtype="float32").reshape(8, 16) / 100.0
    for rank, report in enumerate(reports):
        kernel_placements = expected_placements(shape, 1)
        assert report["assign_numpy/placements"] == kernel_placements
        index = coordinate(rank, shape)[model_dim]
        np.testing.assert_array_equal(
            np.asarray(report["assign_numpy/local"]),
            chunk(new_value, 1, index, model_size),
        )
        np.testing.assert_array_equal(
            np.asarray(report["assign_numpy/full"]), new_value
        )
        assert report["assign_dtensor/placements"] == kernel_placements
        np.testing.assert_array_equal(
            np.asarray(report["assign_dtensor/full"]), new_value * 2.0
        )
        assert report["set_weights/placements"] == kernel_placements
        assert report["set_weights/local_shape"] == [8, 16 // model_size]
        assert report["set_weights/full_sum"] == 1.5 * 8 * 16


def test_distribute_tensor_nested_and_redistribute(run):
    _, shape, reports = run
    _, model_size, model_dim = axis_sizes(shape)
    data = np.arange(24, dtype="float32").reshape(4, 6)
    for rank, report in enumerate(reports):
        index = coordinate(rank, shape)[model_dim]
        assert report["distribute/a/placements"] == expected_placements(
            shape, 1, variable=False
        )
        np.testing.assert_array_equal(
            np.asarray(report["distribute/a/local"]),
            chunk(data, 1, index, model_size),
        )
        np.testing.assert_array_equal(
            np.asarray(report["distribute/b/local"]),
            chunk(data + 1, 1, index, model_size),
        )
        assert report["distribute/b/none_kept"] is True
        assert report["redistribute/placements"] == ["R"] * len(shape)
        np.testing.assert_array_equal(
            np.asarray(report["redistribute/local"]), data
        )


def test_distribute_data_input_builds_global_batch(run):
    _, shape, reports = run
    batch_size = shape[0]
    expected = np.repeat(np.arange(batch_size, dtype="float32"), 2)
    expected = np.repeat(expected[:, None], 3, axis=1)
    for rank, report in enumerate(reports):
        assert report["data_input/shape"] == [2 * batch_size, 3]
        shard = coordinate(rank, shape)[0]
        np.testing.assert_array_equal(
            np.asarray(report["data_input/local"]), np.full((2, 3), shard)
        )
        np.testing.assert_array_equal(
            np.asarray(report["data_input/full"]), expected
        )
        np.testing.assert_array_equal(
            np.asarray(report["data_input/two_arguments_full"]), expected
        )


def test_collectives(run):
    nprocs, _, reports = run
    values = np.array([[r + 1.0, 10.0 * (r + 1)] for r in range(nprocs)])
    for report in reports:
        np.testing.assert_allclose(report["all_reduce/sum"], values.sum(0))
        np.testing.assert_allclose(report["all_reduce/mean"], values.mean(0))
        np.testing.assert_allclose(report["all_reduce/max"], values.max(0))
        np.testing.assert_allclose(report["all_gather"], values.reshape(-1))
        np.testing.assert_array_equal(
            np.asarray(report["all_gather/variable"]),
            np.asarray(report["full/up/kernel"]),
        )


# Placements of the `<layer path>/output` layouts that the worker sets,
# by mesh rank: `pair` returns a tuple, `named` a dict,
# `proj` one tensor.
OUTPUT_PLACEMENTS = {
    1: {
        "pair": ["S(1)"],
        "named": ["S(0)"],
        "proj": ["S(0)"],
    },
    2: {
        "pair": ["S(0)", "S(1)"],
        "named": ["R", "S(1)"],
        "proj": ["S(0)", "R"],
    },
}
OUTPUT_LAYERS = {
    "proj": "proj",
    "pair_0": "pair",
    "pair_1": "pair",
    "named_double": "named",
    "named_shift": "named",
}


def local_shard(full, placements, coordinates, shape):
    """The part of `full` that a process holds under `placements`."""
    local = np.asarray(full)
    for mesh_dim, placement in enumerate(placements):
        if placement.startswith("S("):
            dim = int(placement[2:-1])
            local = chunk(local, dim, coordinates[mesh_dim], shape[mesh_dim])
    return local


@pytest.mark.parametrize("output", sorted(OUTPUT_LAYERS))
def test_layer_output_layouts(run, reference, output):
    """Every tensor of a layer's output, be it a tuple or a dict, takes the
    layer's output layout, and holds plain Keras's values."""
    _, shape, reports = run
    placements = OUTPUT_PLACEMENTS[len(shape)][OUTPUT_LAYERS[output]]
    expected = np.asarray(reference[f"outputs/{output}/value"])
    for rank, report in enumerate(reports):
        assert report[f"outputs/{output}/placements"] == placements
        np.testing.assert_allclose(
            np.asarray(report[f"outputs/{output}/value"]),
            expected,
            rtol=1e-6,
            atol=1e-6,
        )
        np.testing.assert_allclose(
            np.asarray(report[f"outputs/{output}/local"]),
            local_shard(expected, placements, coordinate(rank, shape), shape),
            rtol=1e-6,
            atol=1e-6,
        )


def test_first_use_initializes_without_initialize(launches):
    """No worker call to `initialize()`: `list_devices()` joins torchrun's
    process group, with every process and the right rank."""
    for nprocs in sorted({n for n, _ in MESHES}):
        for rank, report in enumerate(launches(nprocs)):
            assert report["initialized_before_first_use"] is False
            assert report["initialized_after_first_use"] is True
            assert report["first_use/world_size"] == nprocs
            assert report["first_use/rank"] == rank
            assert report["first_use/devices"] == [
                f"cpu:{i}" for i in range(nprocs)
            ]


def test_invalid_layouts_name_path_shape_layout_mesh_and_axis(run):
    _, shape, reports = run
    for report in reports:
        rank_error = report["error/rank"]
        assert rank_error.startswith("ValueError")
        for part in ("'bad_rank'", "(4, 4)", "('model',)", "DeviceMesh"):
            assert part in rank_error
        assert "rank 2" in rank_error
        if shape[-1] > 1:
            error = report["error/indivisible"]
            for part in ("'odd'", "(3, 4)", "('model', None)", "'model'"):
                assert part in error
            assert "not divisible" in error
        twice = report["error/twice"]
        assert "'model'" in twice and "once" in twice
        assert "'twice'" in twice and "(4, 4)" in twice
        assert "nope" in report["error/unknown"]


def test_only_process_zero_prints_progress(run):
    _, _, reports = run
    assert reports[0]["progbar_epoch_lines"] == 2
    for report in reports[1:]:
        assert report["progbar_epoch_lines"] == 0


@pytest.mark.parametrize("nprocs", sorted({n for n, _ in MESHES}))
def test_unseeded_replicated_variables_are_identical(launches, nprocs):
    # Before any seed is set, the processes draw from one shared seed.
    reports = launches(nprocs)
    for report in reports:
        assert report["unseeded/placements"] == [["R"]] * 6
        assert report["unseeded/weights"] == reports[0]["unseeded/weights"]
    # Not the weights of seed 7, which the mesh checks set.
    mesh = next(mesh for n, mesh in MESHES if n == nprocs)
    assert reports[0]["unseeded/weights"] != reports[0][f"{mesh}/weights"]


def test_unseeded_weights_differ_between_launches(launches, tmp_path):
    # The shared seed is drawn afresh for each launch, not fixed (nor a
    # function of the process count): a second launch of 2 processes
    # draws other weights than the first, identical on its processes.
    first = launches(2)
    second = harness.launch(
        "foundation_worker.py", 2, tmp_path, ["unseeded"], timeout=180
    )
    assert second[0]["unseeded/weights"] == second[1]["unseeded/weights"]
    assert second[0]["unseeded/placements"] == [["R"]] * 6
    assert first[0]["unseeded/weights"] != second[0]["unseeded/weights"]
