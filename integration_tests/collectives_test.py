"""Collectives per training step, counted with `CommDebugMode`.

`workers/collectives_worker.py` runs one `train_on_batch` under the
benchmark's `CollectiveCounter` (a `CommDebugMode`) on 2 gloo processes
after two warm-up steps, and reports
the count of each collective (counts, not times):
- `DataParallel` MLP: the gradients of all 6 variables are reduced in one
  bucketed all-reduce (`c10d.allreduce_`), and the loss rides in the same
  bucket, read after backward; AdamW adds nothing to SGD with momentum
  (the optimizer never meets a partial gradient), nor does a
  `LossScaleOptimizer`, which scales the partial loss before backward.
  With a bucket cap of 0 MB, each gradient is its own bucket, sent
  during backward, and the loss takes one DTensor all-reduce of its own
  after backward; the losses are the same bits either way.
- A Megatron MLP block (column- then row-parallel kernels, the block's
  input and output replicated by `<layer>/output` layouts) under
  `ModelParallel` on a (1, 2) mesh: 1 all-reduce forward (counted when
  the loss function is called) and 1 backward (the rest of the step), the
  minimum; no gradient needs a reduction after backward. With LoRA on
  the block's two layers (replicated factors), their gradients add one
  bucketed all-reduce: both layers train on local shards, where the
  factors' gradients are partial sums.
- The same MLP fully sharded (`fully_sharded_layouts` on a (2,) "batch"
  mesh, its two hidden kernels sharded): the model runs on local tensors;
  its two small sharded kernels form one unit (consecutive units are
  joined up to `KERAS_DTENSOR_UNIT_CAP_MB`), all-gathered once in
  forward; gathered kernels are freed after forward, and backward
  gathers the unit again (for d2's kernel, needed by d1's output
  gradient), then reduce-scatters both gradients in one collective; the
  replicated variables (biases, the head's kernel) share one gradient
  bucket, which the loss rides. With a unit cap of 0, each
  Dense is a unit: one all-gather per sharded kernel forward, d2's again
  in backward (d1's is not needed: the input needs no gradient), one
  reduce-scatter per kernel. The kernels keep their shards, and the
  trained weights equal the single-process ones.
- Two blocks (each a layer of two Dense sublayers) and a head, fully
  sharded: the two small blocks are joined into one unit (1 all-gather
  forward, 1 backward, 1 reduce-scatter). With a unit cap of 0, each
  block's two sharded kernels are gathered in one all-gather and their
  gradients reduce-scattered in one, so a step issues 2 all-gathers in
  forward, 2 more in backward (block2 for block1's gradient, block1 for
  its second kernel's input gradient) and 2 reduce-scatters. With both
  blocks recomputed, each block is one unit (a recomputed sublayer joins
  no other), gathered again by its recomputation: the same counts.
- A flat functional model (a first Dense, two residual blocks of two
  Dense layers each, a head; every layer a direct layer of the model),
  every variable sharded, as FSDP2 shards every parameter: the blocks are
  found from the graph (the segments between single live tensors that
  repeat), and each is a unit; the first Dense and the head form the root
  unit, kept gathered from forward to the end of backward. A step issues
  FSDP2's minimum: 3 all-gathers in forward, 2 in backward (the blocks;
  the root is not gathered again), 3 reduce-scatters, the loss's
  all-reduce, and no gradient bucket.
The losses equal a single-process run's.

Two more runs check the local paths of a DataParallel step against
DTensor's own: `reduce`, a loss reduction over split values computed on
each process's values (the bits, placements, collectives and gradients
of upstream's reduction on DTensors; values and gradients also against
numpy's reduction of the full arrays, as `wholeloss`'s cross-entropy),
and `rows`, a global batch cut
into this process's rows by a plan made once per shape (the DTensor of
`distribute_tensor`).
"""

import harness
import numpy as np
import pytest

