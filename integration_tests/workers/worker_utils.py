"""Helpers imported by worker scripts (they run under torchrun)."""

import json
import os

import numpy as np

_REPORT = {}


def rank():
    return int(os.environ.get("RANK", "0"))


def record(key, value):
    """Records a JSON-able value (numpy arrays become nested lists)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, (np.floating, np.integer)):
        value = value.item()
    _REPORT[key] = value


def record_error(key, fn):
    """Records the message of the exception `fn()` raises (or None)."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the message is the result
        _REPORT[key] = f"{type(error).__name__}: {error}"
        return
    _REPORT[key] = None


def report():
    """Writes this rank's recorded values for the test process."""
    result_dir = os.environ["KERAS_DTENSOR_TEST_RESULT_DIR"]
    path = os.path.join(result_dir, f"rank{rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(_REPORT, f)
    os.replace(path + ".tmp", path)
