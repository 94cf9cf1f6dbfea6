"""Trains tiny keras-hub models laid out by `auto_tensor_parallel_layouts`.

Usage: automatic_plans_worker.py MODEL[@hub][+generate] ... (under
torchrun; a ("batch", "model") mesh of (1, 2) on 2 processes, (2, 2) on
4).

For each MODEL (a keras-hub backbone class name), it builds a tiny model
(the backbone, then logits from its reversed token embedding), trains it
for 3 steps with `train_on_batch`, first without a distribution (the
reference, under `<MODEL>/reference/...`), then under `ModelParallel`
with the layout map `auto_tensor_parallel_layouts` derives (under
`<MODEL>/...`). It reports the losses, final weights, the plan's report,
the local bytes of parameters on this rank, and the collectives of the
third step (forward and backward, by op, counted as the benchmark's
`CollectiveCounter` counts them). With `+generate`, the trained backbone's
`CausalLM` then generates greedily from two prompts, in both runs. With
`@hub`, the backbone's own `get_layout_map` lays it out instead (results
under `<MODEL>@hub/...`), for comparison.
"""

import os
import sys
import time

import keras_hub
import numpy as np
import worker_utils
from worker_utils import record

sys.path.insert(
    0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
)
from measure import CollectiveCounter  # noqa: E402

import keras  # noqa: E402
import keras_dtensor as kd  # noqa: E402

SEED = 1337
VOCAB, SEQ, BATCH, STEPS = 64, 8, 4, 3
GENERATE_LENGTH = 10
COMMON = {
    "vocabulary_size": VOCAB,
    "num_layers": 2,
    "hidden_dim": 16,
    "intermediate_dim": 32,
}
GQA = {"num_query_heads": 4, "num_key_value_heads": 2}
CONFIGS = {
    "GemmaBackbone": {**COMMON, **GQA, "head_dim": 4},
    "Llama3Backbone": {**COMMON, **GQA},
    "MixtralBackbone": {**COMMON, **GQA, "num_experts": 4, "top_k": 2},
    "QwenMoeBackbone": {
        **COMMON,
        **GQA,
        "moe_intermediate_dim": 8,
        "shared_expert_intermediate_dim": 16,
        "num_experts": 4,
        "top_k": 2,
    },
    "GPT2Backbone": {**COMMON, "num_heads": 4, "max_sequence_length": 2 * SEQ},
    "BertBackbone": {**COMMON, "num_heads": 4, "max_sequence_length": 2 * SEQ},
    # Not trained in CI (see automatic_plans_test.py), run on request.
    "Gemma3Backbone": {**COMMON, **GQA, "head_dim": 4, "image_size": 16},
    "MistralBackbone": {**COMMON, **GQA},
    "Phi3Backbone": {**COMMON, **GQA},
    "Qwen3Backbone": {**COMMON, **GQA, "head_dim": 4},
    "OPTBackbone": {**COMMON, "num_heads": 4, "max_sequence_length": 2 * SEQ},
    # A rotary share of a quarter needs a head size of 8.
    "GPTNeoXBackbone": {
        **COMMON,
        "hidden_dim": 32,
        "num_heads": 4,
        "max_sequence_length": 2 * SEQ,
    },
    "FalconBackbone": {**COMMON, "num_attention_heads": 4},
    "QwenBackbone": {**COMMON, **GQA},
    "Qwen3MoeBackbone": {
        **COMMON,
        **GQA,
        "head_dim": 4,
        "moe_intermediate_dim": 8,
        "num_experts": 4,
        "top_k": 2,
    },
    "BloomBackbone": {**COMMON, "num_heads": 4},
}


def make_data(name):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, size=(STEPS, BATCH, SEQ + 1))
    tokens = tokens.astype("int32")
    padding_mask = np.ones((STEPS, BATCH, SEQ), dtype="int32")
    padding_mask[:, 1, SEQ - 2 :] = 0
    batches = []
    for step in range(STEPS):
        x = {
            "token_ids": tokens[step, :, :-1],
            "padding_mask": padding_mask[step],
        }
        if name == "BertBackbone":
            x["segment_ids"] = np.zeros((BATCH, SEQ), dtype="int32")
        batches.append((x, tokens[step, :, 1:]))
    return batches


def build_model(name):
    """The backbone, then logits from its reversed token embedding."""
    keras.utils.set_random_seed(SEED)
    backbone = getattr(keras_hub.models, name)(**CONFIGS[name])
    outputs = backbone.output
    if isinstance(outputs, dict):  # BERT: the sequence output.
        outputs = outputs["sequence_output"]
    logits = backbone.token_embedding(outputs, reverse=True)
    return keras.Model(backbone.input, logits), backbone