RUNS = [
    "dp:sgd",
    "dp:adamw",
    "dp:lso",
    "dp:sgd:0",
    "tp:sgd",
    "tp:adamw",
    "tplora:sgd",
    "fsdp:sgd",
    "fsdp:adamw",
    "fsdp:sgd::0",
    "fsdpblocks:sgd",
    "fsdpblocks:sgd::0",
    "fsdpremat:sgd",
    "fsdpflat:sgd",
    "fsdpflat:adamw",
    "reduce",
    "rows",
    "wholeloss",
]
# Loss reductions, each with (1) or without (0) sample weights.
LOSS_CASES = [
    "sum_over_batch_size:0",
    "sum_over_batch_size:1",
    "sum:0",
    "sum:1",
]
BUCKETED = "c10d.allreduce_"
DTENSOR_ALL_REDUCE = "c10d_functional.all_reduce"
ALL_GATHER = "c10d_functional.all_gather_into_tensor"
REDUCE_SCATTER = "c10d_functional.reduce_scatter_tensor"
VARIABLE = ("kernel", "bias")
# The variables that `fully_sharded_layouts` shards in the `fsdp` runs.
FSDP_SHARDED = ("d1/kernel", "d2/kernel")
# Every variable of the `fsdp` runs' MLP, and of the `fsdpblocks` and
# `fsdpremat` runs' two blocks and head.
FSDP_VARIABLES = {
    f"{layer}/{kind}" for layer in ("d1", "d2", "head") for kind in VARIABLE
}
BLOCK_VARIABLES = {
    f"{block}/{dense}/{kind}"
    for block in ("block1", "block2")
    for dense in ("first", "second")
    for kind in VARIABLE
} | {f"head/{kind}" for kind in VARIABLE}
# What a step's worker notes (`step_events`): the gradient buckets' end of
# backward, and the all-reduce of a loss computed on local tensors.
GRADIENTS_REDUCED = "gradients reduced"
LOSS_ALL_REDUCED = "loss all-reduced"


def float32s(bits):
    """The float32 values whose bytes a worker reported in hex."""
    return np.frombuffer(bytes.fromhex(bits), dtype=np.float32)


def plain_reduction(inputs, case):
    """`reduce_weighted_values` of the worker's full arrays, by numpy in
    float64: the value, and the gradient of the value with respect to the
    per-sample values."""
    reduction, weighted = case.split(":")
    values = np.asarray(inputs["values"], dtype=np.float64)
    weights = np.ones((len(values), 1))
    if weighted == "1":
        weights = np.asarray(inputs["weights"], dtype=np.float64)
    value = (values * weights).sum()
    grad = np.broadcast_to(weights, values.shape)
    if reduction == "sum_over_batch_size":
        value, grad = value / values.size, grad / values.size
    return value, grad


def plain_cross_entropy(inputs, case):
    """`SparseCategoricalCrossentropy(from_logits=True)` of the worker's
    full arrays, by numpy in float64: the value, and its gradient with
    respect to the logits."""
    reduction, weighted = case.split(":")
    logits = np.asarray(inputs["logits"], dtype=np.float64)
    labels = np.asarray(inputs["labels"])
    weights = np.ones(len(logits))
    if weighted == "1":
        weights = np.asarray(inputs["weights"], dtype=np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(labels))
    value = -(weights * log_softmax[rows, labels]).sum()
    grad = np.exp(log_softmax)
    grad[rows, labels] -= 1
    grad *= weights[:, None]
    if reduction == "sum_over_batch_size":
        value, grad = value / len(labels), grad / len(labels)
    return value, grad


def assert_plain(result, value, grad):
    """A reported value and gradient (float32 bits) against a plain
    float64 computation (float32 summation order: 1e-5)."""
    np.testing.assert_allclose(
        float32s(result["value"]), [value], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        float32s(result["grad"]).reshape(grad.shape),
        grad,
        rtol=1e-5,
        atol=1e-7,
    )


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return harness.launch(
        "collectives_worker.py",
        2,
        tmp_path_factory.mktemp("collectives"),
        args=RUNS,
    )


def counts(report, run):
    return report[f"{run}/counts"]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "lso"])
def test_data_parallel_step_has_one_gradient_bucket(reports, optimizer):
    """One collective a step: the gradients' bucket, with the loss."""
    for report in reports:
        assert counts(report, f"dp:{optimizer}") == {BUCKETED: 1}


