"""Post-import edits for saving and loading under a distribution.

Like `keras_dtensor._edits`, each edit is one small function applied to an
upstream module after it executes, only under the torch backend; this
module imports neither torch nor keras at module level.
"""

# Upstream module name -> function returning the edits for that module.
POST_IMPORT_EDITS = {}
