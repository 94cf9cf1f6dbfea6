"""keras-hub backbones train under a distribution with their own layouts.

`workers/keras_hub_worker.py` trains tiny `GemmaBackbone` and
`LlamaBackbone` causal language models for 3 steps, exactly as a user
would write it, without a distribution and then under it:
- 2 processes: `ModelParallel` on a (1, 2) ("batch", "model") mesh laid
  out by the backbone's published `get_layout_map` (SGD with momentum;
  llama), and `DataParallel` (AdamW; both);
- 4 processes: the published layouts on a (2, 2) mesh (SGD with momentum;
  both).
The published layouts shard contracting dimensions (the query, key and
value kernels on the hidden dimension, so their outputs are partial
sums), 3-D einsum kernels, and the token embedding on the vocabulary.
Losses and weights must match the single-process run on every rank.
"""

import harness
import numpy as np
import pytest

harness.require("keras_hub")

MODELS = ("gemma", "llama")
# A run names its backbone where it trains one (`MESH:OPTIMIZER:MODEL`).
# On the (1, 2) mesh llama alone: its first steps spend most of their
# time in DTensor's sharding propagation (torch 2.13 plans the costs of
# every `bmm` candidate whose inputs hold a `_StridedShard` with its
# graph search, ~0.7 s each), and gemma's, twice llama's, would add
# half a minute; gemma's layout is checked on the (2, 2) mesh.
RUNS = {2: ["1x2:sgd:llama", "dp:adamw"], 4: ["2x2:sgd"]}


def models_of(run):
    """The backbones `run` trains."""
    named = run.split(":")[2:]
    return tuple(named) or MODELS


CASES = [
    (run, model)
    for runs in RUNS.values()
    for run in runs
    for model in models_of(run)
]
SHARDED_RUNS = ["1x2:sgd:llama", "2x2:sgd"]
SHARDED_CASES = [(run, model) for run, model in CASES if run in SHARDED_RUNS]
# The published layouts (keras-hub 0.32.0) of the variables the worker
# reports, as mesh axis names per tensor dimension.
PUBLISHED_LAYOUTS = {
    "gemma": {
        "token_embedding/embeddings": ("model", "batch"),
        "decoder_block_0/attention/query/kernel": ("model", "batch", None),
        "decoder_block_0/attention/key/kernel": ("model", "batch", None),
        "decoder_block_0/attention/attention_output/kernel": (
            "model",
            None,
            "batch",
        ),
        "decoder_block_0/ffw_gating/kernel": ("batch", "model"),
        "decoder_block_0/ffw_linear/kernel": ("model", "batch"),
    },
    "llama": {
        "token_embedding/embeddings": ("model", "batch"),
        "transformer_layer_0/self_attention/query/kernel": (
            "model",
            "batch",
            None,
        ),
        "transformer_layer_0/self_attention/key/kernel": (
            "model",
            "batch",
            None,
        ),
        "transformer_layer_0/self_attention/attention_output/kernel": (
            "model",
            None,
            "batch",
        ),
        "transformer_layer_0/feedforward_intermediate_dense/kernel": (
            "batch",
            "model",
        ),
        "transformer_layer_0/feedforward_output_dense/kernel": (
            "model",
            "batch",
        ),
    },
}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """One launch per process count; each report covers all its runs."""
    return {
        nprocs: harness.launch(
            "keras_hub_worker.py",
            nprocs,
            tmp_path_factory.mktemp(f"keras_hub_{nprocs}"),
            args=runs,
            timeout=600,
        )
        for nprocs, runs in RUNS.items()
    }


def reports_of(launches, run):
    (nprocs,) = [n for n, runs in RUNS.items() if run in runs]
    return launches[nprocs]


def mesh_axes(run):
    rows, columns = (int(n) for n in run.split(":")[0].split("x"))
    return {"batch": rows, "model": columns}


def arrays(report, key):
    return [np.asarray(w, dtype="float32") for w in report[key]]


@pytest.mark.parametrize("run,model", CASES)
def test_initial_weights_equal_single_process(launches, run, model):
    for rank, report in enumerate(reports_of(launches, run)):
        paths = report[f"{run}/{model}/paths"]
        assert paths == report[f"{run}/reference/{model}/paths"]
        reference = arrays(report, f"{run}/reference/{model}/initial_weights")
        initial = arrays(report, f"{run}/{model}/initial_weights")
        assert len(initial) == len(reference)
        for path, a, b in zip(paths, initial, reference):
            np.testing.assert_array_equal(a, b, err_msg=f"rank{rank} {path}")


@pytest.mark.parametrize("run,model", CASES)
def test_losses_match_single_process(launches, run, model):
    for rank, report in enumerate(reports_of(launches, run)):
        reference = np.asarray(report[f"{run}/reference/{model}/losses"])
        losses = np.asarray(report[f"{run}/{model}/losses"])
        assert reference.shape == (3,)
        np.testing.assert_allclose(
            losses, reference, rtol=1e-5, atol=0, err_msg=f"rank{rank}"
        )


