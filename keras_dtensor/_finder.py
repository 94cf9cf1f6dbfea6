"""Import machinery of the mount: serves this repository's `keras/` modules.

This module is loaded when the mount is armed, at the first `keras` import
(`keras_dtensor._startup`); it imports neither torch nor keras. It defines
the one meta-path finder of the mount, which does two things:

1. It serves the modules of the overlay tree (the `keras/` folder shipped
   with this project) under their in-tree names, e.g.
   `keras.src.backend.torch.distribution_lib`. Only names that exist in the
   overlay are served; everything else comes from the installed keras.
2. After selected upstream keras modules finish executing, it calls the
   post-import edits registered for them (see `keras_dtensor._edits`).

Before it serves the first module of the torch backend's overlay
(`keras.src.backend.torch...`), it runs its version check once: on a keras
it does not support, the import fails with that check's clear error
rather than with whatever the overlay would meet in another keras.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

OVERLAY_PACKAGE = "keras.src"
TORCH_OVERLAY_PACKAGE = "keras.src.backend.torch"

# Upstream modules that a later keras moved: the name the overlay imports
# (keras 3.15.1's) -> the name in that keras. Where the installed keras
# lacks the old name, the moved module gets the old name's edits when it
# executes (before its package re-exports its names), and the old name is
# served as the moved module.
MOVED_MODULES = {
    "keras.src.backend.torch.core": "keras.src.backend.torch.ops.core",
}


def overlay_root():
    """Returns the folder that holds the overlay's `src/` tree."""
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (
        os.path.join(here, "_overlay", "keras"),
        os.path.join(os.path.dirname(here), "keras"),
    ):
        if os.path.isdir(os.path.join(candidate, "src")):
            return candidate
    return None


def _moved_from(fullname):
    """The 3.15.1 name of a module a later keras moved to `fullname`."""
    for old, new in MOVED_MODULES.items():
        if new == fullname:
            return old
    return None


class _EditingLoader(importlib.abc.Loader):
    """Runs the upstream loader, then the edits registered for the module."""

    def __init__(self, loader, edits):
        self._loader = loader
        self._edits = edits

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for edit in self._edits:
            edit(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _AliasLoader(importlib.abc.Loader):
    """Loads a module name as another, importable, module."""

    def __init__(self, target):
        self._target = target

    def create_module(self, spec):
        return importlib.import_module(self._target)

    def exec_module(self, module):
        pass


class KerasOverlayFinder(importlib.abc.MetaPathFinder):
    """Serves overlay modules and applies post-import edits to upstream ones.

    Args:
        root: folder holding the overlay `keras/` tree (the one with `src/`).
        post_import_edits: dict mapping a module name to a callable that
            returns the list of edits (functions taking the module) to
            apply once that module has executed.
        version_check: a function run once, before the first torch
            backend overlay module is served; it raises on an unsupported
            keras. None: no check.
    """

    def __init__(self, root, post_import_edits, version_check=None):
        self._root = root
        self._post_import_edits = post_import_edits
        self._version_check = version_check

    def _overlay_file(self, fullname):
        if not fullname.startswith(OVERLAY_PACKAGE + ".") or not self._root:
            return None
        relative = fullname.split(".")[1:]
        path = os.path.join(self._root, *relative) + ".py"
        return path if os.path.isfile(path) else None

    def find_spec(self, fullname, path=None, target=None):
        overlay_file = self._overlay_file(fullname)
        if overlay_file is not None:
            if fullname.startswith(TORCH_OVERLAY_PACKAGE + "."):
                self._check_version_once()
            return importlib.util.spec_from_file_location(
                fullname, overlay_file
            )
        edits_for = self._post_import_edits.get(fullname)
        moved = MOVED_MODULES.get(fullname)
        moved_from = _moved_from(fullname)
        if edits_for is None and moved is None and moved_from is None:
            return None
        spec = self._find_upstream_spec(fullname, path, target)
        if spec is None and moved is not None:
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(moved))
        if edits_for is None and moved_from is not None:
            if not self._has_upstream_module(moved_from):
                edits_for = self._post_import_edits.get(moved_from)
        if edits_for is None:
            return spec
        if spec is None or spec.loader is None:
            return spec
        edits = edits_for()
        if edits:
            spec.loader = _EditingLoader(spec.loader, edits)
        return spec

    def _check_version_once(self):
        check = self._version_check
        if check is not None:
            check()
            self._version_check = None

    def _has_upstream_module(self, fullname):
        """Whether the installed package has `fullname` (its parent is
        imported: it is the moved module's package or an ancestor)."""
        parent = sys.modules.get(fullname.rpartition(".")[0])
        path = getattr(parent, "__path__", None)
        if path is None:
            return False
        return self._find_upstream_spec(fullname, path, None) is not None

    def _find_upstream_spec(self, fullname, path, target):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None


def installed_finder():
    """Returns the finder already on `sys.meta_path`, if any."""
    for finder in sys.meta_path:
        if type(finder).__name__ == KerasOverlayFinder.__name__:
            return finder
    return None
