"""The version gate: the keras and torch versions the mount serves.

`check_installed_keras_version` runs before the mount serves its first
torch backend module, reading keras's version from its source (keras is
being imported then); `check_supported_versions` checks keras and torch
when `keras.src.backend.torch.core` is imported, before any edit there.
Outside the ranges, `UnsupportedVersionError` names what was found.
"""

import importlib.util
import os
import re
import sys

SUPPORTED_KERAS = ("3.15.1", "3.16")  # [minimum, exclusive maximum)
# keras-nightly versions outside that range that this project's whole test
# suite passed on (docs/keras_nightly.md, scripts/nightly.sh).
TESTED_KERAS_NIGHTLY = ("3.16.0.dev2026102704",)
# Measured by scripts/torch_matrix.sh (docs/limits.md, "Supported versions").
SUPPORTED_TORCH = ("2.11", "2.16")  # [minimum, exclusive maximum)


class UnsupportedVersionError(RuntimeError):
    """Raised when keras or torch is outside the supported range."""


def _version_tuple(version):
    """`"2.13.0+cpu"` -> `(2, 13, 0)`; stops at the first non-numeric part."""
    parts = []
    for part in version.split("+")[0].split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.group() != part:
            break
    return tuple(parts)


def _in_range(version, supported):
    """Whether `version` lies in `supported`, a [minimum, maximum) pair."""
    low, high = (_version_tuple(v) for v in supported)
    return low <= _version_tuple(version) < high


def _range_text(name, supported):
    """`("2.11", "2.16")` -> `"torch>=2.11,<2.16"`, as pyproject says it."""
    return f"{name}>={supported[0]},<{supported[1]}"


def keras_version_supported(version):
    """Whether keras `version` is in `SUPPORTED_KERAS` or a tested nightly."""
    return (
        _in_range(version, SUPPORTED_KERAS) or version in TESTED_KERAS_NIGHTLY
    )


def _keras_support_text():
    """The supported keras versions, in words, for the version errors."""
    text = _range_text("keras", SUPPORTED_KERAS)
    if TESTED_KERAS_NIGHTLY:
        nightlies = ", ".join(TESTED_KERAS_NIGHTLY)
        text += f" (or the tested keras-nightly {nightlies})"
    return text


def check_supported_versions(module=None):
    """Fails with one clear error on a keras or torch outside the range."""
    import torch

    from keras.src.version import __version__ as keras_version

    keras_ok = keras_version_supported(keras_version)
    torch_ok = _in_range(torch.__version__, SUPPORTED_TORCH)
    if not (keras_ok and torch_ok):
        raise UnsupportedVersionError(
            f"keras-dtensor supports {_keras_support_text()} "
            f"and {_range_text('torch', SUPPORTED_TORCH)}. "
            f"Found keras=={keras_version} and torch=={torch.__version__}. "
            "Install a supported version, or uninstall keras-dtensor."
        )


def installed_keras_version():
    """The version of the keras being imported, read from its source.

    Reads `keras/src/version.py` of the `keras` package in `sys.modules`
    (or found on `sys.path`) without importing anything: it is called
    while keras itself is being imported. None where it cannot be read.
    """
    keras = sys.modules.get("keras")
    if keras is not None and getattr(keras, "__file__", None):
        folder = os.path.dirname(keras.__file__)
    else:
        spec = importlib.util.find_spec("keras")
        if spec is None or not spec.origin:
            return None
        folder = os.path.dirname(spec.origin)
    try:
        with open(os.path.join(folder, "src", "version.py")) as f:
            source = f.read()
    except OSError:
        return None
    match = re.search(r"^__version__ = [\"']([^\"']+)[\"']", source, re.M)
    return None if match is None else match.group(1)


def check_installed_keras_version():
    """Fails with one clear error on a keras outside the supported range.

    Run by the mount before it serves its first torch backend module, so
    that a keras it was not built for (say an untested 3.16 dev version,
    whose torch backend has a `distribution_lib` of its own) gets this
    error instead of whatever the overlay would meet there. torch is
    checked when `keras.src.backend.torch.core` is imported
    (`check_supported_versions`).
    """
    version = installed_keras_version()
    if version is None or keras_version_supported(version):
        return
    raise UnsupportedVersionError(
        f"keras-dtensor supports {_keras_support_text()}. "
        f"Found keras=={version}. Install a supported version, or uninstall "
        "keras-dtensor."
    )


# The gate runs first among the edits of `keras.src.backend.torch.core`.
POST_IMPORT_EDITS = {
    "keras.src.backend.torch.core": lambda: [check_supported_versions],
}
