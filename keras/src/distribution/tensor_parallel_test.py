"""Tests for tensor_parallel.py: column/row plans as LayoutMaps."""

import math

import numpy as np
import pytest

from keras.src import backend
from keras.src import layers
from keras.src import models
from keras.src import ops
from keras.src.distribution import tensor_parallel as tp
from keras.src.distribution.distribution_lib import DeviceMesh
from keras.src.distribution.layout_composition import layout_map_axes


def fake_mesh(sizes):
    count = math.prod(sizes.values())
    return DeviceMesh(
        tuple(sizes.values()),
        tuple(sizes),
        [f"cpu:{i}" for i in range(count)],
    )


MESH_2D = fake_mesh({"batch": 2, "model": 4})
MESH_1D = fake_mesh({"model": 2})


def mlp(rank=2, use_bias=True, hidden=32):
    shape = (16,) if rank == 2 else (6,) * (rank - 2) + (16,)
    inputs = layers.Input(shape, name="x")
    h = layers.Dense(hidden, name="up", use_bias=use_bias)(inputs)
    h = layers.Dense(8, name="down", use_bias=use_bias)(h)
    return models.Model(inputs, h, name="mlp")


def axes_of(layout_map):
    return layout_map_axes(layout_map)


@pytest.mark.parametrize("rank", [2, 3, 4])
def test_dense_megatron_pair(rank):
    plan = {"up": tp.column_parallel("model"), "down": tp.row_parallel("model")}
    axes = axes_of(tp.tensor_parallel_layouts(mlp(rank), MESH_2D, plan))
    middle = (None,) * (rank - 2)
    assert axes == {
        "up/kernel": (None, "model"),
        "up/bias": ("model",),
        "up/output": ("batch",) + middle + ("model",),
        "down/kernel": ("model", None),
        "down/bias": (None,),
        "down/output": ("batch",) + middle + (None,),
    }


def test_dense_without_bias_and_gathered_output():
    plan = {
        "up": tp.column_parallel("model", gather_output=True),
        "down": tp.row_parallel("model"),
    }
    axes = axes_of(
        tp.tensor_parallel_layouts(mlp(use_bias=False), MESH_2D, plan)
    )
    assert axes == {
        "up/kernel": (None, "model"),
        "up/output": ("batch", None),
        "down/kernel": ("model", None),
        "down/output": ("batch", None),
    }


@pytest.mark.parametrize(
    "mesh, batch_dim_name, batch_entry",
    [
        (MESH_2D, None, "batch"),
        (MESH_2D, "batch", "batch"),
        # The batch is never sharded over the style's own axis.
        (MESH_1D, None, None),
        (fake_mesh({"model": 2, "data": 2}), None, None),
        (fake_mesh({"model": 2, "data": 2}), "data", "data"),
    ],
)
def test_batch_dimension_of_outputs(mesh, batch_dim_name, batch_entry):
    plan = {"up": tp.column_parallel("model")}
    axes = axes_of(
        tp.tensor_parallel_layouts(
            mlp(), mesh, plan, batch_dim_name=batch_dim_name
        )
    )
    assert axes["up/output"] == (batch_entry, "model")


def attention_model(heads=4, key_dim=8, hidden=32):
    inputs = layers.Input((6, hidden), name="x")
    outputs = layers.MultiHeadAttention(heads, key_dim, name="mha")(
        inputs, inputs
    )
    return models.Model(inputs, outputs, name="attention")


def test_multi_head_attention_einsum_dense():
    plan = {
        "mha/(query|key|value)": tp.column_parallel("model"),
        "mha/attention_output": tp.row_parallel("model"),
    }
    axes = axes_of(tp.tensor_parallel_layouts(attention_model(), MESH_2D, plan))
    for name in ("query", "key", "value"):
        # "abc,cde->abde": kernel (hidden, heads, head_dim), split on heads.
        assert axes[f"mha/{name}/kernel"] == (None, "model", None)
        assert axes[f"mha/{name}/bias"] == ("model", None)
        assert axes[f"mha/{name}/output"] == ("batch", None, "model", None)
    # "abcd,cde->abe": kernel (heads, head_dim, hidden), split on heads.
    assert axes["mha/attention_output/kernel"] == ("model", None, None)
    assert axes["mha/attention_output/bias"] == (None,)
    assert axes["mha/attention_output/output"] == ("batch", None, None)


