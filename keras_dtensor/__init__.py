"""keras-dtensor: Keras 3's `keras.distribution` API on the PyTorch backend.

The mount serves the modules of this project's `keras/` tree under their
in-tree `keras.src...` names and applies a few small, named edits to
upstream keras modules as they are imported. Starting Python with the
package installed (via `keras_dtensor.pth`) or importing it only puts a
hook on `sys.meta_path` (`_startup`, which imports nothing but `sys`);
the mount is armed at the first `keras` import, or at once where keras
is already imported. Nothing here imports torch or keras; the edits only
act under the torch backend.
"""

import sys

from keras_dtensor import _startup

__version__ = "0.1.0"


def install():
    """Arms the mount now. Idempotent: a second call changes nothing."""
    _startup.remove()
    from keras_dtensor import _finder

    if _finder.installed_finder() is not None:
        return
    from keras_dtensor import _edits
    from keras_dtensor import _versions

    finder = _finder.KerasOverlayFinder(
        _finder.overlay_root(),
        _edits.POST_IMPORT_EDITS,
        version_check=_versions.check_installed_keras_version,
    )
    sys.meta_path.insert(0, finder)
    _edits.apply_to_loaded_modules()


def __getattr__(name):
    """Exposes the public helpers lazily, without importing keras early."""
    if not name.startswith("_"):
        from keras_dtensor import _public

        if name in _public.PUBLIC_NAMES:
            return _public.resolve(name)
    raise AttributeError(f"module 'keras_dtensor' has no attribute {name!r}")


def __dir__():
    """Lists the module's names and the public helpers it serves lazily.

    Used by `dir(keras_dtensor)` and tab completion; lists the helpers
    without importing them, so neither keras nor torch is imported.
    """
    from keras_dtensor import _public

    return sorted(set(globals()) | set(_public.PUBLIC_NAMES))


_startup.arm(install)
