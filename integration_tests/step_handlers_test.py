"""The step mode's handlers on tensors split over 2 processes equal plain
torch on the full tensors.

`workers/step_handlers_worker.py` runs, on 2 gloo processes inside a
step's torch function mode: in-place writes into DTensors laid out
otherwise than what is written (`copy_` of a column-split source into a
replicated target, a slice assignment of a row-split value, `index_put_`
into a row-split target, with and without `accumulate`, negative indices
included; a cache cloned from a replicated one and written as keras-hub
writes its KV cache, which takes the split of what is written, and whose
writes gather nothing); `argmax` along a split last dimension given as
`-1`, `min` over a split dimension, `amax`; Python values (`int`, `item`,
`bool`, `tolist`) of split and partial DTensors; and the gradients of
Gemma's rotary key path with one key/value head, whose backward views a
`cat` that DTensor lays out locally otherwise than it records
(`local_layouts`); `cross_entropy` of logits split along their
classes (`split_class_losses`); a partial mean taken to a partial
sum (`unit_axis_redistribution`); and attention scores of head-split
queries and replicated keys (`argument_layouts`). Each result must equal
the same op on the full tensors in plain torch, on every rank, and keep
the layout the handler promises.
"""

import harness
import pytest
import torch


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return harness.launch(
        "step_handlers_worker.py",
        2,
        tmp_path_factory.mktemp("step_handlers"),
        timeout=240,
    )


def full_values():
    generator = torch.Generator().manual_seed(0)
    return {
        "logits": torch.randn(4, 3, 10, generator=generator),
        "rows": torch.arange(32, dtype=torch.float32).reshape(4, 8),
        "lengths": torch.tensor([5, 3, 7, 6]),
    }


def expected_writes():
    rows = full_values()["rows"]
    copied = rows.clone()
    set_item = torch.zeros(4, 8)
    set_item[:, 2:4] = rows[:, :2]
    index = (torch.arange(4), torch.tensor([5, 1, -1, 0]))
    values = torch.tensor([10.0, 20.0, 30.0, 40.0])
    put = rows.clone()
    put.index_put_(index, values)
    accumulated = put.clone()
    accumulated.index_put_(index, values, accumulate=True)
    return {
        "copy": (copied, ["R"]),
        "set_item": (set_item, ["R"]),
        "index_put": (put, ["S(0)"]),
        "index_put_accumulate": (accumulated, ["S(0)"]),
    }


def test_in_place_writes_keep_the_targets_layout(reports):
    for rank, report in enumerate(reports):
        for key, (expected, placements) in expected_writes().items():
            assert report[f"{key}/placements"] == placements, (rank, key)
            assert report[f"{key}/values"] == expected.tolist(), (rank, key)
        # The row-split target was written where it lies, never gathered.
        assert report["index_put/local_rows"] == 2


def test_a_cache_written_like_keras_hubs_takes_the_split_of_its_values(
    reports,
):
    rows = full_values()["rows"]
    written = rows.clone()
    written[1:3] = 100 + rows[:2]
    for rank, report in enumerate(reports):
        assert report["seeded_cache/placements"] == ["S(1)"], rank
        assert report["seeded_cache/values"] == rows.tolist(), rank
        assert report["seeded_cache/collectives"] == 0, rank
        assert report["token_write/placements"] == ["S(1)"], rank
        assert report["token_write/values"] == written.tolist(), rank
        assert report["token_write/collectives"] == 0, rank


def test_extreme_reductions_equal_plain_torch(reports):
    full = full_values()
    expected = {
        "argmax": torch.argmax(full["logits"], dim=-1),
        "min": torch.min(full["lengths"]),
        "amax": torch.amax(full["logits"], dim=-1),
    }
    for report in reports:
        for key, value in expected.items():
            assert report[f"{key}/values"] == value.tolist(), key
        # A minimum over the split dimension is whole as it is made.
        assert report["min/placements"] == ["R"]


def test_python_values_are_the_whole_values(reports):
    lengths = full_values()["lengths"]
    for report in reports:
        assert report["int_of_min"] == int(lengths.min())
        assert report["item_of_sum"] == lengths.sum().item()
        assert report["bool_of_any"] is bool((lengths > 6).any())
        assert report["tolist"] == lengths.tolist()