@pytest.mark.parametrize(
    "equation, input_shape, output_shape, bias_axes, column, row",
    [
        (
            "ab,bc->ac",
            (16,),
            32,
            "c",
            {"kernel": (None, "model"), "bias": ("model",)},
            {"kernel": ("model", None), "bias": (None,)},
        ),
        (
            "abc,cd->abd",
            (6, 16),
            (6, 32),
            None,
            {"kernel": (None, "model"), "output": ("batch", None, "model")},
            {"kernel": ("model", None), "output": ("batch", None, None)},
        ),
        (
            "...b,bc->...c",
            (6, 16),
            32,
            "c",
            {
                "kernel": (None, "model"),
                "bias": ("model",),
                "output": ("batch", None, "model"),
            },
            {"kernel": ("model", None), "bias": (None,)},
        ),
        (
            # Bias over (heads, head_dim): "de" of the output "abde".
            "abc,cde->abde",
            (6, 16),
            (6, 4, 8),
            "de",
            {
                "kernel": (None, "model", None),
                "bias": ("model", None),
                "output": ("batch", None, "model", None),
            },
            {"kernel": ("model", None, None), "bias": (None, None)},
        ),
        (
            # Bias only over head_dim: the split heads keep a full bias.
            "abc,cde->abde",
            (6, 16),
            (6, 4, 8),
            "e",
            {"kernel": (None, "model", None), "bias": (None,)},
            {"kernel": ("model", None, None), "bias": (None,)},
        ),
        (
            # Two contracted dimensions: the first is split.
            "abcd,cde->abe",
            (6, 4, 8),
            (6, 16),
            "e",
            {"kernel": (None, None, "model"), "bias": ("model",)},
            {
                "kernel": ("model", None, None),
                "bias": (None,),
                "output": ("batch", None, None),
            },
        ),
    ],
)
def test_einsum_dense_equations(
    equation, input_shape, output_shape, bias_axes, column, row
):
    inputs = layers.Input(input_shape, name="x")
    outputs = layers.EinsumDense(
        equation, output_shape, bias_axes=bias_axes, name="proj"
    )(inputs)
    model = models.Model(inputs, outputs)
    for style, expected in [
        (tp.column_parallel("model"), column),
        (tp.row_parallel("model"), row),
    ]:
        axes = axes_of(
            tp.tensor_parallel_layouts(model, MESH_2D, {"proj": style})
        )
        for name, value in expected.items():
            assert axes[f"proj/{name}"] == value, (equation, name)
        if bias_axes is None:
            assert "proj/bias" not in axes


def test_einsum_dense_that_cannot_be_split():
    inputs = layers.Input((4, 16), name="x")
    # Kernel "b" is contracted only: no column split.
    outputs = layers.EinsumDense("abc,c->ab", (4,), name="proj")(inputs)
    model = models.Model(inputs, outputs)
    with pytest.raises(ValueError, match="no output-only dimension"):
        tp.tensor_parallel_layouts(
            model, MESH_2D, {"proj": tp.column_parallel("model")}
        )
    inputs = layers.Input((4,), name="x")
    # Kernel "c" only in the output: no row split.
    outputs = layers.EinsumDense("ab,c->abc", (4, 8), name="proj")(inputs)
    model = models.Model(inputs, outputs)
    with pytest.raises(ValueError, match="no contracted dimension"):
        tp.tensor_parallel_layouts(
            model, MESH_2D, {"proj": tp.row_parallel("model")}
        )


@pytest.mark.parametrize(
    "style, embeddings, output",
    [
        (
            tp.column_parallel("model"),
            (None, "model"),
            ("batch", None, "model"),
        ),
        (
            tp.column_parallel("model", gather_output=True),
            (None, "model"),
            ("batch", None, None),
        ),
        (tp.row_parallel("model"), ("model", None), ("batch", None, None)),
    ],
)
def test_embedding(style, embeddings, output):
    tokens = layers.Input((6,), dtype="int32", name="tokens")
    outputs = layers.Embedding(64, 16, name="embed")(tokens)
    model = models.Model(tokens, outputs)
    axes = axes_of(tp.tensor_parallel_layouts(model, MESH_2D, {"embed": style}))
    assert axes == {"embed/embeddings": embeddings, "embed/output": output}


