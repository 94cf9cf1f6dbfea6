"""Tensors created inside a distributed step, as replicated DTensors.

Inside a distributed step every tensor computed from the inputs and the
variables is a DTensor; the others are created from Python values alone.
`replicate_created_tensors` makes those replicated DTensors as they are
created, with a torch function mode, and works around the DTensor
limitations a Keras step meets: each torch function with a handler in
`_HANDLERS` goes to it. The handlers live in modules of one concern each
(`creation_handlers`, `argument_layouts`, `sharded_lookups`,
`local_rows`, `in_place_writes`, `extreme_reductions`, `python_values`,
`split_class_losses`),
whose docstrings say which limitation each works around and why
`implicit_replication` is not enough; a lookup result is reduced as it
is made (`sharded_lookups.reduce_lookup_result`).

This module holds the scope and its per-thread state: the step's context
(`replicate_created_tensors`), a layer build's (`replicate_built_tensors`),
the mode's suspension (`suspended`) and the draw count (`draw_count`).

Collectives: those of the handlers and of the lookup reduction, all
inside the step, on every process alike; entering and leaving the
contexts issues none.
"""

import contextlib
import threading

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.overrides import TorchFunctionMode

from keras.src.backend.torch import argument_layouts
from keras.src.backend.torch import creation_handlers
from keras.src.backend.torch import extreme_reductions
from keras.src.backend.torch import in_place_writes
from keras.src.backend.torch import local_replays
from keras.src.backend.torch import local_rows
from keras.src.backend.torch import python_values
from keras.src.backend.torch import sharded_lookups
from keras.src.backend.torch import split_class_losses
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import torch_runtime
from keras.src.backend.torch.dtensor_layouts import dtensor_from_spec
from keras.src.backend.torch.local_layouts import recorded_local_layouts
from keras.src.backend.torch.sharded_lookups import reduce_lookup_result
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import MaskPartial
from keras.src.backend.torch.torch_internals import TensorMeta

# The contexts' state, per thread (as torch function modes are), read
# with `getattr` defaults: `active` (whether `replicate_created_tensors`
# is active, False while `suspended`), `mode` (its mode while open),
# `build_mode` (the mode of `replicate_built_tensors`) and `draws`
# (`draw_count`). Not a `threading.local` subclass with class defaults:
# Dynamo, which traces these reads in compiled steps (a layer call's
# `replicating_created_tensors()`), guards such an attribute on the
# class's value, and did not recompile when the thread's value changed
# (torch 2.13).
_STATE = threading.local()


@contextlib.contextmanager
def replicate_created_tensors(device_mesh, compiled=False):
    """Makes tensors created inside the context replicated DTensors.

    Inside a distributed step, every tensor computed from the (distributed)
    inputs and variables is a DTensor. The others are created from Python
    values alone: masks from `ops.arange`, constants from
    `convert_to_tensor`, random values from a seed. All processes run the
    same program with the same seed, so such a tensor is identical on every
    process; in this context it becomes a DTensor replicated on
    `device_mesh` as it is created, and meets other DTensors as one.

    Dropout applied to a DTensor draws its mask for the global shape from
    the (shared) torch generator, so that, as on JAX, processes of one
    model replica use the same mask and data-parallel shards use different
    parts of it. DTensor does that itself on meshes whose device has an
    offset-based generator (CUDA); on CPU it would draw each shard's mask
    from the same generator state.

    The context does not nest, and is per thread, as torch function modes
    are.

    Args:
        device_mesh: the Keras `DeviceMesh` of the distribution.
        compiled: whether the code run inside is compiled with
            `torch.compile`, which then traces the mode too (see
            `_CompiledReplicateCreatedTensors`).
    """
    if replicating_created_tensors():
        yield
        return
    _STATE.active = True
    try:
        mode_class = (
            _CompiledReplicateCreatedTensors
            if compiled
            else _ReplicateCreatedTensors
        )
        with recorded_local_layouts():
            with mode_class(device_mesh.backend_mesh) as mode:
                _STATE.mode = mode
                yield
    finally:
        _STATE.active = False
        _STATE.mode = None


