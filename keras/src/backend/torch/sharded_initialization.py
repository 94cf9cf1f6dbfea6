"""Creating a sharded variable shard by shard.

Without this, every process computes the full value of a variable from the
shared seed and keeps its slice of it: a large embedding is built in full
(with the initializer's temporaries, several times over) on every device.
Here a process runs the variable's initializer on bounded chunks of rows,
keeps the part of each chunk in its shard, and never holds more than its
shard plus one chunk's working buffer. Called by `keras_dtensor`'s
`Variable._initialize_with_initializer` edit, for a variable with a
layout, through `distribution_lib.initialize_variable_shard`.

Inside `deferred_initialization.loading_created_variables()` (a load
creating a model), the shard is allocated empty and filled only if the
load does not write it, then from the full value where its dtype is not
float32; other dtypes are deferred so too.

Contract: the values are bit-identical to the full path's (`_ChunkedDraws`,
`_RandomStream`). That holds for Keras's random initializers seeded with
an integer, and for `Zeros`, `Ones` and `Constant`, with float32
variables on CPU. Anything else takes the full path
(`initialize_variable_shard` returns `None`; see `_why_not_splittable`),
which is logged once at INFO per initializer class. Small variables take
the full path too.

No collective is issued: each process reads the same random stream.
"""

import logging
import math

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from keras.src.backend.common.variables import standardize_dtype
from keras.src.backend.torch import deferred_initialization
from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch.created_tensors import replicating_created_tensors
from keras.src.backend.torch.torch_internals import (
    compute_local_shape_and_global_offset,
)

# Output bytes of one chunk of rows: the working buffer's scale.
CHUNK_BYTES = 4 * 1024 * 1024
# Random values drawn and dropped at once when skipping rows of the stream.
_SKIP_VALUES = 1024 * 1024
# Normal values are drawn from uniform ones in groups of this many. The
# draw's rows come from one generator that advances through the variable's
# random stream in order, as the full draw would (on CPU, torch draws
# uniform values one after another, and normal values in groups of 16 from
# them, so a stream read in pieces of whole groups gives the same values).
_NORMAL_GROUP = 16

_FACTORIES = (torch.empty, torch.zeros, torch.ones, torch.full)
_logged_fallbacks = set()
logger = logging.getLogger(__name__)


def initialize_variable_shard(initializer, shape, dtype, layout):
    """This process's shard of a new variable, created chunk by chunk.

    Args:
        initializer: the variable's initializer (a callable).
        shape: the variable's full shape.
        dtype: the variable's torch dtype.
        layout: the variable's `DTensorLayout`.

    Returns:
        A DTensor in `layout` holding the values the full initialization
        would give, or `None` where the variable takes the full path.
    """
    deferring = deferred_initialization.deferring()
    # A deferred shard a load does not write is filled from the full value
    # where chunks are not bit-exact (`_fill_later`): any dtype will do.
    reason = _why_not_splittable(
        initializer, shape, dtype, layout, any_dtype=deferring
    )
    if reason is not None:
        _log_fallback(initializer, shape, reason)
        return None
    local_shape, offset = compute_local_shape_and_global_offset(
        shape, layout.mesh, layout.placements
    )
    local = torch.empty(local_shape, dtype=dtype)
    if deferring:
        # A load is creating the variable: it will most likely overwrite
        # the shard, so the initializer runs only if it does not.
        deferred_initialization.defer(
            local, lambda: _fill_later(local, initializer, shape, offset)
        )
    else:
        try:
            _fill_shard(local, initializer, shape, offset)
        except _NotSplittable as error:
            _log_fallback(initializer, shape, str(error))
            return None
    return DTensor.from_local(
        local,
        layout.mesh,
        layout.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=dtensor_layouts.contiguous_strides(shape),
    )