def test_zero_bucket_cap_reduces_each_gradient_once(reports):
    for report in reports:
        trainable = report["dp:sgd:0/trainable"]
        assert trainable == 6
        assert counts(report, "dp:sgd:0") == {
            BUCKETED: trainable,
            DTENSOR_ALL_REDUCE: 1,
        }


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_tensor_parallel_block_needs_one_all_reduce_each_way(
    reports, optimizer
):
    """One all-reduce in forward (up to the loss), one in backward, none
    after."""
    for report in reports:
        run = f"tp:{optimizer}"
        assert report[f"{run}/forward_counts"] == {DTENSOR_ALL_REDUCE: 1}
        assert counts(report, run) == {DTENSOR_ALL_REDUCE: 2}
        # The row-parallel layer trains on local shards (its replicated
        # bias added as each process's share), and its local run replays
        # the forward all-reduce where it ends; no gradient bucket is
        # finished and no local loss all-reduced: the backward one is
        # DTensor's own.
        assert report[f"{run}/events"] == ["layer end replayed"]


def test_lora_factor_gradients_take_one_bucket(reports):
    """The block's all-reduces, then the replicated LoRA factors'
    gradients, all-reduced in one bucket, not one each: both layers train
    on local shards, where each factor's gradient is a partial sum (on
    DTensors the factors on the split side of each kernel took split
    gradients, gathered in an all-gather of their own, `gather_bucket`)."""
    for report in reports:
        run = "tplora:sgd"
        assert report[f"{run}/forward_counts"] == {DTENSOR_ALL_REDUCE: 1}
        assert counts(report, run) == {DTENSOR_ALL_REDUCE: 2, BUCKETED: 1}
        assert report[f"{run}/losses"] == pytest.approx(
            report[f"{run}/reference_losses"], rel=1e-6
        )


@pytest.mark.parametrize("run", [r for r in RUNS if ":" in r])
def test_steps_warn_as_without_a_distribution(reports, run):
    """A step under a distribution warns of nothing the same step without
    one does not (the unit gathers' deprecated torch collectives warned
    on each step)."""
    for report in reports:
        extra = set(report[f"{run}/warnings"])
        extra -= set(report[f"{run}/reference_warnings"])
        assert not extra


@pytest.mark.parametrize("case", LOSS_CASES)
def test_loss_reduction_on_local_tensors_equals_dtensors(reports, case):
    """Each process reduces its own loss values: the value and the
    values' gradient have the bits of upstream's reduction on DTensors (2
    processes: the mean's division by the shard count is exact), with its
    placements and collectives: a mean is all-reduced once into a
    replicated value, a sum stays a partial sum. Both are the reduction
    of the full arrays computed by numpy."""
    mean = case.startswith("sum_over_batch_size")
    for report in reports:
        local = report[f"reduce/{case}/local"]
        upstream = report[f"reduce/{case}/dtensor"]
        value, grad = plain_reduction(report["reduce/inputs"], case)
        assert_plain(local, value, grad)
        assert_plain(upstream, value, grad)
        assert local["local"] and not upstream["local"]
        assert local["value"] == upstream["value"]
        assert local["grad"] == upstream["grad"]
        assert local["placements"] == upstream["placements"]
        assert local["placements"] == (["R"] if mean else ["P(sum)"])
        assert local["counts"] == upstream["counts"]
        assert local["counts"] == ({DTENSOR_ALL_REDUCE: 1} if mean else {})


@pytest.mark.parametrize("case", ["sum_over_batch_size:0", "sum:0"])
def test_local_mean_is_waited_for_where_it_is_issued(reports, case):
    """A local mean's all-reduce is waited for before the reduction
    returns, as DTensor's own reduction waits for its all-reduce; the
    gradient is upstream's, bit for bit (the test above). A sum issues no
    all-reduce."""
    for report in reports:
        assert not report[f"reduce/{case}/local"]["pending"]
        assert not report[f"reduce/{case}/dtensor"]["pending"]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "lso"])
def test_data_parallel_step_reduces_its_loss_with_the_gradients(
    reports, optimizer
):
    """The train step's loss, computed on local tensors, is left partial
    through backward and reduced in the gradients' bucket: no all-reduce
    of its own, also where a `LossScaleOptimizer` (`lso`) scales it before
    backward. Its losses are the single-process ones
    (`test_losses_equal_single_process`)."""
    for report in reports:
        assert report[f"dp:{optimizer}/events"] == ["gradients reduced"]


