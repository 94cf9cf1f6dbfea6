"""The keras-hub `CausalLM` workflow, as the Gemma distributed tuning guide
writes it, with tiny configs and synthetic token ids.

Usage: keras_hub_workflow_worker.py RUN [RUN ...] (under torchrun), each
RUN being `MODEL:MESH:CHECKS`:
  MODEL: a key of `MODELS` (gemma, gemma_mqa, llama, llama3, qwen, qwen_moe,
    qwen3_moe, mistral, gpt2).
  MESH: `dp` (`DataParallel`), `RxC` (`ModelParallel` on an R x C
    ("batch", "model") mesh with the backbone's `get_layout_map`),
    `RxC+hand` (the same mesh with `HAND_WRITTEN`, a Megatron map), or
    `RxC+guide` (with `GEMMA_GUIDE`, the Gemma guide's own map) or
    `RxC+mqa` (`GEMMA_MQA`, the guide's map with key and value
    replicated, for a Gemma with one key/value head).
  CHECKS: `+`-separated, of:
    `tune`: LoRA enabled after the layout map, `fit` (AdamW, a weighted
      metric, the padding mask as sample weight), `evaluate`, `predict`;
    `save`: the tuned task saved (`.keras`, `.weights.h5`) and reloaded
      under the distribution, then in this process without one;
    `generate`: greedy `generate()` on a batch of two prompts of unequal
      length, on one prompt, and with a stop token;
    `jit`: the LoRA `fit` with `jit_compile=True`;
    `kv1`: a model with one key/value head on the mesh (the ValueError).

For each MODEL and set of checks, the process first runs them without a
distribution (the reference, `<MODEL>/reference/<CHECKS>/...`, where
CHECKS are those of `tune` and `generate` the RUN has), then each RUN
(`<RUN>/...`): the same numbers, and the layouts of the variables.
`generate` after `tune` generates with the tuned model.
"""

import os
import sys

import keras_hub
import numpy as np
import torch
import worker_utils
from worker_utils import record

import keras

VOCAB, SEQ, BATCH, STEPS = 256, 8, 4, 2
GENERATE_LENGTH = 12
COMMON = {
    "vocabulary_size": VOCAB,
    "num_layers": 2,
    "hidden_dim": 32,
    "intermediate_dim": 64,
}
ATTENTION = {"num_query_heads": 4, "num_key_value_heads": 2}
M = keras_hub.models
# name -> (backbone class, causal LM class, extra config).
MODELS = {
    "gemma": (M.GemmaBackbone, M.GemmaCausalLM, {**ATTENTION, "head_dim": 8}),
    # One key/value head (multi-query attention, as Gemma 2B has).
    "gemma_mqa": (
        M.GemmaBackbone,
        M.GemmaCausalLM,
        {**ATTENTION, "head_dim": 8, "num_key_value_heads": 1},
    ),
    "llama": (M.LlamaBackbone, M.LlamaCausalLM, ATTENTION),
    "llama3": (M.Llama3Backbone, M.Llama3CausalLM, ATTENTION),
    "qwen": (M.QwenBackbone, M.QwenCausalLM, ATTENTION),
    "qwen_moe": (
        M.QwenMoeBackbone,
        M.QwenMoeCausalLM,
        {
            **ATTENTION,
            "moe_intermediate_dim": 16,
            "shared_expert_intermediate_dim": 32,
            "num_experts": 4,
            "top_k": 2,
        },
    ),
    "qwen3_moe": (
        M.Qwen3MoeBackbone,
        M.Qwen3MoeCausalLM,
        {
            **ATTENTION,
            "moe_intermediate_dim": 16,
            "num_experts": 4,
            "top_k": 2,
            "head_dim": 8,
        },
    ),
    "mistral": (M.MistralBackbone, M.MistralCausalLM, ATTENTION),
    "gpt2": (
        M.GPT2Backbone,
        M.GPT2CausalLM,
        {"num_heads": 4, "max_sequence_length": 32, "dropout": 0.0},
    ),
}
# A Megatron layout map for the models without `get_layout_map`:
# attention split by heads, the MLP by columns then rows, the embedding
# by vocabulary.
HAND_WRITTEN = {
    ".*token_embedding/embeddings": ("model", None),
    ".*token_embedding/reverse_embeddings": (None, "model"),
    ".*self_attention/(query|key|value)/kernel": (None, "model", None),
    ".*self_attention/(query|key|value)/bias": ("model", None),
    ".*self_attention/attention_output/kernel": ("model", None, None),
    ".*feedforward_(intermediate|gate)_dense/kernel": (None, "model"),
    ".*feedforward_intermediate_dense/bias": ("model",),
    ".*feedforward_output_dense/kernel": ("model", None),
}
# The compiled run's config: the tiny Gemma (4 key/value heads,
# hidden 64, head size 16).
JIT_CONFIG = {
    "num_key_value_heads": 4,
    "hidden_dim": 64,
    "intermediate_dim": 128,
    "head_dim": 16,
}
# The `kv1` run's config: one key/value head (multi-query attention).
KV1_CONFIG = {"num_key_value_heads": 1}
# The configs of the runs whose reference is their own (`reference_key`).
OWN_CONFIGS = {"jit": JIT_CONFIG}
# The layout map of the "Distributed tuning with Gemma using Keras" guide
# (Gemma's layers split by heads and columns over "model" only).
GEMMA_GUIDE = {
    "token_embedding/embeddings": ("model", None),
    "decoder_block.*attention.*(query|key|value).kernel": (
        "model",
        None,
        None,
    ),
    "decoder_block.*attention_output.kernel": ("model", None, None),
    "decoder_block.*ffw_gating.kernel": (None, "model"),
    "decoder_block.*ffw_linear.kernel": ("model", None),
}
# The guide's map for a Gemma with one key/value head (as Gemma 2B has):
# the query heads split over "model", the key and value kernels (one
# head) replicated.
GEMMA_MQA = {
    **{k: v for k, v in GEMMA_GUIDE.items() if "query" not in k},
    "decoder_block.*attention.*query.kernel": ("model", None, None),
    "decoder_block.*attention.*(key|value).kernel": (None, None, None),
}
# The hand-written maps of `RxC+<name>` meshes.
HAND_MAPS = {"hand": HAND_WRITTEN, "guide": GEMMA_GUIDE, "mqa": GEMMA_MQA}
# A variable each model's layout splits, whose placements are reported.
SPLIT_KERNEL = {
    "gemma": "decoder_block_0/attention/query/kernel",
    "gemma_mqa": "decoder_block_0/attention/query/kernel",
}
DEFAULT_SPLIT_KERNEL = "transformer_layer_0/self_attention/query/kernel"


