"""Test configuration shared by every test folder.

Every test runs on the torch backend. `integration_tests/` is put on the
path so that tests can `import harness`, the multi-process launcher.
"""

import os
import sys

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(
    0,
    os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "integration_tests"
    ),
)

# Import keras before pytest imports the in-tree test modules, so that their
# `keras.src...` names resolve to the installed keras (plus the mount).
import keras  # noqa: E402, F401


@pytest.fixture
def distribution():
    """DataParallel on this process's one device, set for the test."""
    distribution = keras.distribution.DataParallel(devices=["cpu:0"])
    keras.distribution.set_distribution(distribution)
    yield distribution
    keras.distribution.set_distribution(None)
