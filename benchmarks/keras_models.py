"""The benchmark workloads as functional Keras models, and their layouts.

Layer names are shared by every workload so that one set of LayoutMap
regexes covers them all: in block `i`, `b{i}_q`, `b{i}_k`, `b{i}_v`,
`b{i}_up` and `b{i}_gate` are the column-parallel layers, `b{i}_o` and
`b{i}_down` the row-parallel ones (Megatron layout).

Attention is written with `keras.ops` (matmul and softmax) rather than
`MultiHeadAttention`: on CPU, `MultiHeadAttention` calls
`scaled_dot_product_attention`, whose backward has no DTensor sharding
rule in torch (see benchmarks/README.md). The native PyTorch models use
the same math.
"""

import math

import numpy as np
import workloads

import keras
from keras import ops

# LayoutMap regex -> axes, for the tensor-parallel ("model") mesh axis.
TENSOR_PARALLEL_LAYOUT = {
    r"b\d+_(q|k|v|up|gate)/kernel": (None, "model"),
    r"b\d+_(q|k|v|up|gate)/bias": ("model",),
    r"b\d+_(o|down)/kernel": ("model", None),
}

# Activations laid out in the data layout (batch-sharded, replicated over
# "model"): the outputs of the row-parallel layers, reduced at the layer
# boundary as `RowwiseParallel(output_layouts=Replicate())` does, and the
# outputs of the layers that feed the column-parallel ones (Megatron's "f"
# points, as `keras_dtensor.prepare_input` would set them). Without the
# first, DTensor carries the partial sums into the next block and picks
# its own collectives there (see benchmarks/README.md).
ACTIVATION_OUTPUTS = r"b\d+_(o|down|add|ln1|ln2|norm1|norm2)/output"

# LayoutMap regex -> axes for a fully sharded (ZeRO-3 / FSDP) layout: every
# trainable variable is sharded on its first dimension over the
# data-parallel axis, as FSDP2 shards every parameter of the native twin
# (the causal mask's bias and the rotary tables are buffers there).
FULLY_SHARDED_LAYOUT = {
    r".*/kernel": ("batch", None),
    r".*/embeddings": ("batch", None),
    r".*(?<!_mask)/bias": ("batch",),
    r".*/(gamma|beta|scale)": ("batch",),
}


class RotaryEmbedding(keras.layers.Layer):
    """Rotary position embedding (RoPE) for `(batch, seq, heads, dim)`.

    The cosine and sine tables are non-trainable weights, so that under a
    distribution they are replicated DTensors like every other variable.
    """

    def __init__(self, seq, head_dim, base=10000.0, **kwargs):
        super().__init__(**kwargs)
        self.seq = seq
        self.head_dim = head_dim
        self.base = base

    def build(self, input_shape):
        cos, sin = rotary_tables(self.seq, self.head_dim, self.base)
        self.cos = self.add_weight(
            name="cos",
            shape=cos.shape,
            initializer=keras.initializers.Constant(cos),
            trainable=False,
        )
        self.sin = self.add_weight(
            name="sin",
            shape=sin.shape,
            initializer=keras.initializers.Constant(sin),
            trainable=False,
        )

    def call(self, x):
        half = self.head_dim // 2
        rotated = ops.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        cos = ops.expand_dims(self.cos, 1)
        sin = ops.expand_dims(self.sin, 1)
        return x * cos + rotated * sin

    def get_config(self):
        config = super().get_config()
        config.update(
            {"seq": self.seq, "head_dim": self.head_dim, "base": self.base}
        )
        return config