def data():
    """Token ids, next-token labels and a padding mask with padding."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, size=(BATCH * STEPS, SEQ + 1))
    tokens = tokens.astype("int32")
    padding_mask = np.ones((BATCH * STEPS, SEQ), dtype="int32")
    padding_mask[1, 5:] = 0
    padding_mask[6, 2:] = 0
    x = {"token_ids": tokens[:, :-1], "padding_mask": padding_mask}
    return x, tokens[:, 1:], padding_mask


def prompts(lengths):
    """A batch of prompts of `lengths` tokens, padded to the length that
    `generate` fills."""
    rng = np.random.default_rng(1)
    token_ids = np.zeros((len(lengths), GENERATE_LENGTH), "int32")
    padding_mask = np.zeros((len(lengths), GENERATE_LENGTH), "int32")
    for row, length in enumerate(lengths):
        token_ids[row, :length] = rng.integers(1, VOCAB, size=length)
        padding_mask[row, :length] = 1
    return {"token_ids": token_ids, "padding_mask": padding_mask}


def set_distribution(model, mesh):
    devices = keras.distribution.list_devices()
    if mesh == "dp":
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices)
        )
        return
    shape, _, hand = mesh.partition("+")
    device_mesh = keras.distribution.DeviceMesh(
        tuple(int(n) for n in shape.split("x")), ("batch", "model"), devices
    )
    if hand:
        layout_map = keras.distribution.LayoutMap(device_mesh)
        for key, axes in HAND_MAPS[hand].items():
            layout_map[key] = axes
    else:
        layout_map = MODELS[model][0].get_layout_map(device_mesh)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )


def build(model, jit_compile=False, **overrides):
    """The causal LM of `model`, seeded, with LoRA enabled (rank 4)."""
    backbone_class, task_class, extra = MODELS[model]
    keras.utils.set_random_seed(1337)
    backbone = backbone_class(**{**COMMON, **extra, **overrides})
    task = task_class(backbone=backbone, preprocessor=None)
    task.backbone.enable_lora(rank=4)
    task.compile(
        optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
        sampler="greedy",
        jit_compile=jit_compile,
    )
    return task


def numbers(value):
    return np.asarray(keras.ops.convert_to_numpy(value)).tolist()


def fit(task):
    """Fits one epoch of `data()`; returns the history and batch losses."""
    x, y, sample_weight = data()
    losses = worker_utils.BatchLosses()
    history = task.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[losses],
    )
    return history, losses.losses


def tune(task):
    """Fits, evaluates and predicts; records the numbers and the LoRA
    variables' movement."""
    x, y, sample_weight = data()
    frozen = {v.path: numbers(v) for v in task.non_trainable_weights}
    lora = {v.path: numbers(v) for v in task.trainable_weights}
    history, losses = fit(task)
    record("losses", losses)
    record("accuracy", history.history["sparse_categorical_accuracy"])
    record(
        "evaluate",
        task.evaluate(
            x, y, sample_weight=sample_weight, batch_size=BATCH, verbose=0
        ),
    )
    record("predict", task.predict(x, batch_size=BATCH, verbose=0))
    record("trainable_paths", sorted(lora))
    record(
        "trainable",
        {v.path: numbers(v) for v in task.trainable_weights},
    )
    record(
        "frozen_moved",
        max_difference(frozen, task.non_trainable_weights),
    )
    record("lora_moved", max_difference(lora, task.trainable_weights))
    if keras.distribution.distribution() is not None:
        record("tune/local_layers", local_layers(task, "training"))