def test_loss_without_an_open_bucket_is_reduced_after_backward(reports):
    """With a bucket cap of 0 every bucket is sent during backward, so
    none is left for the loss: it is all-reduced by itself after
    backward, when the loss tracker reads it. The losses have the same
    bits as those reduced in the bucket (2 processes: a sum of two
    values does not depend on the order)."""
    for report in reports:
        assert report["dp:sgd:0/events"] == [
            "gradients reduced",
            "loss all-reduced",
        ]
        assert report["dp:sgd:0/losses"] == report["dp:sgd/losses"]


@pytest.mark.parametrize("case", LOSS_CASES)
def test_built_in_loss_runs_whole_on_local_tensors(reports, case):
    """A built-in loss's first call is watched on DTensors, its second
    computes the per-sample values in a local call and reduces them
    locally, and from the third on the whole loss runs on the local
    tensors of its arguments (`batch_reductions.call_loss`): `call_layer`
    is not reached, nor is any DTensor reduced. Every call gives the
    value, gradient, placements and collectives of the loss computed on
    DTensors, bit for bit; the value and gradient are those of the
    cross-entropy of the full arrays computed by numpy."""
    mean = case.startswith("sum_over_batch_size")
    for report in reports:
        calls = report[f"wholeloss/{case}/calls"]
        reference = report[f"wholeloss/{case}/dtensor"]
        value, grad = plain_cross_entropy(report["wholeloss/inputs"], case)
        assert_plain(reference, value, grad)
        for call in calls:
            assert_plain(call, value, grad)
        assert [c["per_sample_call"] for c in calls] == [True, True, False]
        assert [c["dtensor_values_reduced"] for c in calls] == [
            True,
            True,
            False,
        ]
        for call in calls:
            for key in ("value", "grad", "placements", "counts"):
                assert call[key] == reference[key], key
        assert reference["counts"] == ({DTENSOR_ALL_REDUCE: 1} if mean else {})


def test_masked_loss_reduction_keeps_dtensors(reports):
    for report in reports:
        assert not report["reduce/masked"]["local"]


@pytest.mark.parametrize("case", ["even", "uneven", "int"])
def test_batch_rows_equal_distribute_tensor(reports, case):
    """A global batch split evenly over the batch axis is cut by a plan
    made once per shape: the same rows, placements, shape and stride as
    `distribute_tensor`; an uneven split keeps `distribute_tensor`."""
    for report in reports:
        rows = report[f"rows/{case}"]
        assert rows["planned"] == (case != "uneven")
        assert rows["made"] == rows["expected"]


@pytest.mark.parametrize(
    "run", [r for r in RUNS if r not in ("reduce", "rows", "wholeloss")]
)
def test_losses_equal_single_process(reports, run):
    for report in reports:
        np.testing.assert_allclose(
            report[f"{run}/losses"],
            report[f"{run}/reference_losses"],
            rtol=1e-5,
        )


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fully_sharded_step_gathers_its_joined_unit_once(reports, optimizer):
    """The two small sharded kernels form one unit: one all-gather
    forward, one more in backward (d2's kernel, for d1's output
    gradient), one reduce-scatter, one bucket for the replicated
    variables and the loss."""
    for report in reports:
        run = f"fsdp:{optimizer}"
        assert report[f"{run}/forward_counts"] == {ALL_GATHER: 1}
        assert counts(report, run) == {
            ALL_GATHER: 2,
            REDUCE_SCATTER: 1,
            BUCKETED: 1,
        }
        # The bucket is finished at the end of backward, the loss in it.
        assert report[f"{run}/events"] == [GRADIENTS_REDUCED]


def test_unjoined_units_gather_each_sharded_kernel_once(reports):
    """With a unit cap of 0, each Dense is a unit: one all-gather per
    sharded kernel forward, one more in backward for d2's kernel (d1's
    is not needed: the input needs no gradient), one reduce-scatter per
    sharded kernel, one bucket for the replicated variables and the
    loss."""
    sharded = len(FSDP_SHARDED)
    for report in reports:
        run = "fsdp:sgd::0"
        assert report[f"{run}/forward_counts"] == {ALL_GATHER: sharded}
        assert counts(report, run) == {
            ALL_GATHER: sharded + 1,
            REDUCE_SCATTER: sharded,
            BUCKETED: 1,
        }
        assert report[f"{run}/events"] == [GRADIENTS_REDUCED]


