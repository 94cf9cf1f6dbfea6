"""Tests for layout_composition.py: meshes, checks and merges."""

import math

import pytest

from keras.src import backend
from keras.src import layers
from keras.src import models
from keras.src.distribution import layout_composition as lc
from keras.src.distribution.distribution_lib import DeviceMesh
from keras.src.distribution.distribution_lib import LayoutMap
from keras.src.distribution.distribution_lib import TensorLayout


def fake_mesh(sizes):
    """A mesh over fake device names: nothing is allocated."""
    count = math.prod(sizes.values())
    return DeviceMesh(
        tuple(sizes.values()),
        tuple(sizes),
        [f"cpu:{i}" for i in range(count)],
    )


MESH = fake_mesh({"fsdp": 2, "model": 4})


def mlp():
    inputs = layers.Input((16,), name="x")
    hidden = layers.Dense(32, name="up")(inputs)
    outputs = layers.Dense(8, name="down")(hidden)
    return models.Model(inputs, outputs, name="mlp")


@pytest.mark.parametrize(
    "axis_sizes, count, expected",
    [
        ({"fsdp": -1, "model": 2}, 2, (1, 2)),
        ({"fsdp": -1, "model": 2}, 4, (2, 2)),
        ({"fsdp": -1, "model": 2}, 8, (4, 2)),
        ({"fsdp": 2, "model": -1}, 8, (2, 4)),
        ({"data": 2, "fsdp": -1, "model": 2}, 8, (2, 2, 2)),
        ({"model": 4}, 4, (4,)),
    ],
)
def test_make_device_mesh(axis_sizes, count, expected):
    devices = [f"cpu:{i}" for i in range(count)]
    mesh = lc.make_device_mesh(axis_sizes, devices)
    assert tuple(mesh.shape) == expected
    assert tuple(mesh.axis_names) == tuple(axis_sizes)
    assert mesh.devices.ravel().tolist() == devices


@pytest.mark.parametrize(
    "axis_sizes, count, message",
    [
        ({}, 4, "at least one mesh axis"),
        ({"fsdp": -1, "model": -1}, 4, "at most one may be -1"),
        ({"fsdp": 0, "model": 4}, 4, "positive integer"),
        ({"fsdp": -1, "model": 3}, 4, "not divisible by 3"),
        ({"fsdp": 2, "model": 4}, 4, "the mesh needs 8"),
    ],
)
def test_make_device_mesh_errors(axis_sizes, count, message):
    devices = [f"cpu:{i}" for i in range(count)]
    with pytest.raises(ValueError, match=message):
        lc.make_device_mesh(axis_sizes, devices)


def test_variable_shapes_of_model_dict_and_list():
    model = mlp()
    expected = {
        "up/kernel": (16, 32),
        "up/bias": (32,),
        "down/kernel": (32, 8),
        "down/bias": (8,),
    }
    assert dict(lc.variable_shapes(model)) == expected
    assert dict(lc.variable_shapes(model.weights)) == expected
    assert dict(lc.variable_shapes(expected)) == expected
    assert list(lc.variable_shapes(model)) == list(expected)


def test_variable_shapes_of_abstract_model_allocates_nothing():
    with backend.StatelessScope(initialize_variables=False):
        model = mlp()
        assert all(v._value is None for v in model.weights)
        shapes = lc.variable_shapes(model)
    assert shapes["up/kernel"] == (16, 32)


def test_variable_shapes_errors():
    with pytest.raises(ValueError, match="share the path 'a/kernel'"):
        lc.variable_shapes(
            [
                _FakeVariable("a/kernel", (2, 2)),
                _FakeVariable("a/kernel", (2, 3)),
            ]
        )
    with pytest.raises(ValueError, match="Expected a Keras layer"):
        lc.variable_shapes(42)


class _FakeVariable:
    def __init__(self, path, shape):
        self.path = path
        self.shape = shape


def test_normalize_axes():
    assert lc.normalize_axes([None, "model"]) == (None, "model")
    assert lc.normalize_axes([["fsdp"], ()]) == ("fsdp", None)
    assert lc.normalize_axes([("model", "fsdp"), None]) == (
        ("model", "fsdp"),
        None,
    )
    assert lc.normalize_axes(TensorLayout(("fsdp", None))) == ("fsdp", None)