def test_cat_gradients_in_the_recorded_layout_equal_plain_torch(reports):
    for rank, report in enumerate(reports):
        # If this fails, torch lays the local `cat` out as it records it
        # and `local_layouts` can go.
        assert "view size is not compatible" in report["rotary/outside_error"]
        assert report["rotary/x_gradient/placements"] == ["S(0)"]
        for name in ("x_gradient", "kernel_gradient"):
            torch.testing.assert_close(
                torch.tensor(report[f"rotary/{name}/values"]),
                torch.tensor(report[f"rotary/plain/{name}"]),
                atol=1e-4,
                rtol=1e-5,
                msg=f"rank {rank} {name}",
            )


def test_class_split_cross_entropy_equals_plain_torch(reports):
    for rank, report in enumerate(reports):
        # If this fails, torch no longer gathers class-split logits for
        # `log_softmax`, and `split_class_losses` can go.
        assert report["ce/outside_collectives"] == 1
        for reduction in ("none", "sum", "mean"):
            key = f"ce/{reduction}"
            torch.testing.assert_close(
                torch.tensor(report[f"{key}/values"]),
                torch.tensor(report[f"ce/plain/{reduction}"]),
                msg=f"rank {rank} {key}",
            )
            torch.testing.assert_close(
                torch.tensor(report[f"{key}/gradient/values"]),
                torch.tensor(report[f"ce/plain/{reduction}/gradient"]),
                msg=f"rank {rank} {key} gradient",
            )
            # Never gathered: three all-reduces of one value per example
            # and position forward, none backward; the gradient split as
            # the logits are.
            assert report[f"{key}/forward_collectives"] == 3, key
            assert report[f"{key}/backward_collectives"] == 0, key
            assert report[f"{key}/gradient/placements"] == ["S(1)"], key
        assert report["ce/none/placements"] == ["R"]
        # Class weights are not handled: torch's own path, same values.
        torch.testing.assert_close(
            torch.tensor(report["ce/weighted/values"]),
            torch.tensor(report["ce/plain/weighted"]),
        )


def test_partial_mean_meets_a_partial_sum(reports):
    """Means 2 and 4 (avg 3) plus sums 10 and 20 (30): 33, on every rank."""
    for report in reports:
        # If this fails, torch moves between partial types, and
        # `unit_axis_redistribution`'s conversion can go.
        assert "partial type" in report["partials/outside_error"]
        # Reduced first (mean 3), then a partial sum of 3 over the ranks.
        assert report["partials/as_sum_total"] == 3.0
        assert report["partials/values"] == 33.0


def test_einsum_chunks_the_replicated_operand(reports):
    for rank, report in enumerate(reports):
        # If this fails, DTensor no longer gathers the split operand, and
        # `argument_layouts._einsum` can go.
        assert report["einsum/outside_collectives"] > 0
        assert report["einsum/collectives"] == 0
        assert report["einsum/placements"] == ["S(1)"]
        torch.testing.assert_close(
            torch.tensor(report["einsum/values"]),
            torch.tensor(report["einsum/plain"]),
            msg=f"rank {rank}",
        )


def test_einsum_splits_the_replicated_operand_along_a_contracted_letter(
    reports,
):
    for rank, report in enumerate(reports):
        # Megatron's row-parallel layer: the replicated input takes the
        # kernel's split of the contracted heads, and the output is a
        # partial sum; nothing moves forward.
        assert report["row_split/placements"] == ["P(sum)"]
        assert report["row_split/collectives"] == 0
        # The input's gradient keeps the split it was cut to.
        assert report["row_split/x_gradient/placements"] == ["S(2)"]
        assert report["row_split/kernel_gradient/placements"] == ["S(0)"]
        for name in ("out", "x_gradient", "kernel_gradient"):
            torch.testing.assert_close(
                torch.tensor(report[f"row_split/{name}/values"]),
                torch.tensor(report[f"row_split/plain/{name}"]),
                msg=f"rank {rank}: {name}",
            )