class Block(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.ffn_in = layers.Dense(32, name="ffn_in")
        self.ffn_out = layers.Dense(16, name="ffn_out")

    def call(self, x):
        return self.ffn_out(self.ffn_in(x))


class SubclassedModel(models.Model):
    def __init__(self):
        super().__init__(name="sub")
        self.block_0 = Block(name="block_0")
        self.block_1 = Block(name="block_1")

    def call(self, x):
        return self.block_1(self.block_0(x))


PLAN = {
    r".*block_\d+/ffn_in": tp.column_parallel("model"),
    r".*block_\d+/ffn_out": tp.row_parallel("model"),
}
EXPECTED_BLOCK = {
    "ffn_in/kernel": (None, "model"),
    "ffn_in/bias": ("model",),
    "ffn_in/output": ("batch", None, "model"),
    "ffn_out/kernel": ("model", None),
    "ffn_out/bias": (None,),
    "ffn_out/output": ("batch", None, None),
}


def expected_blocks(prefix):
    return {
        f"{prefix}block_{i}/{key}": value
        for i in range(2)
        for key, value in EXPECTED_BLOCK.items()
    }


def test_subclassed_model_reads_output_rank_from_build_shapes():
    model = SubclassedModel()
    model(np.zeros((2, 6, 16), "float32"))
    axes = axes_of(tp.tensor_parallel_layouts(model, MESH_2D, PLAN))
    assert axes == expected_blocks("sub/")


def test_nested_layers_in_functional_model_and_abstract_model():
    def build():
        inputs = layers.Input((6, 16), name="x")
        h = Block(name="block_0")(inputs)
        h = Block(name="block_1")(h)
        return models.Model(inputs, h, name="fm")

    built = axes_of(tp.tensor_parallel_layouts(build(), MESH_2D, PLAN))
    assert built == expected_blocks("")
    with backend.StatelessScope(initialize_variables=False):
        abstract = build()
        assert all(v._value is None for v in abstract.weights)
        assert axes_of(tp.tensor_parallel_layouts(abstract, MESH_2D, PLAN)) == (
            built
        )


def test_sequential_model():
    model = models.Sequential(
        [
            layers.Input((16,)),
            layers.Dense(32, name="up"),
            layers.Dense(8, name="down"),
        ],
        name="seq",
    )
    plan = {
        "seq/up": tp.column_parallel("model"),
        "seq/down": tp.row_parallel("model"),
    }
    axes = axes_of(tp.tensor_parallel_layouts(model, MESH_1D, plan))
    assert axes["seq/up/kernel"] == (None, "model")
    assert axes["seq/up/output"] == (None, "model")
    assert axes["seq/down/kernel"] == ("model", None)
    assert axes["seq/down/output"] == (None, None)


def test_prepare_output_and_prepare_input():
    inputs = layers.Input((16,), name="x")
    h = layers.Dense(32, name="up")(inputs)
    h = layers.Activation("relu", name="act")(h)
    h = layers.Dense(8, name="down")(h)
    model = models.Model(inputs, h)
    plan = {
        "act": tp.prepare_output(("batch", "model")),
        "down": tp.prepare_input(("batch", None)),
    }
    with pytest.raises(
        ValueError, match="Conflicting layouts for 'act/output'"
    ):
        tp.tensor_parallel_layouts(model, MESH_2D, plan)
    plan = {
        "up": tp.prepare_output(("batch", "model")),
        "down": tp.prepare_input(("batch", None)),
    }
    axes = axes_of(tp.tensor_parallel_layouts(model, MESH_2D, plan))
    # prepare_input sets the layout of the layer that feeds `down`.
    assert axes == {
        "up/output": ("batch", "model"),
        "act/output": ("batch", None),
    }


def test_prepare_input_and_output_errors():
    model = mlp()
    with pytest.raises(ValueError, match="model input"):
        tp.tensor_parallel_layouts(
            model, MESH_2D, {"up": tp.prepare_input(("batch", None))}
        )
    with pytest.raises(ValueError, match="has rank 2, but 3 axes"):
        tp.tensor_parallel_layouts(
            model, MESH_2D, {"down": tp.prepare_input(("batch", None, None))}
        )
    with pytest.raises(ValueError, match="output has rank 2, but 1 axes"):
        tp.tensor_parallel_layouts(
            model, MESH_2D, {"down": tp.prepare_output(("batch",))}
        )
    sub = SubclassedModel()
    sub(np.zeros((2, 6, 16), "float32"))
    with pytest.raises(ValueError, match="functional models only"):
        tp.tensor_parallel_layouts(
            sub, MESH_2D, {"sub/block_0/ffn_out": tp.prepare_input((None,) * 3)}
        )
    # Inputs that come from an op that is not a layer.
    inputs = layers.Input((16,), name="x")
    h = layers.Dense(16, name="up")(inputs)
    h = ops.add(h, inputs)
    h = layers.Dense(8, name="down")(h)
    model = models.Model(inputs, h)
    with pytest.raises(ValueError, match="not a layer"):
        tp.tensor_parallel_layouts(
            model, MESH_2D, {"down": tp.prepare_input(("batch", None))}
        )


def test_plan_errors():
    model = mlp()
    with pytest.raises(ValueError, match="'dense_.*' matches no layer"):
        tp.tensor_parallel_layouts(
            model, MESH_2D, {"dense_.*": tp.column_parallel("model")}
        )
    with pytest.raises(ValueError, match="Layer 'up' matches two plan keys"):
        tp.tensor_parallel_layouts(
            model,
            MESH_2D,
            {"up": tp.column_parallel("model"), "u.": tp.row_parallel()},
        )
    inputs = layers.Input((16,), name="x")
    outputs = layers.LayerNormalization(name="norm")(inputs)
    with pytest.raises(ValueError, match="'norm' is a LayerNormalization"):
        tp.tensor_parallel_layouts(
            models.Model(inputs, outputs),
            MESH_2D,
            {"norm": tp.column_parallel("model")},
        )


def test_indivisible_and_unknown_axes_name_the_variable():
    # 6 output features cannot be split over 4.
    inputs = layers.Input((16,), name="x")
    outputs = layers.Dense(6, name="up")(inputs)
    model = models.Model(inputs, outputs)
    with pytest.raises(ValueError) as error:
        tp.tensor_parallel_layouts(
            model, MESH_2D, {"up": tp.column_parallel("model")}
        )
    message = str(error.value)
    assert "'up/kernel' with shape (16, 6)" in message
    assert "(None, 'model')" in message
    assert "DeviceMesh({'batch': 2, 'model': 4})" in message
    assert "not divisible by 4, the size of mesh axis 'model'" in message
    with pytest.raises(ValueError, match="axis 'tensor' is not a mesh axis"):
        tp.tensor_parallel_layouts(
            mlp(), MESH_2D, {"up": tp.column_parallel("tensor")}
        )


def test_custom_style():
    def replicate_kernel(layer, batch_dim_name):
        return {layer.kernel.path: (None, None)}

    axes = axes_of(
        tp.tensor_parallel_layouts(mlp(), MESH_2D, {"up": replicate_kernel})
    )
    assert axes == {"up/kernel": (None, None)}


def test_result_is_a_layout_map_for_model_parallel():
    plan = {"up": tp.column_parallel("model"), "down": tp.row_parallel("model")}
    layout_map = tp.tensor_parallel_layouts(mlp(), MESH_2D, plan)
    assert layout_map.device_mesh is MESH_2D
    assert layout_map["up/kernel"].axes == (None, "model")
    assert layout_map["up/kernel"].device_mesh is MESH_2D
    assert layout_map["down/bias"].axes == (None,)


def test_public_names_resolve():
    import keras_dtensor

    assert keras_dtensor.column_parallel is tp.column_parallel
    assert keras_dtensor.row_parallel is tp.row_parallel
    assert keras_dtensor.prepare_input is tp.prepare_input
    assert keras_dtensor.prepare_output is tp.prepare_output
    assert keras_dtensor.tensor_parallel_layouts is tp.tensor_parallel_layouts
