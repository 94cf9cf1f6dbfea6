"""Tests for fully_sharded.py: FSDP-style layouts and their composition."""

import logging
import math

import pytest

from keras.src import backend
from keras.src import layers
from keras.src import models
from keras.src.distribution import fully_sharded as fs
from keras.src.distribution import tensor_parallel as tp
from keras.src.distribution.distribution_lib import DeviceMesh
from keras.src.distribution.distribution_lib import LayoutMap
from keras.src.distribution.layout_composition import layout_map_axes
from keras.src.distribution.layout_composition import merge_layouts


def fake_mesh(sizes):
    count = math.prod(sizes.values())
    return DeviceMesh(
        tuple(sizes.values()),
        tuple(sizes),
        [f"cpu:{i}" for i in range(count)],
    )


FSDP_2 = {"fsdp": 2}
FSDP_4 = {"fsdp": 4}
FSDP_8 = {"fsdp": 8}
FSDP_2_MODEL_2 = {"fsdp": 2, "model": 2}
FSDP_4_MODEL_2 = {"fsdp": 4, "model": 2}
MODEL_2_FSDP_4 = {"model": 2, "fsdp": 4}
DATA_FSDP_MODEL = {"data": 2, "fsdp": 2, "model": 2}


@pytest.mark.parametrize(
    "mesh, shape, base, expected",
    [
        # The largest dimension divisible by the axis size is sharded.
        (FSDP_2, (8, 4), None, ("fsdp", None)),
        (FSDP_2, (4, 8), None, (None, "fsdp")),
        (FSDP_2, (8, 8), None, ("fsdp", None)),  # A tie: the first one.
        (FSDP_2, (7, 4), None, (None, "fsdp")),  # The largest is odd.
        (FSDP_2, (7, 5), None, None),  # Nothing divides.
        (FSDP_2, (64,), None, ("fsdp",)),
        (FSDP_4, (6, 10, 12), None, (None, None, "fsdp")),
        (FSDP_4, (12, 10, 6), None, ("fsdp", None, None)),
        (FSDP_4, (2, 3, 8, 5), None, (None, None, "fsdp", None)),
        (FSDP_8, (1000, 1001), None, ("fsdp", None)),
        (FSDP_8, (1001, 1000), None, (None, "fsdp")),
        (FSDP_8, (12, 10), None, None),
        # Other axes are kept; a dimension already sharded takes the new
        # axis, as its minor axis, when it divides by both sizes.
        (FSDP_2_MODEL_2, (16, 64), (None, "model"), (None, ("model", "fsdp"))),
        (FSDP_2_MODEL_2, (64, 16), (None, "model"), ("fsdp", "model")),
        (FSDP_4_MODEL_2, (16, 12), (None, "model"), ("fsdp", "model")),
        (FSDP_4_MODEL_2, (16, 24), (None, "model"), (None, ("model", "fsdp"))),
        (FSDP_4_MODEL_2, (6, 10), ("model", None), ("model", None)),
        (FSDP_4_MODEL_2, (64, 8), ("model", None), (("model", "fsdp"), None)),
        (MODEL_2_FSDP_4, (64, 8), ("model", None), (("model", "fsdp"), None)),
        (
            FSDP_2_MODEL_2,
            (32, 4, 8),
            (None, "model", None),
            ("fsdp", "model", None),
        ),
        (
            DATA_FSDP_MODEL,
            (16, 32),
            (None, ("data", "model")),
            (None, ("data", "model", "fsdp")),
        ),
        (
            DATA_FSDP_MODEL,
            (2, 12),
            (None, ("data", "model")),
            ("fsdp", ("data", "model")),
        ),
        # Already on the axis: kept as is.
        (FSDP_2_MODEL_2, (64, 16), (None, "fsdp"), (None, "fsdp")),
    ],
)
def test_layouts_for_shapes_and_meshes(mesh, shape, base, expected):
    mesh = fake_mesh(mesh)
    layout_map = None
    if base is not None:
        layout_map = LayoutMap(mesh)
        layout_map["w"] = base
    result = fs.fully_sharded_layouts(
        {"w": shape}, mesh, "fsdp", min_size=1, layout_map=layout_map
    )
    assert layout_map_axes(result).get("w") == expected


