"""Trains tiny keras-hub backbones laid out by their own `get_layout_map`.

Usage: keras_hub_worker.py OPTIMIZER (under torchrun)
  OPTIMIZER: `sgd` (with momentum) or `adamw`.

The mesh is ("batch", "model"), of shape (1, N) for N=2 processes and
(2, N/2) for more. For each of `GemmaBackbone` and `LlamaBackbone`, the
worker builds a tiny causal language model (the backbone, then logits from
its token embedding, as `GemmaCausalLM` and `LlamaCausalLM` compute them)
and trains it for a few steps with `fit`: first without a distribution
(the single-process reference, reported under `reference/<model>/...`),
then under `ModelParallel` with the backbone's published layout map
(reported under `<model>/...`). It reports per-step losses, initial and
final weights, and the placements and local shapes of a few sharded
variables.

The distributed model is first trained exactly as a user would write it,
with the published layout map and nothing else. When that fails, the error
is reported under `<model>/out_of_box_error` and the model is trained again
with the workarounds in `WORKAROUNDS`, each of them also valid in user
code; `<model>/workarounds` names the ones used.
"""

import contextlib
import sys

import keras_hub
import numpy as np
import torch
import worker_utils
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.attention import SDPBackend
from torch.nn.attention import sdpa_kernel
from worker_utils import record

import keras

OPTIMIZER = sys.argv[1]
SEED = 1337
VOCAB, SEQ, BATCH, STEPS = 256, 8, 4, 3
CONFIG = {
    "vocabulary_size": VOCAB,
    "num_layers": 2,
    "num_query_heads": 4,
    "num_key_value_heads": 2,
    "hidden_dim": 32,
    "intermediate_dim": 64,
}
BACKBONES = {
    "gemma": (keras_hub.models.GemmaBackbone, {"head_dim": 8}),
    "llama": (keras_hub.models.LlamaBackbone, {}),
}
# Variables whose placements and local shapes are reported.
SHARDED_PATHS = {
    "gemma": [
        "token_embedding/embeddings",
        "decoder_block_0/attention/query/kernel",
        "decoder_block_0/attention/key/kernel",
        "decoder_block_0/attention/attention_output/kernel",
        "decoder_block_0/ffw_gating/kernel",
        "decoder_block_0/ffw_linear/kernel",
    ],
    "llama": [
        "token_embedding/embeddings",
        "transformer_layer_0/self_attention/query/kernel",
        "transformer_layer_0/self_attention/key/kernel",
        "transformer_layer_0/self_attention/attention_output/kernel",
        "transformer_layer_0/feedforward_intermediate_dense/kernel",
        "transformer_layer_0/feedforward_output_dense/kernel",
    ],
}
CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# What each workaround stands in for (see integration_tests/keras_hub_test):
# - "implicit_replication": keras-hub builds causal masks and positions as
#   plain tensors (identical on every process) and mixes them with DTensors.
# - "embedding_output_layout": the vocabulary-sharded embedding lookup
#   returns a `_MaskPartial` DTensor, which DTensor can reduce only once; a
#   `token_embedding/output` layout reduces it at the layer boundary.
# - "math_attention": DTensor has no sharding rule for the CPU attention
#   kernel that `scaled_dot_product_attention` picks (its decomposition is
#   searched instead: minutes per call); the math backend is plain ops.
WORKAROUNDS = {
    "gemma": ["implicit_replication"],
    "llama": [
        "implicit_replication",
        "embedding_output_layout",
        "math_attention",
    ],
}


def cpu_attention_is_handled():
    """Whether attention on CPU DTensors works under the distribution.

    It does if DTensor has a sharding rule for the CPU attention kernel, or
    if training steps select the math backend of
    `scaled_dot_product_attention` (plain ops) instead of that kernel.
    """
    propagator = DTensor._op_dispatcher.sharding_propagator
    if CPU_ATTENTION.default in propagator.op_strategy_funcs:
        return True
    flash_enabled = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            flash_enabled.append(torch.backends.cuda.flash_sdp_enabled())
            return x

    probe = keras.Sequential([keras.Input((1,)), Probe()])
    probe.predict_on_batch(np.zeros((BATCH, 1), dtype="float32"))
    return not flash_enabled[-1]


