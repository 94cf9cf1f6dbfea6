"""keras-hub models train under the automatic tensor-parallel plan.

One launch of `workers/automatic_plans_worker.py` on 2 gloo processes
trains tiny keras-hub models (the backbone, then logits from its
reversed token embedding) for 3 steps without a distribution, then on a
(1, 2) ("batch", "model") mesh laid out only by
`auto_tensor_parallel_layouts`. Losses and final weights must equal the
single-process run on every rank; each rank holds the parameter bytes
the plan allows (half of every split variable); and the third step
issues Megatron's minimum of collectives: per block, two all-reduces
forward (after the attention and MLP row-parallel projections) and two
backward (the inputs' gradients of the column-parallel ones), plus the
vocabulary-split embedding's all-reduce forward, the three small
all-reduces of the cross-entropy of the vocabulary-split logits forward
(never gathered), and the head's input gradient's all-reduce backward. Llama 3
then generates greedily, as without a distribution.

CI trains Llama 3 (grouped-query attention, gated MLP, untied head),
GPT-2 (multi-head attention, biases) and BERT (an encoder): 45 to 65 s
on a loaded 2-core machine. Gemma adds 20 to 40 s there, the mixtures of
experts (`MixtralBackbone`, `QwenMoeBackbone`) about 40 s each (DTensor's
sharding propagation of their einsums); they and the other keras-hub
backbones the worker knows run where `KERAS_DTENSOR_AUTO_PLAN_MODELS`
names them (a comma-separated list of backbone classes, replacing the
default); docs/layout_helpers.md has the results of all 14.

A second launch, on 4 processes, trains Llama 3 on a (2, 2) mesh the
same way (53 to 78 s at a load average of 14 on 2 cores): there the
data-parallel gradient bucket adds one collective backward, which also
reduces the token embedding's gradient over the batch axis.
"""

import os

import harness
import numpy as np
import pytest

harness.require("keras_hub")

NPROCS = 2
DEFAULT_MODELS = "Llama3Backbone,GPT2Backbone,BertBackbone"
MODELS_ENV_VAR = "KERAS_DTENSOR_AUTO_PLAN_MODELS"
MODELS = os.environ.get(MODELS_ENV_VAR, DEFAULT_MODELS).split(",")
# These also generate (greedy, from the trained backbone's CausalLM).
GENERATING = ("Llama3Backbone",)
NUM_LAYERS = 2
# The worker's mixtures of experts: their feed-forward blocks are
# expert-parallel, not a column/row pair.
MIXTURES = ("MixtralBackbone", "QwenMoeBackbone", "Qwen3MoeBackbone")
QUERY_KEY_NORMS = ("Gemma3Backbone", "Qwen3Backbone")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return harness.launch(
        "automatic_plans_worker.py",
        NPROCS,
        tmp_path_factory.mktemp("automatic_plans"),
        args=[f"{m}+generate" if m in GENERATING else m for m in MODELS],
        timeout=400,
    )


# The (2, 2) launch: one model on 4 processes.
MESH_2X2_MODEL = "Llama3Backbone"


@pytest.fixture(scope="module")
def reports_2x2(tmp_path_factory):
    return harness.launch(
        "automatic_plans_worker.py",
        4,
        tmp_path_factory.mktemp("automatic_plans_2x2"),
        args=[MESH_2X2_MODEL],
        timeout=400,
    )


@pytest.mark.parametrize("model", MODELS)
def test_training_equals_no_distribution(reports, model):
    check_training(reports, model)


def test_training_on_2x2_equals_no_distribution(reports_2x2):
    check_training(reports_2x2, MESH_2X2_MODEL, rtol=1e-6)


def test_collectives_on_2x2(reports_2x2):
    for report in reports_2x2:
        assert (
            report[f"{MESH_2X2_MODEL}/bytes"]
            == (report[f"{MESH_2X2_MODEL}/expected_bytes"])
        )
        counts = report[f"{MESH_2X2_MODEL}/counts"]
        assert counts["forward"] == 2 * NUM_LAYERS + 4, counts
        # Megatron's minimum and the data-parallel gradient bucket, which
        # also reduces the token embedding's gradient over the batch axis
        # (as measured in docs/layout_helpers.md).
        assert counts["backward"] == 2 * NUM_LAYERS + 2, counts
        assert counts["ops"] == {
            "all_reduce": 4 * NUM_LAYERS + 5,
            "allreduce_": 1,
        }


