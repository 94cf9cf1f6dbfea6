"""Tests of the version gate (`_versions.py`), each in a fresh interpreter."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_unsupported_version_gives_one_clear_error(monkeypatch):
    from keras.src import version
    from keras_dtensor import _versions

    monkeypatch.setattr(version, "__version__", "3.14.0")
    with pytest.raises(_versions.UnsupportedVersionError) as error:
        _versions.check_supported_versions()
    message = str(error.value)
    assert "keras>=3.15.1,<3.16" in message
    assert "keras-nightly 3.16.0.dev2026102704" in message
    assert "torch>=2.11,<2.16" in message
    assert "keras==3.14.0" in message
    for supported in ("3.15.1", "3.15.2", "3.16.0.dev2026102704"):
        monkeypatch.setattr(version, "__version__", supported)
        _versions.check_supported_versions()
    for unsupported in ("3.16.0", "3.16.0.dev2026102705", "3.17.0.dev1"):
        monkeypatch.setattr(version, "__version__", unsupported)
        with pytest.raises(_versions.UnsupportedVersionError):
            _versions.check_supported_versions()


def test_supported_keras_versions():
    """The range of releases, and the keras-nightly versions outside it
    that the suite was run on, one by one."""
    from keras_dtensor import _versions

    assert _versions.TESTED_KERAS_NIGHTLY == ("3.16.0.dev2026102704",)
    supported = {
        "3.15.0": False,
        "3.15.1": True,
        "3.15.9": True,
        "3.16.0.dev2026102704": True,
        "3.16.0.dev2026102705": False,
        "3.16.0.dev2026010100": False,
        "3.16.0rc1": False,
        "3.16.0": False,
    }
    for version, expected in supported.items():
        assert _versions.keras_version_supported(version) is expected, version
    assert _versions._keras_support_text() == (
        "keras>=3.15.1,<3.16 (or the tested keras-nightly 3.16.0.dev2026102704)"
    )


@pytest.mark.parametrize(
    "torch_version,supported",
    [
        ("2.10.0", False),
        ("2.11.0+cu130", True),
        ("2.13.0+cpu", True),
        ("2.15.0", True),
        ("2.16.0", False),
    ],
)
def test_torch_outside_the_tested_range_is_an_error(
    monkeypatch, torch_version, supported
):
    import torch

    from keras_dtensor import _versions

    monkeypatch.setattr(torch, "__version__", torch_version)
    if supported:
        _versions.check_supported_versions()
        return
    with pytest.raises(_versions.UnsupportedVersionError) as error:
        _versions.check_supported_versions()
    assert f"torch=={torch_version}" in str(error.value)
    assert "torch>=2.11,<2.16" in str(error.value)


def test_pyproject_declares_the_checked_ranges():
    from keras_dtensor import _versions

    with open(os.path.join(REPO, "pyproject.toml")) as f:
        pyproject = f.read()
    for name, supported in (
        ("keras", _versions.SUPPORTED_KERAS),
        ("torch", _versions.SUPPORTED_TORCH),
    ):
        assert f'"{_versions._range_text(name, supported)}"' in pyproject


def test_version_parsing():
    from keras_dtensor import _versions

    assert _versions._version_tuple("2.13.0+cpu") == (2, 13, 0)
    assert _versions._version_tuple("3.16.0.dev2026") == (3, 16, 0)
    assert _versions._version_tuple("3.15.1rc1") == (3, 15, 1)


def test_a_keras_outside_the_range_fails_before_the_overlay(
    tmp_path, monkeypatch
):
    """An untested 3.16 keras meets the version error, not the overlay's
    imports."""
    from keras_dtensor import _finder
    from keras_dtensor import _versions

    package = tmp_path / "keras"
    (package / "src").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "src" / "version.py").write_text(
        '__version__ = "3.16.0.dev2026010100"\n'
    )
    fake = type(sys)("keras")
    fake.__file__ = str(package / "__init__.py")
    monkeypatch.setitem(sys.modules, "keras", fake)
    assert _versions.installed_keras_version() == "3.16.0.dev2026010100"
    with pytest.raises(_versions.UnsupportedVersionError) as error:
        _versions.check_installed_keras_version()
    assert "keras>=3.15.1,<3.16" in str(error.value)
    assert "keras-nightly 3.16.0.dev2026102704" in str(error.value)
    assert "keras==3.16.0.dev2026010100" in str(error.value)
    # The tested nightly passes the check.
    (package / "src" / "version.py").write_text(
        '__version__ = "3.16.0.dev2026102704"\n'
    )
    _versions.check_installed_keras_version()

    checks = []
    finder = _finder.KerasOverlayFinder(
        _finder.overlay_root(), {}, version_check=lambda: checks.append(1)
    )
    # Overlay modules outside the torch backend need no check.
    finder.find_spec("keras.src.distribution.layout_validation")
    assert checks == []
    for _ in range(2):
        spec = finder.find_spec("keras.src.backend.torch.distribution_lib")
        assert spec.origin.endswith("distribution_lib.py")
    assert checks == [1]


def test_the_installed_keras_version_is_read_from_its_source():
    from keras.src.version import __version__
    from keras_dtensor import _versions

    assert _versions.installed_keras_version() == __version__
    _versions.check_installed_keras_version()
