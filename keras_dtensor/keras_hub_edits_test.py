"""Single-process tests of `keras_dtensor._keras_hub_edits` that need no
keras-hub: the preset loader's edit on a stand-in module.

`from_preset` under a distribution on 4 processes (the file's values, no
initializer run for what the preset holds) is tested in
`integration_tests/sliced_loading_test.py`.
"""

import types

import pytest

from keras.src.backend.torch import deferred_initialization
from keras_dtensor import _edit_support
from keras_dtensor import _keras_hub_edits


def preset_utils_with_loader():
    """A stand-in for `keras_hub.src.utils.preset_utils`: its loader's
    methods return whether a load scope was active when they ran."""

    class KerasPresetLoader:
        def load_backbone(self, cls, load_weights, **kwargs):
            return deferred_initialization.deferring()

        def load_task(self, cls, load_weights, load_task_weights, **kwargs):
            return deferred_initialization.deferring()

    return types.SimpleNamespace(KerasPresetLoader=KerasPresetLoader)


@pytest.mark.parametrize("distributed", [True, False])
@pytest.mark.parametrize("load_weights", [True, False])
def test_preset_loads_create_variables_empty(
    monkeypatch, distributed, load_weights
):
    distribution = object() if distributed else None
    monkeypatch.setattr(
        _edit_support, "distribution_accessor", lambda: lambda: distribution
    )
    module = preset_utils_with_loader()
    _keras_hub_edits.edit_preset_loader_creates_loaded_variables_empty(module)
    loader = module.KerasPresetLoader()
    expected = distributed and load_weights
    assert loader.load_backbone(None, load_weights, dtype=None) is expected
    assert loader.load_task(None, load_weights, True) is expected
    assert not deferred_initialization.deferring()


def test_a_keras_hub_without_the_loader_is_left_alone():
    module = types.SimpleNamespace()
    _keras_hub_edits.edit_preset_loader_creates_loaded_variables_empty(module)
    assert vars(module) == {}
