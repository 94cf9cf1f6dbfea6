"""Names re-exported from `keras_dtensor`, resolved on first access."""

import importlib

# Public name -> in-tree module that defines it.
PUBLIC_NAMES = {}


def resolve(name):
    """Imports and returns the public object `name`."""
    module = importlib.import_module(PUBLIC_NAMES[name])
    return getattr(module, name)