@pytest.mark.parametrize("run,model", CASES)
def test_final_weights_match_single_process(launches, run, model):
    for rank, report in enumerate(reports_of(launches, run)):
        reference = arrays(report, f"{run}/reference/{model}/final_weights")
        final = arrays(report, f"{run}/{model}/final_weights")
        initial = arrays(report, f"{run}/reference/{model}/initial_weights")
        assert len(final) == len(reference)
        paths = report[f"{run}/{model}/paths"]
        for path, a, b in zip(paths, final, reference):
            np.testing.assert_allclose(
                a, b, rtol=0, atol=1e-5, err_msg=f"rank{rank} {path}"
            )
        moved = max(np.abs(f - i).max() for f, i in zip(final, initial))
        assert moved > 1e-3


def expected_placements(axes, mesh):
    """Per mesh axis, the accepted placements for a layout's axes.

    A mesh axis of size 1 shards nothing, so `Replicate` is accepted there
    as well as `Shard`.
    """
    accepted = []
    for axis_name, size in mesh.items():
        if axis_name in axes:
            shard = f"S({axes.index(axis_name)})"
            accepted.append({shard} if size > 1 else {shard, "R"})
        else:
            accepted.append({"R"})
    return accepted


@pytest.mark.parametrize("run,model", SHARDED_CASES)
def test_sharded_variable_placements_and_local_shapes(launches, run, model):
    mesh = mesh_axes(run)
    for rank, report in enumerate(reports_of(launches, run)):
        paths = report[f"{run}/reference/{model}/paths"]
        weights = arrays(report, f"{run}/reference/{model}/initial_weights")
        shapes = {path: w.shape for path, w in zip(paths, weights)}
        for path, axes in PUBLISHED_LAYOUTS[model].items():
            placements = report[f"{run}/{model}/placements/{path}"]
            for placement, accepted in zip(
                placements, expected_placements(axes, mesh), strict=True
            ):
                assert placement in accepted, (rank, path, placements)
            expected_local = [
                size // mesh[axis] if axis else size
                for size, axis in zip(shapes[path], axes)
            ]
            local_shape = report[f"{run}/{model}/local_shape/{path}"]
            assert local_shape == expected_local, (rank, path)


@pytest.mark.parametrize("run", ["dp:adamw"])
@pytest.mark.parametrize("model", MODELS)
def test_data_parallel_replicates_every_variable(launches, run, model):
    for report in reports_of(launches, run):
        paths = report[f"{run}/reference/{model}/paths"]
        weights = arrays(report, f"{run}/reference/{model}/initial_weights")
        shapes = {path: list(w.shape) for path, w in zip(paths, weights)}
        for path in PUBLISHED_LAYOUTS[model]:
            assert report[f"{run}/{model}/placements/{path}"] == ["R"]
            local_shape = report[f"{run}/{model}/local_shape/{path}"]
            assert local_shape == shapes[path]


CONTRACTED_KERNELS = [
    ("gemma", "decoder_block_0/attention/attention_output/kernel"),
    ("gemma", "decoder_block_0/ffw_linear/kernel"),
    ("llama", "transformer_layer_0/self_attention/query/kernel"),
    ("llama", "transformer_layer_0/self_attention/attention_output/kernel"),
    ("llama", "transformer_layer_0/feedforward_output_dense/kernel"),
]


@pytest.mark.parametrize(
    "run,model,path",
    [
        (run, model, path)
        for run in SHARDED_RUNS
        for model, path in CONTRACTED_KERNELS
        if model in models_of(run)
    ],
)
def test_contracting_dimension_is_split_on_model_axis(
    launches, run, model, path
):
    # Dimension 0 of these kernels is contracted in their einsum (hidden,
    # heads or intermediate), so each process computes a partial sum.
    for report in reports_of(launches, run):
        paths = report[f"{run}/reference/{model}/paths"]
        full_shape = np.shape(
            report[f"{run}/reference/{model}/initial_weights"][
                paths.index(path)
            ]
        )
        assert report[f"{run}/{model}/placements/{path}"][1] == "S(0)"
        local_shape = report[f"{run}/{model}/local_shape/{path}"]
        assert local_shape[0] == full_shape[0] // 2


def test_llama_projections_train_on_local_shards(launches):
    """Under Llama's published map its query, key and value kernels are
    split along the contracted hidden size and its output projection's
    along the contracted heads: each trains on local shards (the input
    cut to the kernel's shard, the partial sum all-reduced where the
    layer ends), and the weights above match one process."""
    run = "1x2:sgd:llama"
    block = "transformer_layer_0/self_attention"
    expected = {
        f"{block}/{name}"
        for name in ("query", "key", "value", "attention_output")
    }
    for report in reports_of(launches, run):
        assert expected <= set(report[f"{run}/llama/local_layers"])