def max_difference(before, variables):
    """The largest change of any of `variables` from `before`."""
    return max(
        float(np.max(np.abs(np.asarray(before[v.path]) - numbers(v))))
        for v in variables
    )


def record_generated(key, outputs):
    """Records `generate`'s token ids and padding mask."""
    for name in ("token_ids", "padding_mask"):
        record(f"{key}/{name}", np.asarray(outputs[name]).astype(int))


def generate(task, stop_token=None):
    """Greedy generation: two prompts, one prompt, then the two with a stop
    token (where None, the token generated third for the first prompt:
    generation stops there for that row). Returns the stop token.

    The reference and the distributed runs make the same calls in the
    same order, each on a new model (a random sampler, a model's default,
    would draw anew at each call).
    """
    two = prompts([3, 5])
    outputs = task.generate(two, stop_token_ids=None)
    record_generated("generate/two", outputs)
    if stop_token is None:
        stop_token = int(np.asarray(outputs["token_ids"])[0, 5])
    record("stop_token", stop_token)
    record_generated(
        "generate/one", task.generate(prompts([4]), stop_token_ids=None)
    )
    stopped = task.generate(two, stop_token_ids=[stop_token])
    record_generated("generate/stopped", stopped)
    if keras.distribution.distribution() is not None:
        record("generate/local_layers", local_layers(task, "inference"))
    return stop_token


def local_layers(task, path):
    """The classes of the layers that ran on local shards without a
    batch-local plan, without gradients (`path` "inference",
    `inference_local_calls`) or with them ("training",
    `training_local_calls`)."""
    from keras.src.backend.torch import inference_local_calls
    from keras.src.backend.torch import training_local_calls

    paths = {
        "inference": inference_local_calls,
        "training": training_local_calls,
    }
    return sorted(
        {
            type(layer).__name__
            for layer in task._flatten_layers()
            if paths[path].runs_locally(layer)
        }
    )


def save_and_reload(task, model, run_dir):
    """Saves the tuned task; reloads it under the distribution (the whole
    model, and its weights into a new one), then without one. Keras
    merges the LoRA factors into their kernels when it saves, so the
    reloaded models are compared by their outputs."""
    os.makedirs(run_dir, exist_ok=True)
    keras_path = os.path.join(run_dir, "tuned.keras")
    weights_path = os.path.join(run_dir, "tuned.weights.h5")
    task.save(keras_path)
    task.save_weights(weights_path)
    x, _, _ = data()
    reloaded = keras.saving.load_model(keras_path)
    reloaded.compile(sampler="greedy")
    record("save/model_split_kernel", split_kernel_placements(reloaded, model))
    record("save/model_predict", reloaded.predict(x, verbose=0))
    record_generated(
        "save/model_generate",
        reloaded.generate(prompts([3, 5]), stop_token_ids=None),
    )
    fresh = build(model)
    fresh.load_weights(weights_path)
    record("save/weights_predict", fresh.predict(x, verbose=0))
    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    single = keras.saving.load_model(keras_path)
    single.compile(sampler="greedy")
    record("save/single_predict", single.predict(x, verbose=0))
    record_generated(
        "save/single_generate",
        single.generate(prompts([3, 5]), stop_token_ids=None),
    )
    keras.distribution.set_distribution(distribution)