def _fill_shard(local, initializer, shape, offset):
    """Writes the shard at `offset` into `local`, a chunk of rows at a time."""
    block = tuple(
        slice(start, start + size)
        for start, size in zip(offset[1:], local.shape[1:])
    )
    draws = _ChunkedDraws(tuple(shape))
    rows_per_chunk = max(1, CHUNK_BYTES // (_row_count(shape) * 4))
    first, stop = offset[0], offset[0] + local.shape[0]
    for start in range(first, stop, rows_per_chunk):
        end = min(start + rows_per_chunk, stop)
        rows = draws.run(
            initializer, standardize_dtype(local.dtype), start, end
        )
        local[start - first : end - first] = rows[(slice(None), *block)]


def _fill_later(local, initializer, shape, offset):
    """Writes the shard at `offset` into `local` after its creation: chunk
    by chunk (float32), or from the full value, as the full path would
    have (other dtypes, or where a chunk cannot stand in for the whole;
    the initializer is stateless: `_why_not_splittable` let it through).
    """
    try:
        if local.dtype != torch.float32:
            raise _NotSplittable(f"dtype {local.dtype}")
        _fill_shard(local, initializer, shape, offset)
    except _NotSplittable as error:
        _log_fallback(initializer, shape, str(error))
        full = torch.as_tensor(
            initializer(shape, dtype=standardize_dtype(local.dtype))
        )
        block = tuple(
            slice(start, start + size)
            for start, size in zip(offset, local.shape)
        )
        local.copy_(full[block])


def _why_not_splittable(initializer, shape, dtype, layout, any_dtype=False):
    """Why the variable takes the full path, or `None` if it need not
    (with `any_dtype`, whatever its dtype)."""
    if not any(p.is_shard() for p in layout.placements):
        return "replicated"
    # Small variables take the full path: one chunk is the whole variable.
    if len(shape) == 0 or math.prod(shape) * 4 <= CHUNK_BYTES:
        return "small"
    # CUDA's generator does not split into pieces as CPU's does.
    if layout.mesh.device_type != "cpu":
        return f"the {layout.mesh.device_type} generator"
    if dtype != torch.float32 and not any_dtype:
        return f"dtype {dtype}"
    if replicating_created_tensors():
        return "created inside a distributed step"
    # E.g. an initializer that mixes rows, such as `Orthogonal`.
    if not _splits_into_rows(initializer):
        return f"initializer {type(initializer).__name__}"
    # Seeded with an integer (a seed of `None` is drawn as one).
    if not isinstance(getattr(initializer, "seed", 0), int):
        return "a SeedGenerator seed"
    return None


def _splits_into_rows(initializer):
    """Whether `initializer` computes each row of its value independently."""
    # Imported here: the backend's modules load before the initializers.
    from keras.src import initializers

    if isinstance(initializer, initializers.Constant):
        # Keras documents a scalar; an array would not split into rows.
        return (
            type(initializer).__call__ is initializers.Constant.__call__
            and np.ndim(initializer.value) == 0
        )
    # Initializer classes whose values split into rows exactly, as long as
    # `__call__` is theirs (a subclass with its own may mix rows): normal,
    # uniform, truncated normal and the variance-scaling family (Glorot,
    # He, LeCun). Everything such an initializer does besides its one random
    # draw is elementwise on its rows.
    splittable = (
        initializers.RandomNormal,
        initializers.RandomUniform,
        initializers.TruncatedNormal,
        initializers.VarianceScaling,
        initializers.Zeros,
        initializers.Ones,
    )
    for base in splittable:
        if isinstance(initializer, base):
            return type(initializer).__call__ is base.__call__
    return False


def _log_fallback(initializer, shape, reason):
    """Logs once per initializer class that a large variable is built whole."""
    if reason in ("replicated", "small"):
        return
    key = (type(initializer).__name__, reason)
    if key in _logged_fallbacks:
        return
    _logged_fallbacks.add(key)
    logger.info(
        "A variable of shape %s (%.1f MiB in float32) initialized by %s is "
        "computed in full on every process, then sliced (%s): creation "
        "holds one such full value at a time beside the shards. Only "
        "Keras's random, zeros, ones and constant initializers of float32 "
        "variables on CPU are created shard by shard.",
        tuple(shape),
        math.prod(shape) * 4 / 2**20,
        type(initializer).__name__,
        reason,
    )


def _row_count(shape):
    """Elements in one row (index of the first dimension) of `shape`."""
    return math.prod(shape[1:])


class _NotSplittable(Exception):
    """The initializer did something a chunk cannot stand in for."""


class _ChunkedDraws(TorchFunctionMode):
    """Runs an initializer with its rows limited to one chunk.

    While the initializer runs, its random draw whose shape starts with the
    variable's shape (`torch.rand`, `torch.normal`), and the factories of
    such a shape, give only the rows of the current chunk. The draw's
    values come from a `_RandomStream` made from the generator of the
    first chunk's draw, read in order across chunks.
    """

    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        self.stream = None
        self.rows = None
        self.draws = 0

    def run(self, initializer, dtype, start, end):
        """The initializer's rows `start:end` of the variable."""
        self.rows = (start, end)
        self.draws = 0
        # The initializer runs with the variable's full shape (its fans and
        # scales are those of the variable); this mode is active only while
        # it runs.
        with self:
            value = initializer(self.shape, dtype=dtype)
        if self.draws > 1 or tuple(value.shape) != self._chunk(self.shape):
            raise _NotSplittable(type(initializer).__name__)
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.rand, torch.normal) and "generator" in kwargs:
            return self._draw(func, args, kwargs)
        if func in _FACTORIES:
            size = _factory_size(args, kwargs)
            if size is not None and size[: len(self.shape)] == self.shape:
                return self._factory(func, size, args, kwargs)
        return func(*args, **kwargs)

    def _chunk(self, size):
        """`size` with its first dimension cut to the current rows."""
        start, end = self.rows
        return (end - start, *size[1:])

    def _draw(self, func, args, kwargs):
        size = tuple(kwargs["size"])
        if size[: len(self.shape)] != self.shape:
            return func(*args, **kwargs)
        self.draws += 1
        if self.stream is None:
            self.stream = _RandomStream(func, args, kwargs)
        row = _row_count(size)
        start, end = self.rows
        values = self.stream.take(start * row, end * row)
        return values.reshape(self._chunk(size))

    def _factory(self, func, size, args, kwargs):
        kwargs = dict(kwargs, size=self._chunk(size))
        if func is torch.full:
            fill = args[1] if len(args) > 1 else kwargs.pop("fill_value")
            kwargs["fill_value"] = fill
        return func(**kwargs)


