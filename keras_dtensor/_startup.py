"""Start-up hook of the mount: arms it at the first `keras` import.

`keras_dtensor.pth` imports the package at every Python start-up, and the
package puts `KerasImportHook` on `sys.meta_path`; this module imports
nothing but `sys`. The hook answers no import until `keras` or a
`keras.*` name is asked for. Then it leaves `sys.meta_path`, arms the
mount (the version gate, the edits and `KerasOverlayFinder`, placed first)
and returns the spec the finders now give, so that import goes on as if
the mount had been armed all along.
"""

import sys

OVERLAY_FINDER = "KerasOverlayFinder"


def _is_keras(fullname):
    return fullname == "keras" or fullname.startswith("keras.")


def _on_meta_path(*type_names):
    """Whether a finder of one of these type names is on `sys.meta_path`
    (by name: a reloaded module's class is another object)."""
    return any(type(f).__name__ in type_names for f in sys.meta_path)


def _find_spec(fullname, path, target):
    """The spec the finders on `sys.meta_path` give `fullname`."""
    for finder in list(sys.meta_path):
        find_spec = getattr(finder, "find_spec", None)
        spec = None if find_spec is None else find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


class KerasImportHook:
    """Meta-path finder that arms the mount at the first `keras` import.

    Args:
        install: the function that arms the mount (`keras_dtensor.install`).
    """

    def __init__(self, install):
        self._install = install

    def find_spec(self, fullname, path=None, target=None):
        if not _is_keras(fullname):
            return None
        remove()
        self._install()
        return _find_spec(fullname, path, target)


def remove():
    """Takes the start-up hook off `sys.meta_path`, in place."""
    sys.meta_path[:] = [
        f for f in sys.meta_path if type(f).__name__ != "KerasImportHook"
    ]


def arm(install):
    """Arms the mount now if keras is imported, else at its first import.

    Idempotent: with the hook or the mount's finder in place, nothing
    changes.
    """
    if "keras" in sys.modules:
        install()
    elif not _on_meta_path(KerasImportHook.__name__, OVERLAY_FINDER):
        sys.meta_path.insert(0, KerasImportHook(install))