class CausalMask(keras.layers.Layer):
    """Adds -1e9 to the attention scores of future positions.

    The additive mask is a non-trainable weight rather than
    `ops.triu(ops.ones_like(scores))`: DTensor has no sharded rule for
    `triu`, so that would all-gather the scores of a batch-sharded step.
    """

    def __init__(self, seq, **kwargs):
        super().__init__(**kwargs)
        self.seq = seq

    def build(self, input_shape):
        self.bias = self.add_weight(
            name="bias",
            shape=(self.seq, self.seq),
            initializer=keras.initializers.Constant(causal_bias(self.seq)),
            trainable=False,
        )

    def call(self, scores):
        return scores + self.bias

    def get_config(self):
        config = super().get_config()
        config.update({"seq": self.seq})
        return config


def causal_bias(seq):
    """`(seq, seq)` additive mask: 0 on and below the diagonal, else -1e9."""
    return np.triu(np.full((seq, seq), -1e9, dtype="float32"), k=1)


def rotary_tables(seq, head_dim, base=10000.0):
    """Cosine and sine tables of shape `(seq, head_dim)` (rotate-half)."""
    inverse = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)
    angles = np.outer(np.arange(seq), inverse)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype("float32"), np.sin(angles).astype("float32")


def _split_heads(x, config):
    """`(batch, seq, hidden)` -> `(batch, seq, heads, head_dim)`."""
    return ops.reshape(x, (-1, config.seq, config.heads, config.head_dim))


def _attention(x, config, prefix, causal=False, rotary=None, bias=True):
    """Multi-head self-attention, written with `keras.ops`."""
    q = keras.layers.Dense(config.hidden, use_bias=bias, name=f"{prefix}_q")
    k = keras.layers.Dense(config.hidden, use_bias=bias, name=f"{prefix}_k")
    v = keras.layers.Dense(config.hidden, use_bias=bias, name=f"{prefix}_v")
    q, k, v = (_split_heads(layer(x), config) for layer in (q, k, v))
    if rotary is not None:
        q, k = rotary(q), rotary(k)
    q, k, v = (ops.transpose(t, (0, 2, 1, 3)) for t in (q, k, v))
    scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2)))
    scores = scores * (1.0 / math.sqrt(config.head_dim))
    if causal:
        scores = CausalMask(config.seq, name=f"{prefix}_mask")(scores)
    weights = ops.softmax(scores, axis=-1)
    out = ops.transpose(ops.matmul(weights, v), (0, 2, 1, 3))
    out = ops.reshape(out, (-1, config.seq, config.hidden))
    return keras.layers.Dense(config.hidden, use_bias=bias, name=f"{prefix}_o")(
        out
    )


def build_mlp(config):
    """Residual MLP blocks on `(batch, hidden)` features, then a classifier.

    Block `i` is `x + b{i}_down(relu(b{i}_up(x)))`.
    """
    inputs = keras.Input((config.hidden,), name="features")
    x = inputs
    for i in range(config.layers):
        y = keras.layers.Dense(config.ffn, activation="relu", name=f"b{i}_up")(
            x
        )
        y = keras.layers.Dense(config.hidden, name=f"b{i}_down")(y)
        x = keras.layers.Add(name=f"b{i}_add")([x, y])
    outputs = keras.layers.Dense(config.vocab, name="head")(x)
    return keras.Model(inputs, outputs, name="mlp")


def build_transformer(config):
    """Pre-norm transformer blocks on `(batch, seq, hidden)` inputs.

    Block `i`: `x + attention(ln(x))`, then `x + mlp(ln(x))` with a GELU
    MLP; a per-token classifier on top.
    """
    inputs = keras.Input((config.seq, config.hidden), name="features")
    x = inputs
    for i in range(config.layers):
        y = keras.layers.LayerNormalization(epsilon=1e-5, name=f"b{i}_ln1")(x)
        x = x + _attention(y, config, f"b{i}")
        y = keras.layers.LayerNormalization(epsilon=1e-5, name=f"b{i}_ln2")(x)
        y = keras.layers.Dense(config.ffn, activation="gelu", name=f"b{i}_up")(
            y
        )
        x = x + keras.layers.Dense(config.hidden, name=f"b{i}_down")(y)
    outputs = keras.layers.Dense(config.vocab, name="head")(x)
    return keras.Model(inputs, outputs, name="transformer")


