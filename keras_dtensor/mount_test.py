"""Tests of the mount: idempotence and scope.

The start-up hook's cost and arming are `startup_test.py`'s; the version
gate's, `versions_test.py`'s; keras-nightly's edits', `nightly_edits_test.py`'s.

Each check runs in a fresh interpreter, since the mount acts at start-up
and on first import of keras.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, backend="torch"):
    env = dict(os.environ, KERAS_BACKEND=backend)
    completed = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_startup_hook_imports_neither_torch_nor_keras():
    result = run_python(
        "import json, sys\n"
        "names = [type(f).__name__ for f in sys.meta_path]\n"
        "print(json.dumps({'armed': 'KerasImportHook' in names,"
        " 'torch': 'torch' in sys.modules, 'keras': 'keras' in sys.modules}))"
    )
    assert result == {"armed": True, "torch": False, "keras": False}


def test_import_is_idempotent():
    result = run_python(
        "import json, sys, importlib\n"
        "import keras_dtensor\n"
        "keras_dtensor.install(); keras_dtensor.install()\n"
        "importlib.reload(keras_dtensor)\n"
        "import keras\n"
        "count = sum(type(f).__name__ == 'KerasOverlayFinder'"
        " for f in sys.meta_path)\n"
        "from keras.src.backend.torch import core\n"
        "init = core.Variable._initialize\n"
        "wrapped = [c.cell_contents for c in init.__closure__"
        " if hasattr(c.cell_contents, '__code__')]\n"
        "print(json.dumps({'finders': count,"
        " 'edited_once': [w.__module__ for w in wrapped],"
        " 'module': init.__module__, 'core': core.__name__}))"
    )
    assert result["finders"] == 1
    assert result["module"] == "keras_dtensor._variable_edits"
    # The edit wraps upstream's method itself, not an earlier edit; a later
    # keras moved the module (served under the old name, MOVED_MODULES).
    assert result["core"] in (
        "keras.src.backend.torch.core",
        "keras.src.backend.torch.ops.core",
    )
    assert result["edited_once"] == [result["core"]]


@pytest.fixture(scope="module")
def plain_torch_session():
    """What one fresh torch-backend process reports after importing keras
    (the overlay module and what it is bound to) and using a Dense layer
    with no distribution set."""
    return run_python(
        "import json\n"
        "import keras, torch\n"
        "from keras.src import backend\n"
        "from keras.src.backend.torch import distribution_lib\n"
        "layer = keras.layers.Dense(2)\n"
        "layer.build((None, 3))\n"
        "value = layer.kernel.value\n"
        "layer.kernel.assign(keras.ops.ones((3, 2)))\n"
        "print(json.dumps({'file': distribution_lib.__file__,"
        " 'bound': backend.distribution_lib is distribution_lib,"
        " 'keras': keras.__file__,"
        " 'type': type(value).__name__,"
        " 'param': isinstance(value, torch.nn.Parameter),"
        " 'sum': float(layer.kernel.numpy().sum())}))"
    )


def test_overlay_modules_are_served_from_this_repo(plain_torch_session):
    result = plain_torch_session
    assert result["bound"]
    overlay = os.path.realpath(result["file"])
    assert overlay.endswith(
        os.path.join("keras", "src", "backend", "torch", "distribution_lib.py")
    )
    # keras itself is the installed one, never this repo's `keras/` tree.
    overlay_tree = os.path.join(REPO, "keras") + os.sep
    assert not os.path.realpath(result["keras"]).startswith(overlay_tree)


def test_keras_tree_has_no_init_files():
    for root, _, files in os.walk(os.path.join(REPO, "keras")):
        assert "__init__.py" not in files, root


def test_other_backends_are_untouched(monkeypatch):
    """Every edit of a backend-independent module is inert off torch."""
    import types

    from keras.src.backend import config
    from keras_dtensor import _step_edits
    from keras_dtensor import _variable_edits

    monkeypatch.setattr(config, "backend", lambda: "jax")
    module = types.SimpleNamespace(distribution_lib=None)
    _variable_edits.edit_backend_distribution_lib(module)
    _variable_edits.edit_distribution_api_binding(module)
    assert module.distribution_lib is None

    class TensorLayout:
        def _validate_axes(self):
            return "upstream"

    module.TensorLayout = TensorLayout
    _variable_edits.edit_tensor_layout_multi_axis(module)
    assert TensorLayout._validate_axes(None) == "upstream"

    def get_data_adapter(x):
        return "upstream"

    module.get_data_adapter = get_data_adapter
    _step_edits.edit_data_adapter_auto_shard(module)
    assert module.get_data_adapter is get_data_adapter


@pytest.mark.skipif(
    importlib.util.find_spec("jax") is None, reason="jax is not installed"
)
def test_jax_backend_is_untouched():
    result = run_python(
        "import json\n"
        "import keras\n"
        "from keras.src import backend as b\n"
        "from keras.src.distribution import distribution_lib as d\n"
        "try:\n"
        "    from keras.src.backend.jax import core\n"
        "except ImportError:\n"
        "    from keras.src.backend.jax.ops import core\n"
        "print(json.dumps({'lib': b.distribution_lib.__name__,"
        " 'variable': core.Variable._initialize.__module__,"
        " 'core': core.__name__,"
        " 'validate': d.TensorLayout._validate_axes.__module__}))",
        backend="jax",
    )
    # A later keras moved the jax core module to `jax.ops.core`.
    assert result["core"] in (
        "keras.src.backend.jax.core",
        "keras.src.backend.jax.ops.core",
    )
    assert result == {
        "lib": "keras.src.backend.jax.distribution_lib",
        "variable": result["core"],
        "core": result["core"],
        "validate": "keras.src.distribution.distribution_lib",
    }


def test_torch_without_distribution_creates_plain_parameters(
    plain_torch_session,
):
    result = {
        name: plain_torch_session[name] for name in ("type", "param", "sum")
    }
    assert result == {"type": "Parameter", "param": True, "sum": 6.0}


def test_upstreaming_lists_every_edit():
    """UPSTREAMING.md is the upstream patch: every edit is in it."""
    from keras_dtensor import _edits

    with open(os.path.join(REPO, "UPSTREAMING.md")) as f:
        upstreaming = f.read()
    names = {
        edit.__name__
        for edits_for in _edits.POST_IMPORT_EDITS.values()
        for edit in edits_for()
    }
    assert "edit_loss_call_runs_batch_local" in names
    missing = sorted(n for n in names if f"`{n}`" not in upstreaming)
    assert missing == []