def split_kernel_placements(task, model):
    """The placements of the kernel that the layout splits."""
    path = SPLIT_KERNEL.get(model, DEFAULT_SPLIT_KERNEL)
    (variable,) = [v for v in task.weights if v.path == path]
    return [str(p) for p in variable.value.placements]


def placements_of(task, model):
    """The placements of a split kernel and of a LoRA variable."""
    variables = {v.path: v for v in task.weights}
    kernel = SPLIT_KERNEL.get(model, DEFAULT_SPLIT_KERNEL)
    lora = next(p for p in variables if p.endswith("lora_kernel_a"))
    return {
        path: [str(p) for p in variables[path].value.placements]
        for path in (kernel, lora)
    }


def one_key_value_head(model):
    """Builds a model with one key/value head, which the published map
    splits over the model axis; records the error."""
    worker_utils.record_error("kv1_error", lambda: build(model, **KV1_CONFIG))


def checks(task, model, names, stop_token, run_dir):
    if "tune" in names:
        tune(task)
    if "generate" in names:
        generate(task, stop_token)
    if "save" in names:
        save_and_reload(task, model, run_dir)
    if "count" in names:
        count_step(task)


def count_step(task):
    """Records the collectives of one more training step, by op, and the
    number of variables split over the batch axis (the mesh's first)."""
    sys.path.insert(
        0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    )
    from measure import CollectiveCounter

    x, y, sample_weight = data()
    batch = {key: value[:BATCH] for key, value in x.items()}
    with CollectiveCounter() as counter:
        task.train_on_batch(
            batch, y[:BATCH], sample_weight=sample_weight[:BATCH]
        )
    phases = counter.comm_module_counts["Global"]
    for phase in ("forward", "backward"):
        record(
            f"count/{phase}",
            {str(op).rsplit(".", 1)[-1]: n for op, n in phases[phase].items()},
        )
    record(
        "count/batch_split",
        sum(v.value.placements[0].is_shard() for v in task.weights),
    )


def reference(model, names):
    """The run without a distribution, recorded under
    `<MODEL>/reference/<CHECKS>` (of `tune` and `generate`); returns the
    stop token used."""
    keras.distribution.set_distribution(None)
    key = reference_key(names)
    task = build(model, **OWN_CONFIGS.get(key, {}))
    with worker_utils.prefixed(f"{model}/reference/{key}"):
        if "tune" in names or key in OWN_CONFIGS:
            tune(task)
        if "generate" in names:
            return generate(task)
    return None


def reference_key(names):
    """The checks of `names` that a reference runs, as its key (the `jit`
    run compares with an eager `tune` of its own config)."""
    for own in OWN_CONFIGS:
        if own in names:
            return own
    return "+".join(n for n in ("tune", "generate") if n in names) or "none"


def run(spec, stop_tokens, run_dir):
    model, mesh, checks_text = spec.split(":")
    names = checks_text.split("+")
    key = (model, reference_key(names))
    if key not in stop_tokens:
        stop_tokens[key] = reference(model, names)
    set_distribution(model, mesh)
    with worker_utils.prefixed(spec):
        if "kv1" in names:
            one_key_value_head(model)
            return
        if "jit" in names:
            task = build(model, jit_compile=True, **JIT_CONFIG)
        else:
            task = build(model)
        record("placements", placements_of(task, model))
        if "jit" in names:
            stats = torch._dynamo.utils.counters["stats"]
            graphs = stats["unique_graphs"]
            record("jit/losses", fit(task)[1])
            record("jit/graphs", stats["unique_graphs"] - graphs)
            return
        run_dir = os.path.join(run_dir, spec.replace(":", "_"))
        checks(task, model, names, stop_tokens[key], run_dir)


def main():
    keras.distribution.initialize()
    run_dir = os.path.join(os.environ["KERAS_DTENSOR_TEST_RESULT_DIR"], "files")
    stop_tokens = {}
    for spec in sys.argv[1:]:
        run(spec, stop_tokens, run_dir)
        keras.distribution.set_distribution(None)
    worker_utils.report()


if __name__ == "__main__":
    main()
