"""keras-hub's `CausalLM` workflow under a distribution equals one process.

The workflow of the "Distributed tuning with Gemma using Keras" guide,
with tiny configs and synthetic token ids (`workers/
keras_hub_workflow_worker.py`): the task laid out by the backbone's
`get_layout_map` (or a hand-written Megatron map, or DataParallel), LoRA
enabled after the layout map, `fit` with a weighted metric and the
padding mask as sample weight, `evaluate`, `predict`, saving and
reloading (`.keras`, `.weights.h5`, under the distribution and in one
process without it), and greedy `generate()` (two prompts of unequal
length, one prompt, a stop token; Gemma's head-split projections and
rotary embedding run on local shards in it). Every number is checked
against the same workflow run without a distribution, by the same
process:
- 2 processes: Gemma on (1, 2), (2, 1) and DataParallel (the whole
  workflow), and under the guide's own layout map on (1, 2) and (2, 1);
  Llama on (1, 2) and (2, 1); Qwen, Qwen-MoE and Qwen3-MoE on (1, 2) and
  (2, 1) (generation; Qwen-MoE's LoRA `fit` too on (2, 1), its router's
  auxiliary loss a partial mean over the split batch); Llama3, Mistral
  and GPT-2 under DataParallel and a hand-written map on (1, 2)
  (generation); a Gemma with one key/value
  head (Gemma 2B's multi-query attention) under the guide's map with key
  and value replicated on (1, 2) and (2, 1), and under DataParallel; and
  the same Gemma under its published map on (1, 2), which splits the one
  key/value head and gets a clear error;
- 4 processes: Gemma and Llama on (2, 2), with the collectives of one
  more Gemma training step counted;
- 2 processes, compiled: Gemma's LoRA `fit` with `jit_compile=True`
  on (1, 2), with its own layout map.
"""

import harness
import numpy as np
import pytest

harness.require("keras_hub")
harness.require("grain")

LOSS_RTOL = 1e-5
VALUE_ATOL = 1e-5
WORKFLOW = "tune+generate+save"
LAUNCHES = {
    "two": (
        2,
        [
            f"gemma:1x2:{WORKFLOW}",
            f"gemma:2x1:{WORKFLOW}",
            f"gemma:dp:{WORKFLOW}",
            "gemma:1x2:kv1",
            "gemma:1x2+guide:tune+generate",
            "gemma:2x1+guide:generate",
            f"gemma_mqa:1x2+mqa:{WORKFLOW}",
            "gemma_mqa:2x1+mqa:tune+generate",
            "gemma_mqa:dp:tune+generate",
            "llama:1x2:tune+generate",
            "llama:2x1:generate",
            "qwen:1x2:generate",
            "qwen:2x1:generate",
            "qwen_moe:1x2:generate",
            "qwen_moe:2x1:tune+generate",
            "qwen3_moe:1x2:generate",
            "qwen3_moe:2x1:generate",
            "llama3:dp:generate",
            "llama3:1x2+hand:generate",
            "mistral:dp:generate",
            "mistral:1x2+hand:generate",
            "gpt2:dp:generate",
            "gpt2:1x2+hand:generate",
        ],
    ),
    "four": (
        4,
        ["gemma:2x2:tune+generate+count", "llama:2x2:generate"],
    ),
    "compiled": (2, ["gemma:1x2:jit"]),
}
RUNS = [run for _, runs in LAUNCHES.values() for run in runs]


def runs_with(check):
    return [run for run in RUNS if check in run.split(":")[2].split("+")]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    reports = {}
    for name, (nprocs, runs) in LAUNCHES.items():
        # torch's DETAIL check runs a real collective that torch.compile
        # refuses to trace (see jit_compile_test); the compiled launch
        # runs without it.
        env = {"TORCH_DISTRIBUTED_DEBUG": "OFF"} if name == "compiled" else {}
        reports[name] = harness.launch(
            "keras_hub_workflow_worker.py",
            nprocs,
            tmp_path_factory.mktemp(f"keras_hub_workflow_{name}"),
            args=runs,
            timeout=900,
            env=env,
        )
    return reports