def test_axis_of_size_one_shards_nothing():
    mesh = fake_mesh({"fsdp": 1, "model": 2})
    base = LayoutMap(mesh)
    base["w"] = (None, "model")
    result = fs.fully_sharded_layouts(
        {"w": (8, 8), "v": (8, 8)}, mesh, min_size=1, layout_map=base
    )
    assert layout_map_axes(result) == {"w": (None, "model")}


def test_min_size_boundary():
    mesh = fake_mesh(FSDP_2)
    shapes = {"at": (16, 16), "below": (15, 17), "scalar": ()}
    axes = layout_map_axes(
        fs.fully_sharded_layouts(shapes, mesh, "fsdp", min_size=255)
    )
    assert axes == {"at": ("fsdp", None)}
    axes = layout_map_axes(
        fs.fully_sharded_layouts(shapes, mesh, "fsdp", min_size=256)
    )
    assert axes == {"at": ("fsdp", None)}
    axes = layout_map_axes(
        fs.fully_sharded_layouts(shapes, mesh, "fsdp", min_size=257)
    )
    assert axes == {}


def test_default_min_size():
    mesh = fake_mesh(FSDP_2)
    shapes = {"big": (128, 128), "small": (64, 64)}
    axes = layout_map_axes(fs.fully_sharded_layouts(shapes, mesh))
    assert fs.DEFAULT_MIN_SIZE == 2**14
    assert axes == {"big": ("fsdp", None)}


def test_include_and_exclude():
    mesh = fake_mesh(FSDP_2)
    shapes = {
        "embed/embeddings": (64, 8),
        "block/ffn/kernel": (8, 64),
        "block/ffn/bias": (64,),
        "head/kernel": (8, 64),
    }

    def axes(**kwargs):
        return layout_map_axes(
            fs.fully_sharded_layouts(shapes, mesh, "fsdp", min_size=1, **kwargs)
        )

    assert set(axes()) == set(shapes)
    assert set(axes(include=".*/kernel")) == {
        "block/ffn/kernel",
        "head/kernel",
    }
    assert set(axes(include=["embed/.*", "head/.*"])) == {
        "embed/embeddings",
        "head/kernel",
    }
    assert set(axes(exclude=r".*/bias")) == {
        "embed/embeddings",
        "block/ffn/kernel",
        "head/kernel",
    }
    # `re.fullmatch`: "kernel" alone matches nothing.
    assert set(axes(include="kernel")) == set()
    # Exclude wins over include.
    assert set(axes(include=".*/kernel", exclude="head/.*")) == {
        "block/ffn/kernel"
    }


def test_each_decision_is_logged(caplog):
    mesh = fake_mesh(FSDP_2_MODEL_2)
    base = LayoutMap(mesh)
    base["tp/kernel"] = (None, "model")
    base["done/kernel"] = ("fsdp", None)
    shapes = {
        "tp/kernel": (16, 64),
        "done/kernel": (16, 16),
        "small/bias": (4,),
        "odd/kernel": (7, 9),
        "skip/kernel": (16, 16),
    }
    with caplog.at_level(logging.INFO, logger=fs.__name__):
        fs.fully_sharded_layouts(
            shapes,
            mesh,
            "fsdp",
            min_size=8,
            layout_map=base,
            exclude="skip/.*",
        )
    messages = [r.getMessage() for r in caplog.records if r.name == fs.__name__]
    assert len(messages) == len(shapes)
    expected = [
        "'tp/kernel' with shape (16, 64): dimension 1 of size 64 sharded "
        "over 'model' x 'fsdp'; layout axes (None, ('model', 'fsdp'))",
        "'done/kernel' with shape (16, 16): kept: already sharded over 'fsdp'",
        "'small/bias' with shape (4,): not sharded: 4 elements is below "
        "min_size=8",
        "'odd/kernel' with shape (7, 9): not sharded: no dimension of (7, 9) "
        "divides by the size of 'fsdp' (2)",
        "'skip/kernel' with shape (16, 16): not sharded: an exclude pattern "
        "matches",
    ]
    for message, fragment in zip(messages, expected):
        assert fragment in message


