"""Training under a distribution gives single-device numbers.

Each case trains with `workers/training_worker.py` on 2 or 4 gloo
processes and without any distribution (the references, which each
process of the 2-process launch trains by itself first), from the same
initial weights, with `shuffle=False` unless stated (sharded variables
created shard by shard, bit for bit as one process creates them whole).
Per-step losses must agree within 1e-5 relative, final weights within 1e-5
absolute, and every logged value, `evaluate` result and `predict` output
must be identical on all ranks and equal to the single-process values.
"""

import os

import harness
import numpy as np
import pytest

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5

# Runs `MODE:MODEL:OPTIMIZER[:EXTRA]` by number of processes; every run is
# compared with the same run without a distribution (`single`).
RUNS = {
    2: [
        "dp:mlp:sgd:uneven,dict",
        "dp:mlp:adamw:pydataset",
        "dp:mlp:sgd:dataloader",
        "dp:mlp:adamw:dropout",
        "dp:mlp:sgd:local",
        "mp:transformer:sgd:uneven",
        "mp:transformer:adamw",
        "dp:recurrent:adamw",
        "mp:recurrent:sgd",
        "dp:cnn:adamw",
        "mp:cnn:sgd",
        "dp:audio:adamw",
        "mp:audio:sgd",
    ],
    4: ["2d:transformer:sgd:uneven"],
}
SHUFFLED = "dp:mlp:sgd:shuffle"
# The reference of `mp:transformer:adamw` trained again with the rows of
# every batch reversed, and with their two halves swapped: the same
# training on one process, summed in two other orders, which bound the
# ill-conditioned weights (see `ill_conditioned`).
REORDERED = (
    "single:transformer:adamw:reversed",
    "single:transformer:adamw:rolled",
)

# The exactness table (docs/user_guide.md, "Exactness", says how to print
# it): its rows, by run and number of processes.
DESCRIPTIONS = {
    "dp:mlp:sgd:uneven,dict": "DataParallel, 2 processes, MLP, SGD, "
    "arrays with an uneven last batch, as a dict",
    "dp:mlp:adamw:pydataset": "DataParallel, 2 processes, MLP, AdamW, "
    "`PyDataset`",
    "dp:mlp:sgd:dataloader": "DataParallel, 2 processes, MLP, SGD, "
    "torch `DataLoader`",
    "dp:mlp:adamw:dropout": "DataParallel, 2 processes, MLP, AdamW, `Dropout`",
    "dp:mlp:sgd:local": "DataParallel, 2 processes, MLP, SGD, "
    "`auto_shard_dataset=False` (each process passes its half of every "
    "batch)",
    "mp:transformer:sgd:uneven": "ModelParallel (1, 2), 2-block "
    "transformer, SGD, an uneven last batch",
    "mp:transformer:adamw": "ModelParallel (1, 2), 2-block transformer, AdamW",
    "dp:audio:adamw": "DataParallel, 2 processes, `Normalization` with "
    "given statistics, a dense layer, then `MelSpectrogram` and "
    "`ops.extract_sequences`, AdamW",
    "mp:audio:sgd": "ModelParallel (1, 2), the same audio model, its dense "
    "kernels split over columns (a cumulative sum along one), SGD",
    "2d:transformer:sgd:uneven": "2-D (2, 2), 4 processes, 2-block "
    "transformer, SGD, an uneven last batch",
    "dp:recurrent:adamw": "DataParallel, 2 processes, masked `LSTM`, "
    "`SimpleRNN` and `GRU`, AdamW",
    "mp:recurrent:sgd": "ModelParallel (1, 2), masked `LSTM`, `SimpleRNN` "
    "and `GRU`, SGD",
    "dp:cnn:adamw": "DataParallel, 2 processes, adapted `Normalization`, "
    "`Conv2D` plus a `RandomRotation` branch, "
    '`AveragePooling2D` (uneven "same" padding), `BatchNormalization`, '
    "`MaxPooling2D`, AdamW",
    "mp:cnn:sgd": "ModelParallel (1, 2), the same convolutional model, its "
    "`Conv2D` kernel split over output channels, SGD",
}
# How far the distributed attention key bias under AdamW may be from the
# reference, in units of the most one process shows between other
# summation orders (`REORDERED`). Measured on a Zen 5 machine: 1.8e-4
# against 7.9e-5 (rows reversed) and 1.0e-4 (halves swapped); a real error
# moves it by the learning rate (1e-2) per step.
REORDERING_FACTOR = 3.0