def reports_of(launches, run):
    (name,) = [n for n, (_, runs) in LAUNCHES.items() if run in runs]
    return launches[name]


def reference_key(run):
    """The reference a run is checked against (as the worker keys it)."""
    names = run.split(":")[2].split("+")
    if "jit" in names:
        return "jit"
    return "+".join(n for n in ("tune", "generate") if n in names) or "none"


def values(launches, run):
    """Per rank, (the run's values, its reference's values)."""
    model = run.split(":")[0]
    reference = f"{model}/reference/{reference_key(run)}"
    return [
        (harness.run_values(report, run), harness.run_values(report, reference))
        for report in reports_of(launches, run)
    ]


@pytest.mark.parametrize("run", runs_with("tune"))
def test_lora_fit_evaluate_predict_equal_one_process(launches, run):
    for rank, (got, ref) in enumerate(values(launches, run)):
        assert len(ref["losses"]) == 2
        np.testing.assert_allclose(
            got["losses"], ref["losses"], rtol=LOSS_RTOL, err_msg=f"{rank}"
        )
        np.testing.assert_allclose(got["accuracy"], ref["accuracy"], atol=1e-6)
        np.testing.assert_allclose(
            got["evaluate"], ref["evaluate"], rtol=LOSS_RTOL
        )
        np.testing.assert_allclose(
            got["predict"], ref["predict"], atol=VALUE_ATOL
        )
        assert np.shape(got["predict"]) == (8, 8, 256)


@pytest.mark.parametrize("run", runs_with("tune"))
def test_lora_trains_only_lora_variables(launches, run):
    for got, ref in values(launches, run):
        paths = got["trainable_paths"]
        assert paths == ref["trainable_paths"]
        # Keras's LoRA freezes kernels; biases (Qwen's query, key and
        # value) stay trainable, as without a distribution.
        assert paths and all(
            "lora_kernel" in path or path.endswith("/bias") for path in paths
        )
        assert any("lora_kernel" in path for path in paths)
        for path in paths:
            np.testing.assert_allclose(
                got["trainable"][path],
                ref["trainable"][path],
                atol=VALUE_ATOL,
                err_msg=path,
            )
        assert got["frozen_moved"] == 0.0
        assert got["lora_moved"] > 1e-3


@pytest.mark.parametrize("run", runs_with("generate"))
def test_greedy_generation_equals_one_process(launches, run):
    for rank, (got, ref) in enumerate(values(launches, run)):
        assert got["stop_token"] == ref["stop_token"]
        for case in ("two", "one", "stopped"):
            for name in ("token_ids", "padding_mask"):
                key = f"generate/{case}/{name}"
                assert got[key] == ref[key], (rank, key)
        # The prompts keep their tokens, and generation fills the rest.
        two = np.asarray(ref["generate/two/token_ids"])
        assert two.shape == (2, 12) and (two[:, 5:] > 0).all()


def test_tensor_parallel_layers_generate_on_local_shards(launches):
    # Gemma's projections and rotary embedding, split by heads, reproduce
    # their DTensor calls on local shards (`inference_local_calls`); so do
    # its attention layers (which reshape by whole head counts, and add
    # the product of their replicated LoRA factors to split kernels) and
    # its decoder blocks (whose attention and MLP outputs are all-reduced
    # where they end), replaying their first calls (`local_replays`).
    for got, _ in values(launches, f"gemma:1x2:{WORKFLOW}"):
        assert {
            "EinsumDense",
            "RotaryEmbedding",
            "CachedGemmaAttention",
            "GemmaDecoderBlock",
        } <= set(got["generate/local_layers"])


def test_tensor_parallel_layers_train_on_local_shards(launches):
    # Gemma's projections (those with LoRA factors too), MLP and rotary
    # embedding, split by heads, and its attention layers (whose output
    # projection ends in an all-reduce) reproduce their DTensor calls and
    # gradients on local shards (`training_local_calls`); the LoRA `fit`
    # above equals one process's.
    for got, _ in values(launches, f"gemma:1x2:{WORKFLOW}"):
        assert {
            "EinsumDense",
            "RotaryEmbedding",
            "CachedGemmaAttention",
        } <= set(got["tune/local_layers"])