@contextlib.contextmanager
def replicate_built_tensors(device_mesh):
    """Makes the tensors a layer's `build` creates from Python values
    replicated DTensors.

    A layer may make constants from its arguments when it is built:
    `Normalization(mean=..., variance=...)` converts them to tensors, which
    its call then combines with its (distributed) inputs. Made from Python
    values by the same program on every process, such tensors are
    identical on every process, as the ones `replicate_created_tensors`
    replicates inside a step: in this context they become replicated
    DTensors as they are created, with the same torch function mode.
    Variables are created as outside it (`creating_variable`), and tensors
    computed from plain tensors stay plain.

    Inside a step, whose context replicates already, and inside another
    build, the context does nothing; it is per thread. It is not a step's
    context: `replicating_created_tensors()` stays False in it.

    Args:
        device_mesh: the Keras `DeviceMesh` of the distribution.
    """
    if replicating_created_tensors() or _build_mode() is not None:
        yield
        return
    mode = _ReplicateCreatedTensors(device_mesh.backend_mesh)
    _STATE.build_mode = mode
    try:
        with mode:
            yield
    finally:
        _STATE.build_mode = None


def creating_variable():
    """A context in which a variable's value is computed as outside any
    build: the mode of `replicate_built_tensors` is off inside it, so that
    initializers run as they run outside a build (sharded variables shard
    by shard, `sharded_initialization`). Elsewhere it does nothing."""
    mode = _build_mode()
    if mode is None or torch_runtime.current_function_mode() is not mode:
        return contextlib.nullcontext()
    return torch_runtime.function_mode_popped()


def _build_mode():
    """The mode of the active `replicate_built_tensors`, or None."""
    return getattr(_STATE, "build_mode", None)


def replicating_created_tensors():
    """Whether `replicate_created_tensors` is active."""
    return getattr(_STATE, "active", False)


def in_step_context():
    """Whether `replicate_created_tensors` is open on this thread, even
    where a local call has `suspended` its mode."""
    return getattr(_STATE, "mode", None) is not None


def current_mode():
    """The mode of `replicate_created_tensors`, if it is the innermost one.

    None outside the context, and where another torch function mode was
    entered inside it.
    """
    if not replicating_created_tensors():
        return None
    mode = _STATE.mode
    if torch_runtime.current_function_mode() is not mode:
        return None
    return mode


def current_call():
    """The torch call the step's mode is running on this thread, as
    `(func, args)` (None outside a step)."""
    mode = getattr(_STATE, "mode", None)
    return None if mode is None else mode.call


def suspended():
    """Inside, torch functions run without the mode: tensors stay plain.

    For code that runs on local shards (`batch_local`). The mode must be
    the innermost torch function mode (`current_mode()` is not None).
    """
    return _Suspended()


class _Suspended:
    """The context of `suspended`: the mode off the torch function mode
    stack (as `torch.overrides._pop_mode_temporarily` takes it off, in
    three Python calls where that takes a dozen: several suspensions a
    step)."""

    def __enter__(self):
        self.mode = torch_runtime.pop_function_mode()
        _STATE.active = False

    def __exit__(self, *exc_info):
        _STATE.active = True
        torch_runtime.push_function_mode(self.mode)


def draw_count():
    """How many random draws the mode has seen on this thread."""
    return getattr(_STATE, "draws", 0)


