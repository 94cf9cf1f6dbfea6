"""The "Distributed tuning with Gemma using Keras" guide's workflow.

A tiny Gemma (random weights, synthetic token ids, no download) is laid
out with `GemmaBackbone.get_layout_map` on a (1, N) ("batch", "model")
mesh, tuned with LoRA, evaluated, saved and asked to generate. Run on CPU
with two gloo processes (keras-hub and grain installed):

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 examples/gemma_lora.py

Every process prints the layout of a query kernel, the losses and the
generated token ids, the same on every process; process 0 writes
`gemma_lora.weights.h5` in the current folder.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import keras  # noqa: E402

VOCABULARY, SEQUENCE, ROWS = 256, 16, 16


def tiny_gemma():
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        head_dim=8,
    )
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def main():
    keras.distribution.initialize()
    keras.utils.set_random_seed(0)
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(
        (1, len(devices)), ("batch", "model"), devices
    )
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )

    gemma_lm = tiny_gemma()
    gemma_lm.backbone.enable_lora(rank=4)
    gemma_lm.compile(
        optimizer=keras.optimizers.AdamW(5e-3, weight_decay=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
        sampler="greedy",
    )
    rank = int(os.environ.get("RANK", "0"))
    for variable in gemma_lm.weights:
        if variable.path.startswith("decoder_block_0/attention/query/"):
            print(
                f"[rank {rank}] {variable.path} placements="
                f"{tuple(variable.value.placements)}",
                flush=True,
            )

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCABULARY, size=(ROWS, SEQUENCE + 1))
    x = {
        "token_ids": tokens[:, :-1].astype("int32"),
        "padding_mask": np.ones((ROWS, SEQUENCE), "int32"),
    }
    y = tokens[:, 1:]
    history = gemma_lm.fit(
        x, y, sample_weight=x["padding_mask"], batch_size=4, verbose=0
    )
    print(f"[rank {rank}] losses: {history.history['loss']}", flush=True)
    metrics = gemma_lm.evaluate(
        x, y, sample_weight=x["padding_mask"], verbose=0
    )
    print(f"[rank {rank}] evaluate: {metrics}", flush=True)
    gemma_lm.save_weights("gemma_lora.weights.h5")

    prompt = np.zeros((1, SEQUENCE), "int32")
    prompt[0, :4] = tokens[0, :4]
    mask = (prompt > 0).astype("int32")
    generated = gemma_lm.generate(
        {"token_ids": prompt, "padding_mask": mask}, stop_token_ids=None
    )
    print(
        f"[rank {rank}] generated: {generated['token_ids'][0].tolist()}",
        flush=True,
    )


if __name__ == "__main__":
    main()