@pytest.mark.parametrize("run", runs_with("generate"))
def test_stop_token_ends_generation(launches, run):
    for got, ref in values(launches, run):
        tokens = np.asarray(ref["generate/two/token_ids"])[0]
        # The first prompt (3 tokens) keeps what it generated up to the
        # first stop token, and nothing after it.
        (stops,) = np.nonzero(tokens[3:] == got["stop_token"])
        last = 3 + stops[0]
        mask = np.asarray(got["generate/stopped/padding_mask"])
        assert mask[0, : last + 1].all() and not mask[0, last + 1 :].any()
        assert mask.tolist() == ref["generate/stopped/padding_mask"]


@pytest.mark.parametrize("run", runs_with("save"))
def test_saved_task_reloads_exactly(launches, run):
    for rank, (got, ref) in enumerate(values(launches, run)):
        for key in ("model_predict", "weights_predict", "single_predict"):
            np.testing.assert_allclose(
                got[f"save/{key}"],
                got["predict"],
                atol=VALUE_ATOL,
                err_msg=f"{rank} {key}",
            )
        for key in ("model_generate", "single_generate"):
            assert (
                got[f"save/{key}/token_ids"] == ref["generate/two/token_ids"]
            ), (rank, key)
        kernel = next(iter(got["placements"]))
        assert got["save/model_split_kernel"] == got["placements"][kernel]


def mesh_of(run):
    mesh = run.split(":")[1]
    if mesh == "dp":
        return None
    rows, columns = mesh.split("+")[0].split("x")
    return int(rows), int(columns)


@pytest.mark.parametrize("run", [r for r in RUNS if "kv1" not in r])
def test_layouts_split_the_kernel_and_replicate_lora(launches, run):
    for got, _ in values(launches, run):
        kernel, lora = got["placements"].values()
        mesh = mesh_of(run)
        if mesh is None:
            assert kernel == ["R"] and lora == ["R"]
            continue
        assert lora == ["R", "R"]
        # The model axis splits the query kernel (its heads, or for
        # keras-hub's maps the contracting hidden dimension); an axis of
        # one process holds the whole kernel: replicated.
        assert kernel[1].startswith("S(") == (mesh[1] > 1), kernel
        if mesh[0] > 1 and "+" not in run:
            assert kernel[0].startswith("S("), kernel


def test_one_key_value_head_on_two_model_processes_is_refused(launches):
    for got, _ in values(launches, "gemma:1x2:kv1"):
        message = got["kv1_error"]
        assert message.startswith("ValueError")
        for part in (
            "decoder_block_0/attention/key/kernel",
            "(1, 32, 8)",
            "'model'",
            "not divisible by 2",
        ):
            assert part in message, (part, message)


def test_compiled_lora_fit_equals_eager_one_process(launches):
    for got, ref in values(launches, "gemma:1x2:jit"):
        assert got["jit/graphs"] > 0
        np.testing.assert_allclose(
            got["jit/losses"], ref["losses"], rtol=LOSS_RTOL
        )


def test_two_dimensional_mesh_gathers_each_kernel_once(launches):
    """On (2, 2), Gemma's map splits each kernel over "batch" (its hidden
    size) and "model": a call on DTensors reads it gathered over "batch"
    once, as FSDP's unit does, and the model axis stays tensor-parallel
    (`batch_local._call_on_dtensors`). Forward: one all-gather per such
    variable, plus at most two that gather no kernel (the token ids of
    the vocabulary-split lookup among them); DTensor's own operators
    moved activations instead (over a hundred all-gathers a step at the
    `mid` size)."""
    run = "gemma:2x2:tune+generate+count"
    for report in reports_of(launches, run):
        got = harness.run_values(report, run)
        split = got["count/batch_split"]
        assert split == 15  # The embedding and 7 kernels per block.
        gathers = got["count/forward"]["all_gather_into_tensor"]
        assert split <= gathers <= split + 2, got["count/forward"]
