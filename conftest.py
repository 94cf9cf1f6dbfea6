"""Test configuration shared by every test folder.

Every test runs on the torch backend. `integration_tests/` is put on the
path so that tests can `import harness`, the multi-process launcher.
"""

import os
import sys

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