def test_check_layout_accepts_valid_layouts():
    lc.check_layout("v", (16, 8), (("fsdp", "model"), None), MESH)
    lc.check_layout("v", (16, 8), (None, ("model", "fsdp")), MESH)
    lc.check_layout("v", (2, 4), ("fsdp", "model"), MESH)
    lc.check_layout("v", (3, 5), (None, None), MESH)
    lc.check_layout("t/output", None, ("fsdp", None, "model"), MESH, "tensor")


@pytest.mark.parametrize(
    "shape, axes, reason",
    [
        ((16, 8), ("fsdp",), "the layout has 1 axes but the variable has rank"),
        ((16, 8), ("data", None), "axis 'data' is not a mesh axis"),
        ((16, 8), ("model", "model"), "axis 'model' shards both dimension 0"),
        (
            (16, 8),
            (("model", "model"), None),
            "axis 'model' shards both dimension 0 and dimension 0",
        ),
        ((6, 8), ("model", None), "dimension 0 of size 6 is not divisible"),
        (
            (12, 8),
            (("fsdp", "model"), None),
            "not divisible by 8, the size of mesh axis 'fsdp' x 'model'",
        ),
    ],
)
def test_check_layout_errors_name_path_shape_axes_mesh(shape, axes, reason):
    with pytest.raises(ValueError) as error:
        lc.check_layout("block/dense/kernel", shape, axes, MESH)
    message = str(error.value)
    assert "variable 'block/dense/kernel'" in message
    assert f"with shape {shape}" in message
    assert f"layout axes {lc.normalize_axes(axes)}" in message
    assert "DeviceMesh({'fsdp': 2, 'model': 4})" in message
    assert reason in message


def test_resolve_layout_exact_key_wins_over_regex():
    layout_map = LayoutMap(MESH)
    layout_map[".*kernel"] = (None, "model")
    layout_map["up/kernel"] = ("model", None)
    assert lc.resolve_layout(layout_map, "up/kernel") == ("model", None)
    assert lc.resolve_layout(layout_map, "down/kernel") == (None, "model")
    assert lc.resolve_layout(layout_map, "down/bias") is None
    # `re.fullmatch`, not `re.search`.
    assert lc.resolve_layout(layout_map, "down/kernel_2") is None


def test_resolve_layout_several_matches_is_an_error():
    layout_map = LayoutMap(MESH)
    layout_map[".*kernel"] = (None, "model")
    layout_map["up/.*"] = ("model", None)
    with pytest.raises(ValueError) as error:
        lc.resolve_layout(layout_map, "up/kernel", (16, 32))
    message = str(error.value)
    assert "variable 'up/kernel' with shape (16, 32)" in message
    assert "'.*kernel' -> (None, 'model')" in message
    assert "'up/.*' -> ('model', None)" in message


def test_check_layouts_resolves_every_variable():
    layout_map = LayoutMap(MESH)
    layout_map[".*/kernel"] = (None, "model")
    layout_map["up/bias"] = ("model",)
    resolved = lc.check_layouts(mlp(), layout_map)
    assert resolved == {
        "up/kernel": (None, "model"),
        "up/bias": ("model",),
        "down/kernel": (None, "model"),
        "down/bias": None,
    }


def test_check_layouts_names_the_failing_variable():
    layout_map = LayoutMap(MESH)
    layout_map["down/kernel"] = (("fsdp", "model"), "model")
    with pytest.raises(ValueError, match="variable 'down/kernel'"):
        lc.check_layouts(mlp(), layout_map)
    layout_map = LayoutMap(MESH)
    layout_map["up/kernel"] = (None, "fsdp")
    layout_map["down/kernel"] = (None, "model")
    layout_map["down/bias"] = ("fsdp",)
    lc.check_layouts(mlp(), layout_map)
    layout_map["up/bias"] = ("model", None)
    with pytest.raises(ValueError, match="variable 'up/bias' with shape"):
        lc.check_layouts(mlp(), layout_map)


def test_check_layouts_finds_ambiguous_output_keys():
    layout_map = LayoutMap(MESH)
    layout_map["up/out.*"] = ("fsdp", None)
    layout_map["up/.*put"] = ("fsdp", "model")
    with pytest.raises(ValueError, match="tensor 'up/output'"):
        lc.check_layouts(mlp(), layout_map)


