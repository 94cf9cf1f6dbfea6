"""Trains tiny keras-hub backbones laid out by their own `get_layout_map`.

Usage: keras_hub_worker.py RUN [RUN ...] (under torchrun), each RUN being
`MESH:OPTIMIZER[:BACKBONE]`:
  MESH: `dp` (`DataParallel` over all processes), or `RxC`, a
    ("batch", "model") mesh of R x C processes under `ModelParallel` with
    the backbone's published layout map.
  OPTIMIZER: `sgd` (with momentum) or `adamw`.
  BACKBONE: `gemma` or `llama`; both when not given.

For `GemmaBackbone` and `LlamaBackbone` (or the one named), it builds a tiny
causal language model (the backbone, then logits from its token embedding,
as `GemmaCausalLM` and `LlamaCausalLM` compute them) and trains it for a
few steps with `fit`, exactly as a user would write it: first without a
distribution (the single-process reference, reported under
`<RUN>/reference/<model>/...`), then under the distribution (reported
under `<RUN>/<model>/...`). It reports per-step losses, initial and final
weights, and the placements and local shapes of a few sharded variables.
"""

import sys

import keras_hub
import numpy as np
import worker_utils
from worker_utils import record

import keras

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


def set_distribution(name, mesh):
    """Sets `DataParallel`, or `ModelParallel` with the published layouts."""
    devices = keras.distribution.list_devices()
    if mesh == "dp":
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices)
        )
        return
    shape = tuple(int(n) for n in mesh.split("x"))
    device_mesh = keras.distribution.DeviceMesh(
        shape, ("batch", "model"), devices
    )
    backbone_class, _ = BACKBONES[name]
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=backbone_class.get_layout_map(device_mesh)
        )
    )


def build_backbone(name):
    backbone_class, extra_config = BACKBONES[name]
    keras.utils.set_random_seed(SEED)
    return backbone_class(**CONFIG, **extra_config)


def build_model(name, optimizer_name):
    """The backbone, then logits from its (reversible) token embedding."""
    backbone = build_backbone(name)
    logits = backbone.token_embedding(backbone.output, reverse=True)
    model = keras.Model(backbone.input, logits)
    optimizer = (
        keras.optimizers.SGD(0.1, momentum=0.9)
        if optimizer_name == "sgd"
        else keras.optimizers.AdamW(0.01, weight_decay=0.01)
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def train(name, optimizer_name):
    """Builds and trains one model; returns it, its first weights, losses."""
    model = build_model(name, optimizer_name)
    initial_weights = model.get_weights()
    x, y, sample_weight = make_data()
    losses = worker_utils.BatchLosses()
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


def record_run(prefix, model, initial_weights, losses):
    record(f"{prefix}/losses", losses)
    record(f"{prefix}/initial_weights", [w.tolist() for w in initial_weights])
    record(f"{prefix}/final_weights", [w.tolist() for w in model.get_weights()])
    record(f"{prefix}/paths", [v.path for v in model.weights])


def run(spec):
    """Trains each backbone without, then with, the distribution."""
    mesh, optimizer_name, *names = spec.split(":")
    for name in names or BACKBONES:
        keras.distribution.set_distribution(None)
        record_run(f"{spec}/reference/{name}", *train(name, optimizer_name))
        set_distribution(name, mesh)
        model, initial_weights, losses = train(name, optimizer_name)
        record_run(f"{spec}/{name}", model, initial_weights, losses)
        record(f"{spec}/{name}/local_layers", local_layers(model))
        variables = {v.path: v for v in model.weights}
        for path in SHARDED_PATHS[name]:
            value = variables[path].value
            placements = [str(p) for p in value.placements]
            record(f"{spec}/{name}/placements/{path}", placements)
            record(
                f"{spec}/{name}/local_shape/{path}",
                list(value.to_local().shape),
            )
    keras.distribution.set_distribution(None)


def local_layers(model):
    """The paths of the layers whose training calls ran on local shards
    without a batch-local plan (`training_local_calls`)."""
    from keras.src.backend.torch import training_local_calls

    return sorted(
        layer.path
        for layer in model._flatten_layers()
        if layer.path and training_local_calls.runs_locally(layer)
    )


def main():
    keras.distribution.initialize()
    for spec in sys.argv[1:]:
        run(spec)
    worker_utils.report()


if __name__ == "__main__":
    main()