def make_data():
    """Token ids, next-token labels and a padding mask with some padding."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, size=(BATCH * STEPS, SEQ + 1))
    tokens = tokens.astype("int32")
    padding_mask = np.ones((BATCH * STEPS, SEQ), dtype="int32")
    padding_mask[1, 6:] = 0
    padding_mask[6, 3:] = 0
    x = {"token_ids": tokens[:, :-1], "padding_mask": padding_mask}
    return x, tokens[:, 1:], padding_mask


def set_distribution(name, workarounds=()):
    backbone_class, _ = BACKBONES[name]
    devices = keras.distribution.list_devices()
    n = len(devices)
    shape = (1, n) if n == 2 else (2, n // 2)
    mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)
    layout_map = backbone_class.get_layout_map(mesh)
    if "embedding_output_layout" in workarounds:
        layout_map["token_embedding/output"] = ("batch", None, None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )


def build_backbone(name):
    backbone_class, extra_config = BACKBONES[name]
    keras.utils.set_random_seed(SEED)
    return backbone_class(**CONFIG, **extra_config)


def build_model(name):
    """The backbone, then logits from its (reversible) token embedding."""
    backbone = build_backbone(name)
    logits = backbone.token_embedding(backbone.output, reverse=True)
    model = keras.Model(backbone.input, logits)
    optimizer = (
        keras.optimizers.SGD(0.1, momentum=0.9)
        if OPTIMIZER == "sgd"
        else keras.optimizers.AdamW(0.01, weight_decay=0.01)
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class BatchLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def train(name, workarounds=()):
    """Builds and trains one model; returns it, its first weights, losses."""
    model = build_model(name)
    initial_weights = model.get_weights()
    x, y, sample_weight = make_data()
    losses = BatchLosses()
    with contextlib.ExitStack() as stack:
        if "implicit_replication" in workarounds:
            stack.enter_context(implicit_replication())
        if "math_attention" in workarounds:
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        model.fit(
            x,
            y,
            sample_weight=sample_weight,
            batch_size=BATCH,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[losses],
        )
    return model, initial_weights, losses.losses


def train_distributed(name):
    """Trains with the published layout map only, else with workarounds."""
    set_distribution(name)
    if name == "llama" and not cpu_attention_is_handled():
        # Trying would spend minutes per attention call before failing.
        error = (
            f"no DTensor sharding rule for {CPU_ATTENTION.default}, which "
            "scaled_dot_product_attention calls on CPU"
        )
    else:
        try:
            result = train(name)
            record(f"{name}/out_of_box_error", None)
            record(f"{name}/workarounds", [])
            return result
        except Exception as exception:  # noqa: BLE001 - reported
            error = f"{type(exception).__name__}: {exception}"
    record(f"{name}/out_of_box_error", error)
    record(f"{name}/workarounds", WORKAROUNDS[name])
    set_distribution(name, WORKAROUNDS[name])
    return train(name, WORKAROUNDS[name])


def record_run(prefix, model, initial_weights, losses):
    record(f"{prefix}/losses", losses)
    record(f"{prefix}/initial_weights", [w.tolist() for w in initial_weights])
    record(f"{prefix}/final_weights", [w.tolist() for w in model.get_weights()])
    record(f"{prefix}/paths", [v.path for v in model.weights])


def run_train():
    for name in BACKBONES:
        record_run(f"reference/{name}", *train(name))
    for name in BACKBONES:
        model, initial_weights, losses = train_distributed(name)
        record_run(name, model, initial_weights, losses)
        variables = {v.path: v for v in model.weights}
        for path in SHARDED_PATHS[name]:
            value = variables[path].value
            placements = [str(p) for p in value.placements]
            record(f"{name}/placements/{path}", placements)
            record(f"{name}/local_shape/{path}", list(value.to_local().shape))


def main():
    keras.distribution.initialize()
    run_train()
    worker_utils.report()


if __name__ == "__main__":
    main()
