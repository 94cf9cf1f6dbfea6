"""The patch series of `upstream/` stays in step with this checkout.

Applying the series and running the patched keras's tests needs the base
wheel and a virtualenv: `scripts/upstream_patches.sh` does that. These
checks need neither.
"""

import importlib.util
import os
import re

from keras_dtensor import _edits
from keras_dtensor import _keras_hub_edits
from keras_dtensor import _nightly_edits
from keras_dtensor import _saving_edits
from keras_dtensor import _step_edits
from keras_dtensor import _variable_edits

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Edits with no patch of their own, and why.
EDITS_WITHOUT_PATCH = {
    "edit_backend_distribution_lib": "the base's torch backend already "
    "binds its distribution_lib",
    "edit_convert_to_numpy": "the base's convert_to_numpy already gathers a "
    "DTensor",
    "edit_distribution_api_binding": "only for a keras imported before the "
    "mount",
    "edit_renamed_names": "compatibility: in-tree, the modules use the "
    "base's names (RENAMES)",
    "edit_trainer_no_ddp_without_distribution": "compatibility: an option "
    "of the mount (KERAS_DTENSOR_NO_DDP) for tests",
    "edit_causal_lm_generates_on_global_batch": "a change to keras-hub, "
    "not to Keras (UPSTREAMING.md, keras-hub)",
    "edit_preset_loader_creates_loaded_variables_empty": "a change to "
    "keras-hub, not to Keras (UPSTREAMING.md, keras-hub)",
}


def load_series_script():
    path = os.path.join(REPO, "scripts", "upstream_series.py")
    spec = importlib.util.spec_from_file_location("upstream_series", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def edit_names():
    names = set()
    for module in (
        _edits,
        _variable_edits,
        _step_edits,
        _nightly_edits,
        _saving_edits,
        _keras_hub_edits,
    ):
        names.update(n for n in vars(module) if n.startswith("edit_"))
    return names


def test_new_module_patches_hold_this_checkouts_modules():
    assert load_series_script().check() == []


def test_series_lists_every_patch_once():
    series = load_series_script().read_series()
    patches = sorted(
        name
        for name in os.listdir(os.path.join(REPO, "upstream"))
        if name.endswith(".patch")
    )
    assert len(series) == len(set(series))
    assert sorted(series) == patches
    numbers = [int(name.split("-", 1)[0]) for name in series]
    assert numbers == list(range(1, len(series) + 1))


def test_every_edit_is_in_a_patch_or_says_why_not():
    texts = []
    for name in load_series_script().read_series():
        with open(os.path.join(REPO, "upstream", name)) as f:
            texts.append(f.read())
    in_patches = set(re.findall(r"\bedit_[a-z_]+", "\n".join(texts)))
    edits = edit_names()
    missing = edits - in_patches - set(EDITS_WITHOUT_PATCH)
    assert not missing, f"edits in no patch of upstream/: {sorted(missing)}"
    assert set(EDITS_WITHOUT_PATCH) <= edits


def test_upstreaming_links_every_patch():
    with open(os.path.join(REPO, "UPSTREAMING.md")) as f:
        text = f.read()
    unlinked = [
        name
        for name in load_series_script().read_series()
        if f"upstream/{name}" not in text
    ]
    assert not unlinked, f"UPSTREAMING.md does not link {unlinked}"


def test_renames_give_the_bases_names():
    series = load_series_script()
    text = "from keras.src.backend.torch.core import to_torch_dtype\n"
    text += "TorchTrainer._should_torch_compile\n"
    for pattern, replacement in series.RENAMES:
        text = re.sub(pattern, replacement, text, flags=re.MULTILINE)
    assert text == (
        "from keras.src.backend.torch.ops.core import to_torch_dtype\n"
        "Trainer._use_torch_compile\n"
    )
