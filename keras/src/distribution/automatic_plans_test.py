"""Tests for automatic_plans.py: Megatron plans from a model's structure."""

import importlib.util
import math

import pytest

from keras.src import backend
from keras.src import layers
from keras.src import models
from keras.src import ops
from keras.src.distribution import automatic_plans as ap
from keras.src.distribution import fully_sharded
from keras.src.distribution import tensor_parallel as tp
from keras.src.distribution.distribution_lib import DeviceMesh
from keras.src.distribution.distribution_lib import LayoutMap
from keras.src.distribution.layout_composition import layout_map_axes

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 16, 4, 2, 4, 32, 64


def fake_mesh(sizes):
    count = math.prod(sizes.values())
    return DeviceMesh(
        tuple(sizes.values()), tuple(sizes), [f"cpu:{i}" for i in range(count)]
    )


class Attention(layers.Layer):
    """Grouped-query attention; sublayer names say nothing of roles."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.p = layers.EinsumDense(
            "btd,dnh->btnh", (None, HEADS, HEAD_DIM), name="p"
        )
        self.q = layers.EinsumDense(
            "btd,dnh->btnh", (None, KV_HEADS, HEAD_DIM), name="q"
        )
        self.r = layers.EinsumDense(
            "btd,dnh->btnh", (None, KV_HEADS, HEAD_DIM), name="r"
        )
        self.s = layers.EinsumDense("btnh,nhd->btd", (None, HIDDEN), name="s")

    def call(self, x):
        a, b, c = self.p(x), self.q(x), self.r(x)
        b = ops.repeat(b, HEADS // KV_HEADS, axis=2)
        c = ops.repeat(c, HEADS // KV_HEADS, axis=2)
        scores = ops.softmax(ops.einsum("btnh,bsnh->bnts", a, b))
        return self.s(ops.einsum("bnts,bsnh->btnh", scores, c))


class Block(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.n1 = layers.LayerNormalization(name="n1")
        self.mix = Attention(name="mix")
        self.n2 = layers.LayerNormalization(name="n2")
        self.u = layers.Dense(FFN, name="u")
        self.v = layers.Dense(FFN, name="v")
        self.w = layers.Dense(HIDDEN, name="w")

    def call(self, x):
        x = x + self.mix(self.n1(x))
        h = self.n2(x)
        return x + self.w(ops.silu(self.u(h)) * self.v(h))


def toy_model(blocks=2):
    tokens = layers.Input((None,), dtype="int32", name="tokens")
    table = layers.Embedding(VOCAB, HIDDEN, name="table")
    x = table(tokens)
    for i in range(blocks):
        x = Block(name=f"b{i}")(x)
    x = layers.LayerNormalization(name="last")(x)
    logits = layers.Dense(VOCAB, name="logits")(x)
    return models.Model(tokens, logits)


def styles(report):
    """Layer path -> style, from a report."""
    return dict(line.split(",")[0].split(": ") for line in report)


def test_toy_model_roles_from_connections_not_names():
    model = toy_model()
    plan, report = ap.auto_tensor_parallel_plan(
        model, fake_mesh({"batch": 1, "model": 2})
    )
    got = styles(report)
    for i in range(2):
        assert got[f"b{i}/mix/p"] == "column"
        assert got[f"b{i}/mix/q"] == "column"  # 2 key/value heads over 2
        assert got[f"b{i}/mix/r"] == "column"
        assert got[f"b{i}/mix/s"] == "row"
        assert got[f"b{i}/u"] == "column"
        assert got[f"b{i}/v"] == "column"
        assert got[f"b{i}/w"] == "row"
        assert got[f"b{i}/n1"] == got[f"b{i}/n2"] == "replicated"
    assert got["table"] == "vocabulary"
    # The untied head has no row partner: replicated, and said why.
    assert got["logits"] == "replicated"
    assert any(
        line.startswith("logits:") and "no row-parallel partner" in line
        for line in report
    )
    # One line per layer that owns variables.
    owners = [
        layer for layer in model._flatten_layers() if ap._own_variables(layer)
    ]
    assert len(report) == len(owners)
    assert set(plan.values()) - {None}


def test_grouped_key_value_replicated_when_heads_do_not_divide():
    model = toy_model(blocks=1)
    _, report = ap.auto_tensor_parallel_plan(
        model, fake_mesh({"batch": 1, "model": 4})
    )
    got = styles(report)
    assert got["b0/mix/p"] == "column"
    assert got["b0/mix/q"] == got["b0/mix/r"] == "replicated"
    assert got["b0/mix/s"] == "row"
    line = next(line for line in report if line.startswith("b0/mix/q:"))
    assert "2 heads or features do not divide over 'model' of size 4" in line


COLUMNS = ("mix/p", "mix/q", "mix/r", "u", "v")


def test_layouts_equal_a_hand_written_megatron_plan():
    model = toy_model()
    mesh = fake_mesh({"batch": 2, "model": 2})
    hand = {
        r"b\d/mix/(p|q|r)": tp.column_parallel("model"),
        r"b\d/mix/s": tp.row_parallel("model"),
        r"b\d/(u|v)": tp.column_parallel("model"),
        r"b\d/w": tp.row_parallel("model"),
        "table": tp.row_parallel("model"),
    }
    expected = layout_map_axes(tp.tensor_parallel_layouts(model, mesh, hand))
    # The vocabulary-split table sets no output layout (a tied head's
    # logits stay split along the vocabulary), nor do the column-parallel
    # layers (their split kernels split their outputs already).
    for path in ("table", *(f"b{i}/{n}" for i in (0, 1) for n in COLUMNS)):
        del expected[f"{path}/output"]
    got = layout_map_axes(ap.auto_tensor_parallel_layouts(model, mesh))
    assert got == expected
    assert got["b0/mix/s/output"] == ("batch", None, None)
    assert got["b0/mix/q/kernel"] == (None, "model", None)
    assert got["b0/mix/s/kernel"] == ("model", None, None)
    assert got["table/embeddings"] == ("model", None)


def test_abstract_model_and_composition_with_fully_sharded():
    mesh = fake_mesh({"fsdp": 2, "model": 2})
    with backend.StatelessScope():
        model = toy_model()
        automatic = ap.auto_tensor_parallel_layouts(model, mesh, "model")
        merged = fully_sharded.fully_sharded_layouts(
            model, mesh, "fsdp", min_size=1, layout_map=automatic
        )
    axes = layout_map_axes(merged)
    planned = layout_map_axes(automatic)
    for variable in model.weights:
        if variable.path not in planned:
            continue
        # The plan's model axis stays where it was (the major axis of its
        # dimension); fsdp is added on some dimension.
        for entry, merged_entry in zip(
            planned[variable.path], axes[variable.path]
        ):
            if entry is not None:
                names = (
                    merged_entry
                    if isinstance(merged_entry, tuple)
                    else (merged_entry,)
                )
                assert names[0] == entry
        assert "fsdp" in str(axes[variable.path]), variable.path
    assert axes["b0/w/kernel"] == (("model", "fsdp"), None)


def test_user_entries_win():
    model = toy_model(blocks=1)
    mesh = fake_mesh({"batch": 1, "model": 2})
    user = LayoutMap(mesh)
    user["b0/u/kernel"] = (None, None)
    user["b0/n1/gamma"] = ("model",)
    axes = layout_map_axes(
        ap.auto_tensor_parallel_layouts(model, mesh, layout_map=user)
    )
    assert axes["b0/u/kernel"] == (None, None)
    assert "b0/u/output" not in axes
    assert axes["b0/n1/gamma"] == ("model",)
    assert axes["b0/v/kernel"] == (None, "model")
    assert axes["b0/w/kernel"] == ("model", None)


def test_mixture_of_experts_split_over_experts_router_replicated():
    class Experts(layers.Layer):
        def build(self, shape):
            self.up = self.add_weight((4, HIDDEN, FFN), name="up")
            self.down = self.add_weight((4, FFN, HIDDEN), name="down")

        def call(self, x):
            h = ops.einsum("btd,edf->ebtf", x, self.up)
            return ops.einsum("ebtf,efd->ebtd", h, self.down)

    tokens = layers.Input((None, HIDDEN), name="x")
    gate = layers.Dense(4, name="gate")(tokens)
    routed = Experts(name="bank")(tokens)
    out = ops.einsum("bte,ebtd->btd", ops.softmax(gate), routed)
    model = models.Model(tokens, out)
    mesh = fake_mesh({"batch": 1, "model": 2})
    plan, report = ap.auto_tensor_parallel_plan(model, mesh)
    got = styles(report)
    assert got == {"gate": "replicated", "bank": "experts"}
    axes = layout_map_axes(tp.tensor_parallel_layouts(model, mesh, plan))
    assert axes == {
        "bank/up": ("model", None, None),
        "bank/down": ("model", None, None),
    }


def test_bad_axis_and_expert_style_errors():
    model = toy_model(blocks=1)
    with pytest.raises(ValueError, match="'tensor' is not an axis"):
        ap.auto_tensor_parallel_plan(model, fake_mesh({"model": 2}), "tensor")
    dense = model.get_layer("logits")
    with pytest.raises(ValueError, match="do not share a leading dimension"):
        ap.expert_parallel("model")(dense, None)


# keras-hub's backbones, tiny: the style of each layer of the first block
# that the plan splits (others replicated), on a (1, 2) mesh.
def _keras_hub_cases():
    gqa = dict(num_query_heads=4, num_key_value_heads=2)
    common = dict(
        vocabulary_size=64, num_layers=2, hidden_dim=16, intermediate_dim=32
    )
    llama_like = {
        "self_attention/query": "column",
        "self_attention/key": "column",
        "self_attention/value": "column",
        "self_attention/attention_output": "row",
        "feedforward_gate_dense": "column",
        "feedforward_intermediate_dense": "column",
        "feedforward_output_dense": "row",
    }
    gemma_like = {
        "attention/query": "column",
        "attention/key": "column",
        "attention/value": "column",
        "attention/attention_output": "row",
        "ffw_gating": "column",
        "ffw_gating_2": "column",
        "ffw_linear": "row",
    }
    mha = {
        "self_attention/query": "column",
        "self_attention/key": "column",
        "self_attention/value": "column",
        "self_attention/attention_output": "row",
        "feedforward_intermediate_dense": "column",
        "feedforward_output_dense": "row",
    }
    moe = "mixtral_sparse_moe_block"
    qmoe = "qwen_sparse_moe_block"
    return {
        "GemmaBackbone": (dict(**common, **gqa, head_dim=4), gemma_like),
        "Gemma3Backbone": (
            dict(**common, **gqa, head_dim=4, image_size=16),
            gemma_like,
        ),
        "Llama3Backbone": (dict(**common, **gqa), llama_like),
        "MistralBackbone": (dict(**common, **gqa), llama_like),
        "Phi3Backbone": (
            dict(**common, **gqa),
            {
                k.replace("self_attention", "attention"): v
                for k, v in llama_like.items()
            },
        ),
        "Qwen3Backbone": (dict(**common, **gqa, head_dim=4), llama_like),
        "MixtralBackbone": (
            dict(**common, **gqa, num_experts=4, top_k=2),
            {
                **{k: v for k, v in llama_like.items() if "feed" not in k},
                f"{moe}/experts": "experts",
                f"{moe}/sparse_feedforward_gate_dense": "replicated",
            },
        ),
        "QwenMoeBackbone": (
            dict(
                **common,
                **gqa,
                moe_intermediate_dim=8,
                shared_expert_intermediate_dim=16,
                num_experts=4,
                top_k=2,
            ),
            {
                **{k: v for k, v in llama_like.items() if "feed" not in k},
                f"{qmoe}/experts": "experts",
                f"{qmoe}/sparse_feedforward_gate_dense": "replicated",
                f"{qmoe}/shared_expert_gate_dense": "replicated",
                f"{qmoe}/shared_expert_dense/feedforward_gate_dense": "column",
                f"{qmoe}/shared_expert_dense/"
                "feedforward_intermediate_dense": "column",
                f"{qmoe}/shared_expert_dense/feedforward_output_dense": "row",
            },
        ),
        "GPT2Backbone": (
            dict(**common, num_heads=4, max_sequence_length=32),
            mha,
        ),
        "OPTBackbone": (
            dict(**common, num_heads=4, max_sequence_length=32),
            mha,
        ),
        "GPTNeoXBackbone": (
            dict(common, hidden_dim=32, num_heads=4, max_sequence_length=32),
            {
                "self_attention/query_key_value": "column",
                "self_attention/attention_output": "row",
                "feedforward_intermediate_dense": "column",
                "feedforward_output_dense": "row",
            },
        ),
        "FalconBackbone": (
            dict(**common, num_attention_heads=4),
            {
                "attention/query_dense": "column",
                "attention/key_dense": "column",
                "attention/value_dense": "column",
                "attention/output_dense": "row",
                "dense_h_to_4h": "column",
                "dense_4h_to_h": "row",
            },
        ),
        "BloomBackbone": (
            dict(**common, num_heads=4),
            {
                "self_attention/query_dense": "column",
                "self_attention/key_dense": "column",
                "self_attention/value_dense": "column",
                "self_attention/output_dense": "row",
                "mlp_intermediate_dense": "column",
                "mlp_output_dense": "row",
            },
        ),
        "BertBackbone": (
            dict(**common, num_heads=4, max_sequence_length=32),
            {
                k.replace("self_attention", "self_attention_layer"): v
                for k, v in mha.items()
            },
        ),
    }


KERAS_HUB_CASES = _keras_hub_cases()


@pytest.mark.skipif(
    importlib.util.find_spec("keras_hub") is None, reason="needs keras-hub"
)
@pytest.mark.parametrize("name", sorted(KERAS_HUB_CASES))
def test_keras_hub_backbone_plans(name):
    import keras_hub

    config, block_styles = KERAS_HUB_CASES[name]
    with backend.StatelessScope():
        model = getattr(keras_hub.models, name)(**config)
        plan, report = ap.auto_tensor_parallel_plan(
            model, fake_mesh({"batch": 1, "model": 2})
        )
        layout_map = ap.auto_tensor_parallel_layouts(
            model, fake_mesh({"batch": 1, "model": 2})
        )
    got = styles(report)
    blocks = sorted({path.split("/")[0] for path in got if "_0/" in path})
    (block,) = blocks
    in_block = {
        path[len(block) + 1 :]: style
        for path, style in got.items()
        if path.startswith(block + "/")
    }
    split = {path: s for path, s in in_block.items() if s != "replicated"}
    expected_split = {
        path: s for path, s in block_styles.items() if s != "replicated"
    }
    assert split == expected_split
    for path, style in block_styles.items():
        assert in_block[path] == style
    # The token embedding is split on its vocabulary, and every other
    # block is planned as the first.
    token = next(p for p in got if p.endswith("token_embedding"))
    assert got[token] == "vocabulary"
    second = block.replace("_0", "_1")
    assert sorted(s for p, s in got.items() if p.startswith(second + "/")) == (
        sorted(in_block.values())
    )
    axes = layout_map_axes(layout_map)
    assert axes[f"{token}/embeddings"] == ("model", None)
    assert len(report) == len(
        [layer for layer in model._flatten_layers() if ap._own_variables(layer)]
    )


def test_lora_layers_split_on_their_kernels():
    model = toy_model(blocks=1)
    for name in ("u", "v", "w"):
        getattr(model.get_layer("b0"), name).enable_lora(2)
    mesh = fake_mesh({"batch": 1, "model": 2})
    plan, report = ap.auto_tensor_parallel_plan(model, mesh)
    got = styles(report)
    assert (got["b0/u"], got["b0/v"], got["b0/w"]) == ("column",) * 2 + ("row",)
    axes = layout_map_axes(tp.tensor_parallel_layouts(model, mesh, plan))
    assert axes["b0/u/kernel"] == (None, "model")
    assert axes["b0/w/kernel"] == ("model", None)
    # The adapters stay replicated.
    assert not any("lora" in key for key in axes)


@pytest.mark.parametrize(
    "rows, columns, style, axes",
    [
        (64, 16, "vocabulary", ("model", None)),
        # A vocabulary that does not divide: the hidden size is split.
        (63, 16, "hidden", (None, "model")),
        (63, 15, "replicated", None),
        # A small table (segments, positions) stays replicated.
        (2, 16, "replicated", None),
    ],
)
def test_embedding_split_by_vocabulary_or_hidden_size(
    rows, columns, style, axes
):
    tokens = layers.Input((None,), dtype="int32", name="tokens")
    outputs = layers.Embedding(rows, columns, name="table")(tokens)
    model = models.Model(tokens, outputs)
    mesh = fake_mesh({"batch": 1, "model": 2})
    plan, report = ap.auto_tensor_parallel_plan(model, mesh)
    assert styles(report) == {"table": style}
    got = layout_map_axes(tp.tensor_parallel_layouts(model, mesh, plan))
    if axes is None:
        assert got == {}
    elif style == "vocabulary":
        # No output layout: a lookup's result is whole as it is made, and
        # a tied head's logits stay split along the vocabulary.
        assert got == {"table/embeddings": axes}
    else:
        # The hidden-size split gathers its output.
        assert got == {
            "table/embeddings": axes,
            "table/output": ("batch", None, None),
        }