def build_distributed_model(key, mesh):
    """The model, laid out by the automatic plan (by the backbone's own
    `get_layout_map` for a `@hub` key), as a user writes it: abstract,
    planned, then created sharded when the scope ends."""
    name, _, hub = key.partition("@")
    with keras.StatelessScope():
        model, backbone = build_model(name)
        if hub:
            layout_map = type(backbone).get_layout_map(mesh)
        else:
            plan, report = kd.auto_tensor_parallel_plan(model, mesh)
            layout_map = kd.tensor_parallel_layouts(model, mesh, plan)
            record(f"{key}/report", report)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map)
        )
    record(f"{key}/expected_bytes", planned_bytes(model, layout_map, mesh))
    return model, backbone


def train(key, mesh=None):
    """Trains for `STEPS` steps; counts the collectives of the last one
    when distributed."""
    name = key.partition("@")[0]
    if mesh is None:
        model, backbone = build_model(name)
    else:
        model, backbone = build_distributed_model(key, mesh)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    losses, counts = [], None
    for step, (x, y) in enumerate(make_data(name)):
        if mesh is not None and step == STEPS - 1:
            with CollectiveCounter() as counter:
                losses.append(float(model.train_on_batch(x, y)))
            counts = counter.counts()
        else:
            losses.append(float(model.train_on_batch(x, y)))
    return model, backbone, losses, counts


def generate(name, backbone):
    """Greedy generation from two prompts of 3 and 5 tokens, by the
    backbone's `CausalLM` (under the distribution set now)."""
    task_class = getattr(keras_hub.models, name.replace("Backbone", "CausalLM"))
    task = task_class(backbone=backbone, preprocessor=None)
    task.compile(sampler="greedy")
    rng = np.random.default_rng(1)
    token_ids = np.zeros((2, GENERATE_LENGTH), "int32")
    padding_mask = np.zeros((2, GENERATE_LENGTH), "int32")
    for row, length in enumerate((3, 5)):
        token_ids[row, :length] = rng.integers(1, VOCAB, size=length)
        padding_mask[row, :length] = 1
    outputs = task.generate(
        {"token_ids": token_ids, "padding_mask": padding_mask},
        stop_token_ids=None,
    )
    return np.asarray(outputs["token_ids"]).tolist()


def planned_bytes(model, layout_map, mesh):
    """The bytes of one rank's parameters that the layout map allows."""
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    resolved = kd.check_layouts(model, layout_map)
    total = 0
    for variable in model.weights:
        count = int(np.prod(variable.shape))
        for entry in resolved[variable.path] or ():
            for axis in entry if isinstance(entry, tuple) else (entry,):
                if axis is not None:
                    count //= sizes[axis]
        total += count * np.dtype(variable.dtype).itemsize
    return total


def local_bytes(model):
    total = 0
    for variable in model.weights:
        value = variable.value
        local = value.to_local() if hasattr(value, "to_local") else value
        total += local.numel() * local.element_size()
    return total


def run(spec):
    """Trains (and with `+generate`, generates with) one model."""
    key, _, generating = spec.partition("+")
    name = key.partition("@")[0]
    keras.distribution.set_distribution(None)
    model, backbone, losses, _ = train(name)
    if generating:
        record(f"{key}/reference/generated", generate(name, backbone))
    record(f"{key}/reference/losses", losses)
    record(
        f"{key}/reference/final_weights",
        [w.tolist() for w in model.get_weights()],
    )
    record(f"{key}/reference/bytes", local_bytes(model))
    devices = keras.distribution.list_devices()
    # (1, 2) on 2 processes, (2, 2) on 4.
    rows = 1 if len(devices) <= 2 else 2
    mesh = keras.distribution.DeviceMesh(
        (rows, len(devices) // rows), ("batch", "model"), devices
    )
    start = time.perf_counter()
    model, backbone, losses, counts = train(key, mesh)
    if generating:
        record(f"{key}/generated", generate(name, backbone))
    record(f"{key}/seconds", time.perf_counter() - start)
    keras.distribution.set_distribution(None)
    record(f"{key}/losses", losses)
    record(f"{key}/final_weights", [w.tolist() for w in model.get_weights()])
    record(f"{key}/bytes", local_bytes(model))
    record(f"{key}/counts", counts)
    record(f"{key}/trained_locally", trained_locally(model))
    record(f"{key}/trained_locally_paths", trained_locally(model, "path"))


def trained_locally(model, by="class"):
    """The classes (or, `by="path"`, the paths) of the layers that trained
    on local shards without a batch-local plan (`training_local_calls`)."""
    from keras.src.backend.torch import training_local_calls

    return sorted(
        {
            type(layer).__name__ if by == "class" else str(layer.path)
            for layer in model._flatten_layers()
            if training_local_calls.runs_locally(layer)
        }
    )


def main():
    keras.distribution.initialize()
    for name in sys.argv[1:]:
        run(name)
    worker_utils.report()


if __name__ == "__main__":
    main()