@pytest.mark.parametrize("run", ["fsdp:sgd", "fsdp:adamw", "fsdp:sgd::0"])
def test_fully_sharded_variables_keep_their_shards(reports, run):
    for report in reports:
        layouts = report[f"{run}/layouts"]
        assert layouts["d1/kernel"] == [["S(1)"], [16, 16]]
        assert layouts["d2/kernel"] == [["S(0)"], [16, 32]]
        assert layouts["head/kernel"] == [["R"], [32, 4]]
        assert layouts["d1/bias"] == [["R"], [32]]


@pytest.mark.parametrize("run", ["fsdp:sgd", "fsdp:adamw", "fsdp:sgd::0"])
def test_fully_sharded_weights_equal_single_process(reports, run):
    for report in reports:
        reference = report[f"{run}/reference_weights"]
        assert set(report[f"{run}/weights"]) == set(reference)
        assert set(reference) == FSDP_VARIABLES
        for path, value in report[f"{run}/weights"].items():
            np.testing.assert_allclose(
                value, reference[path], rtol=1e-5, atol=1e-6, err_msg=path
            )


@pytest.mark.parametrize(
    "run, units",
    [("fsdpblocks:sgd", 1), ("fsdpblocks:sgd::0", 2), ("fsdpremat:sgd", 2)],
)
def test_fully_sharded_blocks_gather_each_unit_once(reports, run, units):
    """A unit's sharded kernels share one all-gather each way and one
    reduce-scatter. The two small blocks are joined into one unit; with a
    unit cap of 0, or recomputed in backward, each block is a unit."""
    for report in reports:
        assert report[f"{run}/forward_counts"] == {ALL_GATHER: units}
        assert counts(report, run) == {
            ALL_GATHER: 2 * units,
            REDUCE_SCATTER: units,
            BUCKETED: 1,
        }
        # The replicated biases and head share the bucket, the loss in it.
        assert report[f"{run}/events"] == [GRADIENTS_REDUCED]
        layouts = report[f"{run}/layouts"]
        for block in ("block1", "block2"):
            for dense in ("first", "second"):
                placements, _ = layouts[f"{block}/{dense}/kernel"]
                assert placements != ["R"], (block, dense)
        reference = report[f"{run}/reference_weights"]
        assert set(report[f"{run}/weights"]) == set(reference)
        assert set(reference) == BLOCK_VARIABLES
        for path, value in report[f"{run}/weights"].items():
            np.testing.assert_allclose(
                value, reference[path], rtol=1e-5, atol=1e-6, err_msg=path
            )


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_flat_model_blocks_are_found_from_its_graph(reports, optimizer):
    """One unit per repeated block and one root unit: FSDP2's minimum."""
    run = f"fsdpflat:{optimizer}"
    for report in reports:
        assert report[f"{run}/forward_counts"] == {ALL_GATHER: 3}
        assert counts(report, run) == {
            ALL_GATHER: 5,
            REDUCE_SCATTER: 3,
            DTENSOR_ALL_REDUCE: 1,
        }
        # Every variable sharded: no gradient bucket, so the loss computed
        # on local tensors is all-reduced by itself.
        assert report[f"{run}/events"] == [LOSS_ALL_REDUCED]
        layouts = report[f"{run}/layouts"]
        assert layouts["b0_up/kernel"] == [["S(1)"], [32, 32]]
        assert layouts["b1_down/bias"] == [["S(0)"], [16]]
        assert layouts["head/kernel"] == [["S(0)"], [16, 4]]
        reference = report[f"{run}/reference_weights"]
        assert set(report[f"{run}/weights"]) == set(reference)
        assert set(reference) == {
            f"{layer}/{kind}"
            for layer in ("pre", "b0_up", "b0_down", "b1_up", "b1_down", "head")
            for kind in VARIABLE
        }
        for path, value in report[f"{run}/weights"].items():
            np.testing.assert_allclose(
                value, reference[path], rtol=1e-5, atol=1e-6, err_msg=path
            )