def _factory_size(args, kwargs):
    """The size a factory call asks for, as a tuple, or `None`."""
    if "size" in kwargs:
        return tuple(kwargs["size"])
    if not args:
        return None
    first = args[0]
    if isinstance(first, (tuple, list, torch.Size)):
        return tuple(first)
    if isinstance(first, int):
        return tuple(a for a in args if isinstance(a, int))
    return None


class _RandomStream:
    """The values of one random draw, read in order, a piece at a time.

    `take(start, stop)` returns the flat values `start:stop` of the draw
    the initializer asked for, exactly as the whole draw gives them. Pieces
    are read in increasing order; values before a piece are drawn and
    dropped, at most `_SKIP_VALUES` at a time.

    Torch draws a normal tensor of `n` values (float32, CPU, `n >= 16`) as
    `n` uniform values, turned into normal ones in groups of 16; when `n`
    is not a multiple of 16, it then draws 16 more uniform values and
    recomputes the last 16 values from them. The stream does the same,
    and holds back the values that the last step overwrites until it ran.
    """

    def __init__(self, func, args, kwargs):
        self.generator = kwargs["generator"]
        self.numel = math.prod(kwargs["size"])
        self.dtype = kwargs.get("dtype")
        self.normal = func is torch.normal
        self.mean, self.std = (args[0], args[1]) if self.normal else (0, 1)
        self.grouped = self.numel // _NORMAL_GROUP * _NORMAL_GROUP
        self.tail_done = not self.normal or self.grouped == self.numel
        # Values drawn so far; the last of them, not yet taken, are kept.
        self.drawn = 0
        self.values = torch.empty(0, dtype=self.dtype)

    def take(self, start, stop):
        if start < self._first():
            raise _NotSplittable("rows read out of order")
        while self._final_end() < stop:
            self._drop_before(start)
            self._draw_next()
        self._drop_before(start)
        taken = self.values[: stop - start]
        self._drop_before(stop)
        return taken

    def _first(self):
        """The position of `self.values[0]` in the draw."""
        return self.drawn - self.values.numel()

    def _final_end(self):
        """Values before this position are final."""
        if self.tail_done:
            return self.drawn
        return min(self.drawn, self.numel - _NORMAL_GROUP)

    def _drop_before(self, position):
        cut = min(max(position - self._first(), 0), self.values.numel())
        self.values = self.values[cut:]

    def _draw_next(self):
        """Draws the next block of values (or the normal draw's last 16)."""
        limit = self.grouped if self.normal else self.numel
        if self.drawn < limit:
            count = min(_SKIP_VALUES, limit - self.drawn)
            block = self._draw_values(self.normal, count)
            self.values = torch.cat([self.values, block])
            self.drawn += count
        elif not self.tail_done:
            self._redraw_tail()
        else:
            raise _NotSplittable("read past the end of the draw")

    def _redraw_tail(self):
        """The last 16 normal values, as torch recomputes them."""
        self._draw_values(False, self.numel - self.grouped)
        tail = self._draw_values(True, _NORMAL_GROUP)
        tail_start = self.numel - _NORMAL_GROUP
        keep = max(tail_start - self._first(), 0)
        skip = max(self._first() - tail_start, 0)
        self.values = torch.cat([self.values[:keep], tail[skip:]])
        self.drawn = self.numel
        self.tail_done = True

    def _draw_values(self, normal, count):
        """`count` normal (else uniform) values from the generator."""
        if normal:
            return torch.normal(
                self.mean,
                self.std,
                size=(count,),
                generator=self.generator,
                dtype=self.dtype,
            )
        return torch.rand(
            size=(count,), generator=self.generator, dtype=self.dtype
        )