class _ReplicateCreatedTensors(TorchFunctionMode):
    """The torch function mode of `replicate_created_tensors`.

    Each torch function with a handler in `_HANDLERS` goes to it; every
    other function is called as it is. A lookup result either way is
    reduced once, as it is made (`sharded_lookups.reduce_lookup_result`).
    """

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        self.replicated = [Replicate()] * mesh.ndim
        # The DTensor the last torch call cloned (`in_place_writes`), and
        # in a handler, the one the call before it cloned: a clone that
        # nothing has read yet, which its first write may lay out.
        self.fresh_clone = None
        self.just_cloned = None
        self.call = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # This runs for every torch call of a step: membership and type
        # tests, which make no Python calls, keep the common path cheap.
        kwargs = kwargs or {}
        self.just_cloned, self.fresh_clone = self.fresh_clone, None
        # The call whose dispatch redistributes its arguments, for
        # `local_replays.note_redistribution`; dropped when it returns,
        # not held (with its arguments) through backward.
        self.call = func, args
        if func in _HANDLERS:
            value = _HANDLERS[func](self, func, args, kwargs)
        else:
            value = func(*args, **kwargs)
        self.call = None
        if type(value) is DTensor and MaskPartial in map(
            type, torch_internals.spec_of(value).placements
        ):
            return reduce_lookup_result(value)
        return value

    def replicate(self, value):
        """`value` (the same on every process) as a replicated DTensor.

        A value that needs no gradient is wrapped without an autograd
        function (`dtensor_from_spec`): one, `DTensor.from_local`'s, cannot
        run under `torch.vmap`, where Keras's `vectorized_map` (multi-label
        `AUC`) creates tensors.
        """
        if value.requires_grad:
            return DTensor.from_local(
                value, self.mesh, self.replicated, run_check=False
            )
        meta = TensorMeta(value.shape, value.stride(), value.dtype)
        return dtensor_from_spec(
            value,
            DTensorSpec(self.mesh, tuple(self.replicated), tensor_meta=meta),
        )

    def count_draw(self):
        """Counts a random draw (`draw_count`) in eager steps:
        `batch_local`, which reads the count, is off when compiling."""
        if not torch.compiler.is_compiling():
            _STATE.draws = draw_count() + 1


class _CompiledReplicateCreatedTensors(_ReplicateCreatedTensors):
    """The mode around a compiled step, whose torch calls Dynamo traces.

    The same handlers, and the same test for a lookup result, written in
    what Dynamo traces: it cannot read a DTensor's `_spec`, nor compare
    placement classes. Either one broke the graph at each DTensor a torch
    function returned, and Dynamo then skipped the enclosing frame and
    compiled its nested calls one by one (a compiled DataParallel step
    took twice as long to compile). The eager mode keeps its cheaper
    test, which makes no Python call.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if args and isinstance(args[0], np.ndarray):
            # Dynamo traces numpy arithmetic (keras-hub's `1 /
            # np.sqrt(head_dim)`) as torch methods of the array, and hands
            # them to the mode; calling them fails on the traced array
            # ("'ndarray' object has no attribute 'reciprocal'", torch
            # 2.13, no torch issue found). Declined, Dynamo computes the
            # numpy value itself, with no graph break.
            return NotImplemented
        kwargs = kwargs or {}
        # A Python value read in a compiled step is a graph break, where
        # Dynamo reads it itself: the gather of `python_values` would put
        # a data-dependent read into the graph, which the step's backend
        # refuses ("aten._local_scalar_dense.default"). No layer runs
        # locally in a compiled step, so no reshape is noted for one
        # (`local_replays`).
        if (
            func in _HANDLERS
            and func not in python_values.HANDLERS
            and func not in local_replays.HANDLERS
        ):
            value = _HANDLERS[func](self, func, args, kwargs)
        else:
            value = func(*args, **kwargs)
        if isinstance(value, DTensor) and any(
            isinstance(p, MaskPartial) for p in value.placements
        ):
            return reduce_lookup_result(value)
        return value

    def replicate(self, value):
        """`value` as a replicated DTensor, made by `from_local`, which
        Dynamo traces (it does not trace a spec built here)."""
        return DTensor.from_local(
            value, self.mesh, self.replicated, run_check=False
        )


# Torch function -> handler(mode, func, args, kwargs), which returns the
# function's result; other functions are called as they are. A registry,
# filled once from the handler modules' own.
_HANDLERS = {
    **creation_handlers.HANDLERS,
    **argument_layouts.HANDLERS,
    **sharded_lookups.HANDLERS,
    **local_rows.HANDLERS,
    **in_place_writes.HANDLERS,
    **extreme_reductions.HANDLERS,
    **python_values.HANDLERS,
    **split_class_losses.HANDLERS,
    **local_replays.HANDLERS,
}