def single(spec):
    return ":".join(["single"] + spec.split(":")[1:])


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Two launches, on 2 and 4 processes; each process of the first
    also trains the references by itself, before its distributed runs.

    Returns:
        `(references, reports)`: a report holding the references' values,
        and a dict of process count to every rank's report.
    """
    specs = [spec for runs in RUNS.values() for spec in runs]
    two = harness.launch_references_first(
        "training_worker.py",
        2,
        tmp_path_factory.mktemp("training_2"),
        sorted({single(spec) for spec in specs} | set(REORDERED)),
        RUNS[2] + [SHUFFLED],
        timeout=400,
    )
    four = harness.launch(
        "training_worker.py",
        4,
        tmp_path_factory.mktemp("training_4"),
        args=RUNS[4],
        timeout=400,
    )
    return two[0], {2: two, 4: four}


@pytest.fixture(
    params=[(n, spec) for n, runs in RUNS.items() for spec in runs],
    ids=lambda p: f"{p[0]}p-{p[1]}",
)
def case(request, launches):
    nprocs, spec = request.param
    references, reports = launches
    ranks = [harness.run_values(report, spec) for report in reports[nprocs]]
    return ranks, harness.run_values(references, single(spec))


def max_abs_diff(first, second, paths=None, skip=(), only=None):
    """The largest absolute difference between two lists of weights.

    Weights whose path contains a string of `skip` are left out; with
    `only`, only the weights whose path contains a string of it count.
    """
    assert len(first) == len(second)
    if paths is not None:
        assert len(paths) == len(first)
    return max(
        (
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for i, (a, b) in enumerate(zip(first, second))
            if paths is None
            or (
                not any(s in paths[i] for s in skip)
                and (only is None or any(s in paths[i] for s in only))
            )
        ),
        default=0.0,
    )


def max_relative_loss_diff(report, ref):
    """The largest relative difference of the per-step losses."""
    losses = np.asarray(report["batch_losses"])
    expected = np.asarray(ref["batch_losses"])
    assert losses.shape == expected.shape
    return float(np.max(np.abs(losses - expected) / np.abs(expected)))


def ill_conditioned(report):
    """Weights whose gradient is zero in exact arithmetic, under Adam.

    The attention key bias adds the same value to every score of a query,
    which softmax cancels: its gradient is rounding noise (~1e-9), and Adam
    divides that noise by its own magnitude, so any change in summation
    order moves it by up to the learning rate. SGD leaves it in place.
    """
    if "adamw" not in report["optimizer"]:
        return ()
    paths = report["weight_paths"]
    return tuple(
        name
        for name in ("attention/key/bias",)
        if any(name in path for path in paths)
    )


def test_same_initial_weights(case):
    reports, ref = case
    for report in reports:
        assert (
            max_abs_diff(report["initial_weights"], ref["initial_weights"]) == 0
        )


def test_layers_local_to_each_batch_shard_ran_locally(launches):
    """Layers proven local to each batch shard ran on local tensors.

    Under DataParallel the whole MLP runs locally (its losses and weights
    equal one process's in the tests above); with `Dropout`, which draws
    random values in training, the model and the dropout layer train on
    DTensors and the dense layers locally (the unit tests of `batch_local`
    check that a draw keeps a layer on DTensors). In the recurrent model
    the cells and the head run locally; the recurrent layers that run
    Keras's generic RNN loop, and so the model, stay on DTensors: the loop
    unbinds the batch dimension of its first step's output, which
    gathers it (`sharding_rules`), a collective. (keras-nightly's `GRU`
    gets no mask there and runs its own loop, locally.) Every layer of
    the convolutional model runs locally at least once (in `evaluate`
    and `predict` the rotation draws nothing and the batch normalization
    reads its moving statistics), but the adapted normalization, which
    holds its statistics as DTensors, and so the model. In the audio
    model the dense layers and the frames run locally, the normalization
    with given statistics (DTensors made in its build) does not, and so
    neither does the model. The verdicts are
    the same on every rank. Without a distribution nothing is judged.
    """
    references, reports = launches
    for nprocs, runs in RUNS.items():
        for spec in runs:
            names = [
                harness.run_values(report, spec)["local_layers"]
                for report in reports[nprocs]
            ]
            assert all(n == names[0] for n in names), (spec, names)
            names = names[0]
            if spec == "dp:recurrent:adamw":
                # Keras's generic loop, with the mask `LSTM` gets (and
                # `GRU` too, in keras 3.15.1), gathers: those layers, and
                # the model, stay on DTensors, their cells run locally.
                assert {"head", "lstm_cell", "simple_rnn_cell"} <= set(names)
                assert not {"lstm", "rnn", "recurrent"} & set(names), names
                assert {"gru", "gru_cell"} & set(names), names
            elif spec == "dp:cnn:adamw":
                assert names == list(CNN_LOCAL_NAMES), names
            elif spec == "dp:audio:adamw":
                # The normalization holds its statistics as DTensors (made
                # in its build), and stays on DTensors, and so the model;
                # the mel spectrogram's `stft` runs on local rows in its
                # watched call, and it runs locally.
                assert set(AUDIO_LOCAL_NAMES) <= set(names), names
                assert not {"scale", "audio"} & set(names), names
            elif spec == "dp:mlp:adamw:dropout":
                # In training only the dense layers; in `evaluate` and
                # `predict`, where dropout draws nothing, all of them.
                assert set(LAYER_NAMES) <= set(names), names
            elif spec.startswith("dp:"):
                model_names = [n for n in names if n not in LAYER_NAMES]
                assert len(model_names) == 1, (spec, names)
                assert set(names) - set(model_names) <= set(LAYER_NAMES)
    for spec in {single(spec) for runs in RUNS.values() for spec in runs}:
        assert harness.run_values(references, spec)["local_layers"] == []


# The MLP's layer names (the functional model's own name is generated).
LAYER_NAMES = ("up", "down", "head")
# The layers of the convolutional model that ran locally under
# DataParallel.
CNN_LOCAL_NAMES = (
    "add",
    "avgpool",
    "conv",
    "conv_rotated",
    "flatten",
    "head",
    "maxpool",
    "norm",
    "rotate",
)

# Layers of the audio model that ran locally under DataParallel.
AUDIO_LOCAL_NAMES = (
    "accumulate",
    "concat",
    "flatten_frames",
    "flatten_mel",
    "frame_proj",
    "frames",
    "head",
    "mel",
    "mix",
    "norm",
)

# The fewest sharded variables created shard by shard, by model: the
# transformer's embedding, attention and MLP kernels; the recurrent model's
# embedding and its `LSTM` and `GRU` kernels (their recurrent kernels are
# orthogonal, which is drawn whole and then sharded); the convolutional
# model's kernel; the audio model's dense kernels and bias.
SHARDED_ALONE = {"transformer": 9, "recurrent": 3, "cnn": 1, "audio": 3}


def test_sharded_variables_are_created_shard_by_shard(launches):
    """Under `mp` and `2d`, sharded variables were created shard by shard.

    The worker makes chunks a few rows small, so that the models' sharded
    variables (uniform, Glorot-uniform and zeros initializers)
    take that path; `test_same_initial_weights` shows their values equal
    the single-process ones, bit for bit.
    """
    references, reports = launches
    for nprocs, runs in RUNS.items():
        for spec in runs:
            created = [
                harness.run_values(report, spec)["shards_created_alone"]
                for report in reports[nprocs]
            ]
            if spec.startswith("dp:"):
                assert created == [0] * nprocs, spec
            else:
                model = spec.split(":")[1]
                assert min(created) >= SHARDED_ALONE[model], (spec, created)
                assert len(set(created)) == 1, (spec, created)
    for spec in {single(spec) for runs in RUNS.values() for spec in runs}:
        assert harness.run_values(references, spec)["shards_created_alone"] == 0


def test_losses_match_single_device(case):
    reports, ref = case
    harness.assert_losses_match(reports, ref, rtol=LOSS_RTOL)


def test_final_weights_match_single_device(case):
    reports, ref = case
    for report in reports:
        difference = max_abs_diff(
            report["final_weights"],
            ref["final_weights"],
            paths=report["weight_paths"],
            skip=ill_conditioned(report),
        )
        assert difference < WEIGHT_ATOL


def reordering_noise(references):
    """The attention key bias's largest difference between the reference
    and another order of summation on one process, under AdamW."""
    first = harness.run_values(references, "single:transformer:adamw")
    return max(
        max_abs_diff(
            harness.run_values(references, spec)["final_weights"],
            first["final_weights"],
            paths=first["weight_paths"],
            only=("attention/key/bias",),
        )
        for spec in REORDERED
    )


def test_ill_conditioned_weights_within_reordering_noise(launches):
    """Under AdamW, the attention key bias moves with the order of
    summation on one process too; the distributed runs stay within a few
    times that."""
    references, reports = launches
    noise = reordering_noise(references)
    ref = harness.run_values(references, "single:transformer:adamw")
    for report in reports[2]:
        ranks = harness.run_values(report, "mp:transformer:adamw")
        difference = max_abs_diff(
            ranks["final_weights"],
            ref["final_weights"],
            paths=ranks["weight_paths"],
            only=ill_conditioned(ranks),
        )
        assert noise > 0
        assert difference <= REORDERING_FACTOR * noise


def measured_maxima(launches):
    """Per run: the largest relative loss difference and absolute weight
    difference over all ranks, and that of the ill-conditioned weights."""
    references, reports = launches
    rows = {}
    for nprocs, runs in RUNS.items():
        for spec in runs:
            ref = harness.run_values(references, single(spec))
            ranks = [harness.run_values(r, spec) for r in reports[nprocs]]
            skip = ill_conditioned(ranks[0])
            rows[spec] = {
                "loss": max(max_relative_loss_diff(r, ref) for r in ranks),
                "weights": max(
                    max_abs_diff(
                        r["final_weights"],
                        ref["final_weights"],
                        paths=r["weight_paths"],
                        skip=skip,
                    )
                    for r in ranks
                ),
                "ill_conditioned": max(
                    max_abs_diff(
                        r["final_weights"],
                        ref["final_weights"],
                        paths=r["weight_paths"],
                        only=skip,
                    )
                    for r in ranks
                )
                if skip
                else None,
            }
    return rows


def exactness_table(rows, noise):
    """The exactness table, in Markdown."""

    def number(value):
        return f"{value:.1e}".replace("e-0", "e-")

    lines = [
        "| case | max relative loss difference "
        "| max absolute weight difference |",
        "| --- | --- | --- |",
    ]
    for spec, row in rows.items():
        weights = number(row["weights"])
        if row["ill_conditioned"] is not None:
            weights += (
                " (all weights but the attention key bias, which differs by "
                f"{number(row['ill_conditioned'])}; one process, other "
                f"summation orders: up to {number(noise)})"
            )
        lines.append(
            f"| {DESCRIPTIONS[spec]} | {number(row['loss'])} | {weights} |"
        )
    return "\n".join(lines)


def test_exactness_table(launches):
    """Prints the exactness table from the measured maxima (the bounds
    it shows are stated in docs/user_guide.md, "Exactness").

    Print it with
    `python -m pytest integration_tests/training_parity_test.py -s -k
    exactness_table`; with `KERAS_DTENSOR_EXACTNESS_TABLE=<path>` it is
    also written to that file.
    """
    rows = measured_maxima(launches)
    table = exactness_table(rows, reordering_noise(launches[0]))
    print("\n" + table)
    path = os.environ.get("KERAS_DTENSOR_EXACTNESS_TABLE")
    if path:
        with open(path, "w") as f:
            f.write(table + "\n")
    for row in rows.values():
        assert row["loss"] < LOSS_RTOL
        assert row["weights"] < WEIGHT_ATOL


def test_every_rank_logs_the_same_python_floats(case):
    reports, ref = case
    first = reports[0]
    for report in reports:
        # As logged (the worker's `float` comes after): the batch-end
        # losses, the history and `evaluate`'s results.
        assert report["logged_types"] == {
            "batch": ["float"],
            "history": ["float"],
            "evaluate": ["float"],
        }
    for report in reports[1:]:
        assert report["batch_losses"] == first["batch_losses"]
        assert report["history"] == first["history"]
        assert report["evaluate"] == first["evaluate"]
    for report in reports:
        assert report["iterations"] == ref["iterations"]
    for name, values in ref["history"].items():
        np.testing.assert_allclose(
            first["history"][name], values, rtol=LOSS_RTOL
        )


def test_evaluate_and_predict_match_single_device(case):
    reports, ref = case
    for report in reports:
        for name, value in ref["evaluate"].items():
            np.testing.assert_allclose(
                report["evaluate"][name], value, rtol=LOSS_RTOL
            )
        predictions = np.asarray(report["predict"])
        # `predict` returns the full global batch on every rank.
        assert predictions.shape == np.asarray(ref["predict"]).shape
        np.testing.assert_allclose(
            predictions, np.asarray(ref["predict"]), atol=1e-5
        )
        # `model(x)` called directly returns the global batch as well,
        # with or without `training=False` (which is `predict`'s call).
        for call in ("direct_call", "direct_inference"):
            np.testing.assert_allclose(report[call], ref[call], atol=1e-5)
        np.testing.assert_allclose(
            report["direct_inference"],
            predictions[: len(report["direct_inference"])],
            atol=1e-5,
        )


def test_custom_training_loop_matches_single_device(case, request):
    """A training loop written by hand, whose loss and metric get the
    targets as arrays, trains as one process does, on an uneven global
    batch of 5 rows at each of its two steps: passed whole by every
    process or, with `auto_shard_dataset=False` (`local`, 2 processes),
    in parts of 3 and 2 rows."""
    reports, ref = case
    _, spec = request.node.callspec.params["case"]
    assert ref["custom_loop_rows"] == [5, 5]
    if "local" in spec:
        expected_rows = [[3, 3], [2, 2]]
    else:
        expected_rows = [[5, 5]] * len(reports)
    assert [report["custom_loop_rows"] for report in reports] == expected_rows
    for report in reports:
        np.testing.assert_allclose(
            report["custom_loop_losses"],
            ref["custom_loop_losses"],
            rtol=LOSS_RTOL,
        )
        assert report["custom_loop_accuracy"] == pytest.approx(
            ref["custom_loop_accuracy"], abs=1e-7
        )
        updates = report["custom_loop_updates"]
        assert len(updates) == len(ref["custom_loop_updates"]) > 0
        for update, expected in zip(updates, ref["custom_loop_updates"]):
            np.testing.assert_allclose(update, expected, atol=1e-6)


def test_shuffled_training_logs_the_same_losses_on_all_ranks(launches):
    _, reports = launches
    ranks = [harness.run_values(report, SHUFFLED) for report in reports[2]]
    assert len(ranks[0]["batch_losses"]) == 8
    assert ranks[0]["batch_losses"] == ranks[1]["batch_losses"]
    assert ranks[0]["final_weights"] == ranks[1]["final_weights"]
