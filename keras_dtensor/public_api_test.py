"""Tests of the public surface of `keras_dtensor`: listed, resolvable and
documented, while importing the package stays free of torch and keras.
"""

import inspect
import json
import os
import rlcompleter
import subprocess
import sys

import pytest

import keras_dtensor
from keras_dtensor import _public

PUBLIC_NAMES = sorted(_public.PUBLIC_NAMES)


def test_dir_lists_the_public_names_without_importing_keras():
    # A fresh interpreter: the mount is armed at start-up (the .pth hook),
    # so importing the package and listing it must stay cheap.
    code = (
        "import json, sys\n"
        "import keras_dtensor\n"
        "names = dir(keras_dtensor)\n"
        "print(json.dumps({'names': names,"
        " 'torch': 'torch' in sys.modules, 'keras': 'keras' in sys.modules}))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, KERAS_BACKEND="torch"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["torch"] is False
    assert result["keras"] is False
    missing = [name for name in PUBLIC_NAMES if name not in result["names"]]
    assert not missing
    assert "install" in result["names"]
    assert result["names"] == sorted(set(result["names"]))


def test_tab_completion_offers_the_public_helpers():
    completer = rlcompleter.Completer({"keras_dtensor": keras_dtensor})
    matches = []
    while True:
        match = completer.complete("keras_dtensor.make_", len(matches))
        if match is None:
            break
        matches.append(match)
    assert "keras_dtensor.make_device_mesh(" in matches


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="no_such_helper"):
        keras_dtensor.no_such_helper


def docstring_sections(doc):
    """Maps each section title of a Google-style docstring to its lines."""
    sections = {}
    current = None
    for line in doc.splitlines():
        if line in ("Args:", "Returns:", "Raises:", "Example:"):
            current = sections.setdefault(line[:-1], [])
        elif current is not None and line and not line.startswith(" "):
            current = None
        elif current is not None and line.strip():
            current.append(line)
    return sections


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_public_helper_resolves_and_is_documented(name):
    helper = getattr(keras_dtensor, name)
    assert callable(helper)
    assert helper.__name__ == name
    assert helper.__module__ == _public.PUBLIC_NAMES[name]
    doc = inspect.getdoc(helper)
    assert doc, f"{name} has no docstring"
    sections = docstring_sections(doc)
    assert sections.get("Args"), f"{name}: no Args section"
    assert sections.get("Returns"), f"{name}: no Returns section"
    # Entries sit at the first indent; their continuations deeper.
    documented = {
        line.strip().partition(":")[0]
        for line in sections["Args"]
        if line.startswith("    ") and line[4] != " "
    }
    for parameter in inspect.signature(helper).parameters.values():
        prefix = {
            inspect.Parameter.VAR_POSITIONAL: "*",
            inspect.Parameter.VAR_KEYWORD: "**",
        }.get(parameter.kind, "")
        assert f"{prefix}{parameter.name}" in documented, (
            f"{name}: argument {parameter.name} is not in Args"
        )
    if "raise " in inspect.getsource(helper):
        assert sections.get("Raises"), f"{name} raises: no Raises section"