def test_tensor_layout_keeps_multi_axis_entries():
    layout = lc.tensor_layout((("model", "fsdp"), None), MESH)
    assert layout.axes == (("model", "fsdp"), None)
    assert layout.device_mesh is MESH
    layout = lc.tensor_layout(("fsdp", None), MESH)
    assert layout.axes == ("fsdp", None)
    assert layout.device_mesh is MESH


def test_build_layout_map_and_layout_map_axes():
    entries = {
        "up/kernel": (None, ("model", "fsdp")),
        "up/output": ["fsdp", "model"],
        ".*bias": (None,),
    }
    layout_map = lc.build_layout_map(MESH, entries)
    assert layout_map.device_mesh is MESH
    assert lc.layout_map_axes(layout_map) == {
        "up/kernel": (None, ("model", "fsdp")),
        "up/output": ("fsdp", "model"),
        ".*bias": (None,),
    }
    with pytest.raises(ValueError, match="axis 'fsdp' shards both"):
        lc.build_layout_map(MESH, {"k": ("fsdp", "fsdp")})


def test_literal_keys_layout_map_answers_as_layout_map():
    entries = {
        "b0/q/kernel": (None, "model"),
        "b0/q/output": ("fsdp", None),
        r"b\d/w/kernel": ("model", None),
        "b.*/bias": (None,),
    }
    plain = LayoutMap(MESH)
    for key, axes in entries.items():
        plain[key] = axes
    fast = lc.build_layout_map(MESH, entries)
    assert isinstance(fast, lc.LiteralKeysLayoutMap)
    # Hits, misses, regex matches; a literal key matches only itself.
    for key in ("b0/q/kernel", "b0/q/output", "b1/w/kernel", "b0/v/bias"):
        assert fast[key].axes == plain[key].axes, key
    for key in ("b0/q", "b0/q/kernelx", "b0/x/output", "b10/w/kernelz"):
        assert fast[key] is None and plain[key] is None, key
    # Keys added or removed later are seen.
    fast["b0/v/.*"] = ("model",)
    with pytest.raises(ValueError, match="matches multiple layout"):
        fast["b0/v/bias"]
    del fast["b.*/bias"]
    assert fast["b0/v/bias"].axes == ("model",)
    fast["b0/x/output"] = (None, None)
    assert fast["b0/x/output"].axes == (None, None)


@pytest.mark.parametrize(
    "axes, other, expected",
    [
        ((None, "model"), (None, "model"), (None, "model")),
        (("fsdp", "model"), (None, "model"), ("fsdp", "model")),
        ((None, "model"), ("fsdp", None), ("fsdp", "model")),
        ((None, "model"), (None, ("model", "fsdp")), (None, ("model", "fsdp"))),
        ((None, ("model", "fsdp")), (None, "model"), (None, ("model", "fsdp"))),
        ((None, ("fsdp", "model")), (None, "model"), None),
        ((None, "fsdp"), (None, "model"), None),
        ((None,), (None, None), None),
        # Combining may use an axis twice: `check_layout` rejects that.
        (("model", None), (None, "model"), ("model", "model")),
    ],
)
def test_combine_axes(axes, other, expected):
    assert lc.combine_axes(axes, other) == expected
    assert lc.combine_axes(other, axes) == expected


def test_merge_layouts_keeps_the_fully_sharded_refinement():
    tensor_parallel = LayoutMap(MESH)
    tensor_parallel["up/kernel"] = (None, "model")
    tensor_parallel["up/bias"] = ("model",)
    tensor_parallel["up/output"] = ("fsdp", "model")
    fully_sharded = LayoutMap(MESH)
    fully_sharded[".*kernel"] = ("fsdp", None)
    fully_sharded["up/kernel"] = ("fsdp", "model")
    for maps in [
        (tensor_parallel, fully_sharded),
        (fully_sharded, tensor_parallel),
    ]:
        merged = lc.merge_layouts(mlp(), *maps)
        axes = lc.layout_map_axes(merged)
        assert axes["up/kernel"] == ("fsdp", "model")
        assert axes["up/bias"] == ("model",)
        assert axes["up/output"] == ("fsdp", "model")
        # Every resolved variable gets an exact key.
        assert axes["down/kernel"] == ("fsdp", None)
        assert axes[".*kernel"] == ("fsdp", None)
        assert "down/bias" not in axes


