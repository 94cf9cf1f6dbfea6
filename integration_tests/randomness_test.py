"""Random layers behave as on JAX under a distribution.

`workers/randomness_worker.py` applies `Dropout` (with and without a
seed), `GaussianNoise` and `GaussianDropout` in training mode to a batch
of identical rows without a distribution (each of the launch's 2
processes by itself, first) and under `DataParallel` and `ModelParallel`
on the 2 processes. Random values are drawn for the global
batch from the shared seed, so:
- every process holds the same global output, equal to the single-process
  output for the same seed (processes of one model replica agree, and the
  run is reproducible);
- the data-parallel shards of the batch get different random values;
- the same seed gives the same values, and the next call new ones.
"""

import harness
import numpy as np
import pytest

LAYERS = ("dropout", "seeded_dropout", "gaussian_noise", "gaussian_dropout")
MODES = ("dp", "mp")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    reports = harness.launch_references_first(
        "randomness_worker.py",
        2,
        tmp_path_factory.mktemp("randomness_worker"),
        ["single"],
        list(MODES),
    )
    return reports[0], reports


def outputs(report, mode, layer):
    return np.asarray(report[f"{mode}/{layer}/outputs"], dtype="float32")


@pytest.mark.parametrize("layer", LAYERS)
def test_single_process_is_reproducible_and_random(reports, layer):
    single, _ = reports
    first, again, after = outputs(single, "single", layer)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, after)
    # Identical input rows get different random values.
    assert not np.array_equal(first[0], first[1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layer", LAYERS)
def test_equals_single_process_on_every_rank(reports, mode, layer):
    single, distributed = reports
    expected = outputs(single, "single", layer)
    for rank, report in enumerate(distributed):
        np.testing.assert_allclose(
            outputs(report, mode, layer),
            expected,
            rtol=1e-6,
            atol=1e-6,
            err_msg=f"rank{rank}",
        )


@pytest.mark.parametrize("layer", LAYERS)
def test_data_parallel_shards_draw_different_values(reports, layer):
    _, distributed = reports
    for report in distributed:
        first = outputs(report, "dp", layer)[0]
        half = len(first) // 2
        assert not np.array_equal(first[:half], first[half:])
