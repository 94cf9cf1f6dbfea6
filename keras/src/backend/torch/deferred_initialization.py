"""Variables created by a load get their initial values only if the load
does not write them.

`load_model` and keras-hub's `from_preset` create a model and then
overwrite its variables with the file's values. Creating a sharded
variable shard by shard (`sharded_initialization`) holds one chunk's
working buffers beside the shard, and glibc's allocator keeps freed
buffers of that size resident (its threshold for giving a large block
its own mapping rises as such blocks are freed): on a 1 GiB model,
creating the variables raised each process's peak memory 1.4-1.65x its
shards' size, though the load itself adds almost nothing. Inside
`loading_created_variables()`, such a variable's shard is allocated and
left empty, and its fill (the initializer, run chunk by chunk) is
recorded; a load's write into the shard drops the record
(`note_written`, called by `shard_reads` and
`distribution_lib.assign_to_variable`); when the outermost scope exits,
the shards no load wrote are filled. A variable the file holds is thus
never initialized, and every other one gets exactly the values it gets
outside the scope: only variables whose initializer is stateless are
deferred (Keras's random initializers seeded with an integer, `Zeros`,
`Ones`, a scalar `Constant`; see `sharded_initialization`), so running
it later draws the same values.

Contract: within the scope, a deferred shard's values are unspecified
until the load writes them or the scope ends; the scope is entered only
around creating a model from its config and loading its weights, where
Keras reads variables only symbolically (shapes, on the meta device).
Writes are noted on the thread that entered the scope (Keras loads on
the calling thread). Outside the scope nothing changes.

No collective is issued.
"""

import contextlib
import threading

_state = threading.local()


class _Scope:
    """The shards created empty in one outermost scope, by storage."""

    def __init__(self):
        # Storage address -> (local tensor, fill). The local tensor is held,
        # so that no other live storage has its address.
        self.pending = {}

    def fill_remaining(self):
        """Fills the shards no load wrote, in the order they were made."""
        pending, self.pending = self.pending, {}
        for _, fill in pending.values():
            fill()


@contextlib.contextmanager
def loading_created_variables():
    """Within, sharded variables made shard by shard start empty; on exit
    those the load did not write get their initial values.

    Nested scopes belong to the outermost one.
    """
    if _current() is not None:
        yield
        return
    scope = _Scope()
    _state.scope = scope
    try:
        yield
    finally:
        _state.scope = None
        scope.fill_remaining()


def deferring():
    """Whether variables created now may start empty."""
    return _current() is not None


def defer(local, fill):
    """Records that `fill()` writes the initial values into `local`, this
    process's shard of a variable, unless a load writes it first."""
    if local.numel() == 0:
        return
    _current().pending[_address(local)] = (local, fill)


def note_written(local):
    """A load wrote the whole of `local`: its initial values are not needed."""
    scope = _current()
    if scope is not None and scope.pending and local.numel() > 0:
        scope.pending.pop(_address(local), None)


def _current():
    return getattr(_state, "scope", None)


def _address(local):
    return local.untyped_storage().data_ptr()
