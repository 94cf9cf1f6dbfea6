"""keras-dtensor: Keras 3's `keras.distribution` API on the PyTorch backend.

Importing this package (or starting Python with the package installed, via
`keras_dtensor.pth`) arms the mount: the modules of this project's `keras/`
tree are served under their in-tree `keras.src...` names, and a few small,
named edits are applied to upstream keras modules as they are imported.
Nothing here imports torch or keras; the edits only act under the torch
backend.
"""

import importlib
import sys

from keras_dtensor import _finder

__version__ = "0.1.0"


def install():
    """Arms the mount. Idempotent: a second call changes nothing."""
    if _finder.installed_finder() is not None:
        return
    edits = importlib.import_module("keras_dtensor._edits")
    finder = _finder.KerasOverlayFinder(
        _finder.overlay_root(),
        edits.POST_IMPORT_EDITS,
        version_check=edits.check_installed_keras_version,
    )
    sys.meta_path.insert(0, finder)
    edits.apply_to_loaded_modules()


def __getattr__(name):
    """Exposes the public helpers lazily, without importing keras early."""
    public = importlib.import_module("keras_dtensor._public")
    if name in public.PUBLIC_NAMES:
        return public.resolve(name)
    raise AttributeError(f"module 'keras_dtensor' has no attribute {name!r}")


def __dir__():
    """Lists the module's names and the public helpers it serves lazily.

    Used by `dir(keras_dtensor)` and tab completion; lists the helpers
    without importing them, so neither keras nor torch is imported.
    """
    public = importlib.import_module("keras_dtensor._public")
    return sorted(set(globals()) | set(public.PUBLIC_NAMES))


install()