def test_composes_with_a_tensor_parallel_plan():
    mesh = fake_mesh(FSDP_2_MODEL_2)
    inputs = layers.Input((8, 32), name="x")
    h = layers.Dense(128, name="up")(inputs)
    h = layers.Dense(32, name="down")(h)
    model = models.Model(inputs, h)
    plan = {"up": tp.column_parallel("model"), "down": tp.row_parallel("model")}
    tensor_parallel = tp.tensor_parallel_layouts(model, mesh, plan)
    composed = fs.fully_sharded_layouts(
        model, mesh, "fsdp", min_size=64, layout_map=tensor_parallel
    )
    expected = {
        "up/kernel": (None, ("model", "fsdp")),
        "up/bias": (("model", "fsdp"),),
        "up/output": ("fsdp", None, "model"),
        "down/kernel": (("model", "fsdp"), None),
        "down/bias": (None,),
        "down/output": ("fsdp", None, None),
    }
    assert layout_map_axes(composed) == expected
    # The same result by merging the tensor-parallel map with it.
    merged = merge_layouts(model, tensor_parallel, composed)
    assert layout_map_axes(merged) == expected
    # The mesh may come from the base map alone.
    alone = fs.fully_sharded_layouts(
        model, None, "fsdp", min_size=64, layout_map=tensor_parallel
    )
    assert layout_map_axes(alone) == expected


def test_built_abstract_model_and_dict_agree():
    mesh = fake_mesh(FSDP_4)

    def build():
        inputs = layers.Input((16,), name="x")
        h = layers.Dense(64, name="up")(inputs)
        return models.Model(inputs, layers.Dense(12, name="down")(h))

    built = fs.fully_sharded_layouts(build(), mesh, min_size=1)
    with backend.StatelessScope(initialize_variables=False):
        abstract_model = build()
        abstract = fs.fully_sharded_layouts(abstract_model, mesh, min_size=1)
    shapes = {v.path: v.shape for v in build().weights}
    from_dict = fs.fully_sharded_layouts(shapes, mesh, min_size=1)
    expected = {
        "up/kernel": (None, "fsdp"),
        "up/bias": ("fsdp",),
        "down/kernel": ("fsdp", None),
        "down/bias": ("fsdp",),
    }
    for result in (built, abstract, from_dict):
        assert layout_map_axes(result) == expected


def test_errors():
    mesh = fake_mesh(FSDP_2_MODEL_2)
    shapes = {"w": (8, 8)}
    with pytest.raises(ValueError, match="Axis 'data' is not an axis"):
        fs.fully_sharded_layouts(shapes, mesh, "data")
    with pytest.raises(ValueError, match="Pass a `device_mesh`"):
        fs.fully_sharded_layouts(shapes)
    with pytest.raises(ValueError, match="differs from the mesh"):
        fs.fully_sharded_layouts(
            shapes, mesh, layout_map=LayoutMap(fake_mesh(FSDP_4_MODEL_2))
        )
    with pytest.raises(ValueError, match="`include` must be a regex"):
        fs.fully_sharded_layouts(shapes, mesh, include="(")
    base = LayoutMap(mesh)
    base["w"] = ("model",)
    with pytest.raises(ValueError) as error:
        fs.fully_sharded_layouts(shapes, mesh, layout_map=base)
    message = str(error.value)
    assert "variable 'w' with shape (8, 8)" in message
    assert "layout axes ('model',)" in message
    assert "DeviceMesh({'fsdp': 2, 'model': 2})" in message
    base = LayoutMap(mesh)
    base[".*2"] = (None, "model")
    base["w.*"] = ("model", None)
    with pytest.raises(ValueError, match="Conflicting layout keys"):
        fs.fully_sharded_layouts({"w2": (8, 8)}, mesh, layout_map=base)


def test_public_name_resolves():
    import keras_dtensor

    assert keras_dtensor.fully_sharded_layouts is fs.fully_sharded_layouts