def build_llama(config):
    """A tiny Llama-style decoder on `(batch, seq)` token ids.

    Token embedding; per layer RMSNorm, causal attention with RoPE and no
    biases, RMSNorm, SwiGLU MLP; final RMSNorm and an untied LM head.
    """
    inputs = keras.Input((config.seq,), dtype="int32", name="token_ids")
    x = keras.layers.Embedding(config.vocab, config.hidden, name="embed")(
        inputs
    )
    for i in range(config.layers):
        rotary = RotaryEmbedding(config.seq, config.head_dim, name=f"b{i}_rope")
        y = keras.layers.RMSNormalization(epsilon=1e-6, name=f"b{i}_norm1")(x)
        x = x + _attention(
            y, config, f"b{i}", causal=True, rotary=rotary, bias=False
        )
        y = keras.layers.RMSNormalization(epsilon=1e-6, name=f"b{i}_norm2")(x)
        gate = keras.layers.Dense(config.ffn, use_bias=False, name=f"b{i}_gate")
        up = keras.layers.Dense(config.ffn, use_bias=False, name=f"b{i}_up")
        down = keras.layers.Dense(
            config.hidden, use_bias=False, name=f"b{i}_down"
        )
        x = x + down(ops.silu(gate(y)) * up(y))
    x = keras.layers.RMSNormalization(epsilon=1e-6, name="final_norm")(x)
    outputs = keras.layers.Dense(config.vocab, use_bias=False, name="head")(x)
    return keras.Model(inputs, outputs, name="llama")


BUILDERS = {
    "mlp": build_mlp,
    "transformer": build_transformer,
    "llama": build_llama,
}


def build_model(workload, config, jit_compile=False):
    """Builds and compiles the Keras model of `workload`."""
    model = BUILDERS[workload](config)
    model.compile(
        optimizer=make_optimizer(config),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


def make_optimizer(config):
    """The Keras optimizer matching `torch_models.make_optimizer`."""
    if config.optimizer == "sgd":
        return keras.optimizers.SGD(config.learning_rate, momentum=0.9)
    if config.optimizer == "adamw":
        return keras.optimizers.AdamW(
            config.learning_rate, weight_decay=0.01, epsilon=1e-8
        )
    raise ValueError(f"Unknown optimizer {config.optimizer!r}.")


def make_distribution(mode, world, workload="mlp", output_layouts=True):
    """The `keras.distribution` object for a benchmark mode.

    Args:
        mode: `"single"` (no distribution), `"dp"` (DataParallel), `"tp"`
            (ModelParallel on a `(1, N)` batch x model mesh, so the batch
            is replicated), `"2d"` (ModelParallel on a `(2, N/2)` mesh) or
            `"fsdp"` (every trainable variable sharded over the batch
            axis).
        world: number of processes.
        workload: the workload, for the rank of the activations.
        output_layouts: whether tensor-parallel layouts also lay out the
            activations named by `ACTIVATION_OUTPUTS`.

    Returns:
        A `Distribution`, or None for `"single"`.
    """
    if mode == "single":
        return None
    devices = keras.distribution.list_devices()
    if mode == "dp":
        return keras.distribution.DataParallel(devices=devices)
    if mode == "fsdp":
        mesh = keras.distribution.DeviceMesh((world,), ("batch",), devices)
        layout = FULLY_SHARDED_LAYOUT
    else:
        mesh = keras.distribution.DeviceMesh(
            workloads.mesh_shape(mode, world), ("batch", "model"), devices
        )
        layout = dict(TENSOR_PARALLEL_LAYOUT)
        if output_layouts:
            rank = 2 if workload == "mlp" else 3
            layout[ACTIVATION_OUTPUTS] = ("batch",) + (None,) * (rank - 1)
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in layout.items():
        layout_map[key] = axes
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