def check_training(reports, model, rtol=1e-5):
    for rank, report in enumerate(reports):
        np.testing.assert_allclose(
            report[f"{model}/losses"],
            report[f"{model}/reference/losses"],
            rtol=rtol,
            err_msg=f"rank{rank}",
        )
        final = report[f"{model}/final_weights"]
        reference = report[f"{model}/reference/final_weights"]
        assert len(final) == len(reference)
        for a, b in zip(final, reference):
            np.testing.assert_allclose(
                np.asarray(a), np.asarray(b), atol=1e-5, err_msg=f"rank{rank}"
            )


@pytest.mark.parametrize("model", MODELS)
def test_parameters_per_rank_at_the_plans_limit(reports, model):
    for report in reports:
        assert report[f"{model}/bytes"] == report[f"{model}/expected_bytes"]
        # The plan split most of the model.
        assert (
            report[f"{model}/bytes"] < 0.7 * report[f"{model}/reference/bytes"]
        )


@pytest.mark.parametrize("model", MODELS)
def test_report_splits_every_block(reports, model):
    report = reports[0][f"{model}/report"]
    assert report == reports[1][f"{model}/report"]
    styles = [line.split(": ", 1)[1].split(",")[0] for line in report]
    # Attention's output, and the MLP's or Qwen-MoE's shared expert's.
    per_block = 1 if model in MIXTURES and model != "QwenMoeBackbone" else 2
    expected_rows = NUM_LAYERS * per_block
    assert styles.count("row") == expected_rows
    assert styles.count("vocabulary") == 1
    if model in MIXTURES:
        assert styles.count("experts") == NUM_LAYERS


@pytest.mark.parametrize("model", [m for m in MODELS if m not in MIXTURES])
def test_collectives_at_megatrons_minimum(reports, model):
    # Replicated query/key norm scales act on head-split activations, so
    # their gradients are partial: one gradient bucket reduces them (as
    # Megatron all-reduces such gradients over its tensor-parallel group).
    buckets = 1 if model in QUERY_KEY_NORMS else 0
    for report in reports:
        counts = report[f"{model}/counts"]
        assert counts["forward"] == 2 * NUM_LAYERS + 4, counts
        assert counts["backward"] == 2 * NUM_LAYERS + 1 + buckets, counts
        expected = {"all_reduce": 4 * NUM_LAYERS + 5}
        if buckets:
            expected["allreduce_"] = buckets
        assert counts["ops"] == expected


@pytest.mark.parametrize("model", [m for m in MODELS if m in GENERATING])
def test_generation_equals_no_distribution(reports, model):
    for report in reports:
        generated = np.asarray(report[f"{model}/generated"])
        np.testing.assert_array_equal(
            generated, report[f"{model}/reference/generated"]
        )
        # Two prompts of 3 and 5 tokens, extended to the full length.
        assert generated.shape == (2, 10)


def test_llama3_split_layers_train_on_local_shards(reports):
    # Under the plan, Llama 3's projections, its attention layers and its
    # MLP's output projection (a `Dense` split along its input, whose
    # output layout sums its partial sums: a layer end its local runs
    # replay) train on local shards (`training_local_calls`).
    if "Llama3Backbone" not in MODELS:
        pytest.skip("Llama3Backbone is not among the models run")
    for report in reports:
        local = report["Llama3Backbone/trained_locally"]
        assert {"EinsumDense", "Dense"} <= set(local), local
        assert any("Attention" in name for name in local), local


def test_row_parallel_layers_with_biases_train_on_local_shards(reports):
    # GPT-2's attention output and MLP output projections are split along
    # their input and add a replicated bias to their partial sums: a
    # local run adds its share of the bias (divided by the processes, as
    # DTensor partitions it), and trains locally.
    if "GPT2Backbone" not in MODELS:
        pytest.skip("GPT2Backbone is not among the models run")
    for report in reports:
        paths = report["GPT2Backbone/trained_locally_paths"]
        assert any(path.endswith("attention_output") for path in paths), paths
        assert any("output_dense" in path for path in paths), paths
