"""Tests of the mount's start-up: what it costs and when it arms.

Every Python process in an environment with the package installed runs
the `.pth` hook, so the hook must import only the package and
`keras_dtensor._startup` (no standard-library module the interpreter has
not loaded already) and arm the mount only at the first `keras` import.
Each check runs in a fresh interpreter.
"""

import json
import os
import site
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_UP_MODULES = {"keras_dtensor", "keras_dtensor._startup"}
# Loaded only once keras is imported.
MOUNT_MODULES = {"keras_dtensor._finder", "keras_dtensor._edits"}
# The measure is at most 3 ms; the bound leaves room for a busy
# machine.
MAX_STARTUP_US = 15_000


def run(args, code, backend="torch"):
    completed = subprocess.run(
        [sys.executable, *args, "-c", code],
        env=dict(os.environ, KERAS_BACKEND=backend),
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


def importtime_rows(stderr):
    """`-X importtime`'s rows as (depth, name, cumulative microseconds)."""
    rows = []
    for line in stderr.splitlines():
        if not line.startswith("import time:"):
            continue
        _, cumulative, name = line[len("import time:") :].split("|")
        if cumulative.strip().isdigit():
            depth = len(name) - len(name.lstrip())
            rows.append((depth, name.strip(), int(cumulative)))
    return rows


def imported_under(rows, top):
    """The modules `top`'s import loaded, itself included, and its
    cumulative time (a module's row follows those of its imports)."""
    index = [name for _, name, _ in rows].index(top)
    depth, _, cumulative = rows[index]
    names = {top}
    for row_depth, name, _ in reversed(rows[:index]):
        if row_depth <= depth:
            break
        names.add(name)
    return names, cumulative


def start_up(code="pass"):
    """One start-up's importtime rows, modules and meta-path finders."""
    completed = run(
        ["-X", "importtime"],
        f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))\n"
        "print(' '.join(type(f).__name__ for f in sys.meta_path))",
    )
    modules, finders = completed.stdout.strip().splitlines()[-2:]
    rows = importtime_rows(completed.stderr)
    if "keras_dtensor" not in modules.split():
        pytest.skip("keras_dtensor.pth is not installed in this environment")
    return rows, set(modules.split()), finders.split()


def test_startup_imports_only_the_hook():
    rows, modules, finders = start_up()
    names, _ = imported_under(rows, "keras_dtensor")
    assert names == START_UP_MODULES
    assert {m for m in modules if m.startswith("keras")} == START_UP_MODULES
    assert "torch" not in modules
    assert finders[0] == "KerasImportHook"
    assert "KerasOverlayFinder" not in finders


def test_startup_costs_little():
    cumulative = min(
        imported_under(start_up()[0], "keras_dtensor")[1] for _ in range(3)
    )
    assert cumulative < MAX_STARTUP_US


def test_bare_import_adds_only_the_start_up_modules():
    """Without `site` (`-S`), the import adds no standard-library module
    either."""
    completed = run(
        ["-S"],
        f"import json, sys\nsys.path.insert(0, {REPO!r})\n"
        "before = set(sys.modules)\nimport keras_dtensor\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))",
    )
    added = json.loads(completed.stdout.strip().splitlines()[-1])
    assert set(added) == START_UP_MODULES


def test_first_keras_import_arms_the_mount():
    """Names that are not keras's leave the hook waiting; `keras` arms
    the mount, which then serves the overlay."""
    _, modules, finders = start_up(
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('keras_nothing') is None\n"
        "assert type(sys.meta_path[0]).__name__ == 'KerasImportHook'\n"
        "import keras\n"
        "from keras.src.backend.torch import distribution_lib\n"
        f"assert distribution_lib.__file__.startswith({REPO!r})\n"
    )
    assert MOUNT_MODULES <= modules
    assert finders[0] == "KerasOverlayFinder"
    assert finders.count("KerasOverlayFinder") == 1
    assert "KerasImportHook" not in finders


def test_import_after_keras_arms_at_once():
    """Without the `.pth` (`-S`), importing the package after keras arms
    the mount and edits the modules already loaded."""
    path = [*site.getsitepackages(), REPO]
    completed = run(
        ["-S"],
        f"import json, sys\nsys.path[:0] = {path!r}\n"
        "import keras\n"
        "from keras.src.backend.torch import core\n"
        "import keras_dtensor\n"
        "from keras.src.backend.torch import distribution_lib\n"
        "print(json.dumps({"
        "'finders': [type(f).__name__ for f in sys.meta_path],"
        " 'edited': core.Variable._initialize.__module__,"
        " 'overlay': distribution_lib.__file__}))",
    )
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["finders"][0] == "KerasOverlayFinder"
    assert "KerasImportHook" not in result["finders"]
    assert result["edited"] == "keras_dtensor._variable_edits"
    assert result["overlay"].startswith(os.path.join(REPO, "keras") + os.sep)