def test_merge_layouts_identical_entries_are_fine():
    first = LayoutMap(MESH)
    first["up/kernel"] = (None, "model")
    second = LayoutMap(MESH)
    second["up/kernel"] = (None, "model")
    merged = lc.merge_layouts(mlp(), first, second)
    assert lc.layout_map_axes(merged) == {"up/kernel": (None, "model")}


def test_merge_layouts_combines_disjoint_dimensions():
    first = LayoutMap(MESH)
    first["up/kernel"] = (None, "model")
    second = LayoutMap(MESH)
    second[".*/kernel"] = ("fsdp", None)
    axes = lc.layout_map_axes(lc.merge_layouts(mlp(), first, second))
    assert axes["up/kernel"] == ("fsdp", "model")
    assert axes["down/kernel"] == ("fsdp", None)


def test_merge_layouts_conflicting_variable():
    first = LayoutMap(MESH)
    first["up/kernel"] = (None, "model")
    second = LayoutMap(MESH)
    second[".*/kernel"] = (None, "fsdp")
    with pytest.raises(ValueError) as error:
        lc.merge_layouts(mlp(), first, second)
    message = str(error.value)
    assert "Conflicting layouts for variable 'up/kernel'" in message
    assert "with shape (16, 32)" in message
    assert "(None, 'model') and (None, 'fsdp')" in message
    assert "DeviceMesh({'fsdp': 2, 'model': 4})" in message


def test_merge_layouts_axis_used_twice_by_two_maps():
    first = LayoutMap(MESH)
    first["up/kernel"] = (None, "model")
    second = LayoutMap(MESH)
    second["up/kernel"] = ("model", None)
    with pytest.raises(ValueError) as error:
        lc.merge_layouts(mlp(), first, second)
    message = str(error.value)
    assert "variable 'up/kernel' with shape (16, 32)" in message
    assert "layout axes ('model', 'model')" in message
    assert "axis 'model' shards both dimension 0 and dimension 1" in message


def test_merge_layouts_conflicting_key():
    first = LayoutMap(MESH)
    first["up/output"] = ("fsdp", "model")
    second = LayoutMap(MESH)
    second["up/output"] = ("fsdp", None, "model")
    with pytest.raises(ValueError, match="Conflicting layouts for tensor"):
        lc.merge_layouts(mlp(), first, second)
    second = LayoutMap(MESH)
    second["up/output"] = (("model", "fsdp"), None)
    with pytest.raises(ValueError, match="Conflicting layouts for tensor"):
        lc.merge_layouts(mlp(), first, second)


def test_merge_layouts_checks_axis_twice_and_divisibility():
    first = LayoutMap(MESH)
    first["up/kernel"] = (None, "model")
    second = LayoutMap(MESH)
    second["up/kernel"] = ("model", "model")
    with pytest.raises(ValueError, match="axis 'model' shards both"):
        lc.merge_layouts(mlp(), first, second)
    second = LayoutMap(MESH)
    second["up/kernel"] = (None, ("model", "fsdp"))
    lc.merge_layouts(mlp(), first, second)  # 32 over 8 divides.
    first = LayoutMap(MESH)
    first["w"] = ("fsdp", None)
    second = LayoutMap(MESH)
    second["w"] = (("fsdp", "model"), None)
    with pytest.raises(ValueError) as error:
        lc.merge_layouts({"w": (12, 8)}, first, second)
    assert "variable 'w' with shape (12, 8)" in str(error.value)
    assert "dimension 0 of size 12 is not divisible by 8" in str(error.value)


def test_merge_layouts_requires_one_mesh():
    first = LayoutMap(MESH)
    second = LayoutMap(fake_mesh({"fsdp": 4, "model": 2}))
    with pytest.raises(ValueError, match="same mesh"):
        lc.merge_layouts(mlp(), first, second)
    with pytest.raises(ValueError, match="at least one"):
        lc.merge_layouts(mlp())


def test_same_mesh():
    assert lc.same_mesh(MESH, fake_mesh({"fsdp": 2, "model": 4}))
    assert not lc.same_mesh(MESH, fake_mesh({"data": 2, "model": 4}))
    assert not lc.same_mesh(MESH, None)


def test_public_names_resolve():
    import keras_dtensor

    assert keras_dtensor.merge_layouts is lc.merge_layouts
    assert keras_dtensor.check_layouts is lc.check_layouts
    assert keras_dtensor.make_device_mesh is lc.make_device_mesh
    assert keras_dtensor.layout_map_axes is lc.layout_map_axes
