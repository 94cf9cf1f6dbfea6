"""Tensors created inside a distributed step, as replicated DTensors.

Inside a distributed step every tensor computed from the inputs and the
variables is a DTensor; the others are created from Python values alone.
`replicate_created_tensors` makes those replicated DTensors as they are
created, with a torch function mode, and works around the DTensor
limitations a Keras step meets: each torch function with a handler in
`_HANDLERS` goes to it, and each handler's docstring says which
limitation it works around and why `implicit_replication` is not enough.

Collectives here: a random draw on a CPU mesh gathers its DTensor
arguments, and the embedding, attention, lookup, convolution and
local-rows (`stft`, `istft`, `unfold`, the cumulative ops) handlers
redistribute DTensors; all run inside the step, on every process alike.
"""

import contextlib
import threading

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor.placement_types import _MaskPartial
from torch.overrides import TorchFunctionMode

from keras.src import tree
from keras.src.backend.torch import extreme_reductions
from keras.src.backend.torch import in_place_writes
from keras.src.backend.torch import python_values
from keras.src.backend.torch import sharding_rules
from keras.src.backend.torch.dtensor_layouts import contiguous_strides
from keras.src.backend.torch.dtensor_layouts import dtensor_from_spec
from keras.src.backend.torch.local_layouts import recorded_local_layouts

# Whether `replicate_created_tensors` is active, per thread.
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
    if mode is None or torch.overrides._get_current_function_mode() is not mode:
        return contextlib.nullcontext()
    return torch.overrides._pop_mode_temporarily()


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
    if torch.overrides._get_current_function_mode() is not mode:
        return None
    return mode


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
        self.mode = torch._C._pop_torch_function_stack()
        _STATE.active = False

    def __exit__(self, *exc_info):
        _STATE.active = True
        torch._C._push_on_torch_function_stack(self.mode)


def draw_count():
    """How many random draws the mode has seen on this thread."""
    return getattr(_STATE, "draws", 0)


def _count_draw():
    """Counts a draw in eager steps (`batch_local` is off when compiling)."""
    if not torch.compiler.is_compiling():
        _STATE.draws = draw_count() + 1


class _ReplicateCreatedTensors(TorchFunctionMode):
    """The torch function mode of `replicate_created_tensors`.

    Each torch function with a handler in `_HANDLERS` goes to it; every
    other function is called as it is. A lookup result either way is
    reduced once, as it is made (`_reduce_lookup_result`).
    """

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        self.replicated = [Replicate()] * mesh.ndim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # This runs for every torch call of a step: membership and type
        # tests, which make no Python calls, keep the common path cheap.
        kwargs = kwargs or {}
        if func in _HANDLERS:
            value = _HANDLERS[func](self, func, args, kwargs)
        else:
            value = func(*args, **kwargs)
        if type(value) is DTensor and _MaskPartial in map(
            type, value._spec.placements
        ):
            return _reduce_lookup_result(value)
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

    def draws_locally(self, args):
        """Whether DTensor would draw random values shard by shard.

        DTensor draws globally consistent values only with its offset-based
        generator (CUDA); otherwise each process draws for its own shard,
        and DTensor drops a `generator=` argument.
        """
        return (
            bool(args)
            and isinstance(args[0], DTensor)
            and args[0].device_mesh.device_type == "cpu"
        )

    def draw_for_global_shape(self, func, args, kwargs):
        """Runs a random function on full values, then lays the result out.

        Every process draws the same values for the global shape (with the
        given generator, if any), and keeps its part of them.
        """
        first = args[0]
        full_args, full_kwargs = tree.map_structure(
            lambda x: x.full_tensor() if isinstance(x, DTensor) else x,
            (args, kwargs),
        )
        value = func(*full_args, **full_kwargs)
        placements = [
            Replicate() if p.is_partial() else p for p in first.placements
        ]
        return distribute_tensor(
            value, first.device_mesh, placements, src_data_rank=None
        )

    def dropout(self, inputs, p=0.5, training=True, inplace=False):
        """`torch.nn.functional.dropout` with a mask of the global shape.

        The mask is drawn as the CPU kernel draws it for a plain tensor, so
        the values equal a single-process run's with the same seed.
        """
        if not training or p == 0.0:
            return inputs
        keep = 1.0 - p
        noise = torch.empty(
            inputs.shape, dtype=inputs.dtype, device=inputs.device
        )
        if keep == 0.0:
            noise.zero_()
        else:
            noise.bernoulli_(keep).div_(keep)
        noise = self.replicate(noise)
        if inplace:
            return inputs.mul_(noise)
        return inputs * noise


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
        # refuses ("aten._local_scalar_dense.default").
        if func in _HANDLERS and func not in python_values.HANDLERS:
            value = _HANDLERS[func](self, func, args, kwargs)
        else:
            value = func(*args, **kwargs)
        if isinstance(value, DTensor) and any(
            isinstance(p, _MaskPartial) for p in value.placements
        ):
            return _reduce_lookup_result(value)
        return value

    def replicate(self, value):
        """`value` as a replicated DTensor, made by `from_local`, which
        Dynamo traces (it does not trace a spec built here)."""
        return DTensor.from_local(
            value, self.mesh, self.replicated, run_check=False
        )


def _reduce_lookup_result(value):
    """Reduces a lookup result once, as it is made.

    A lookup into a table sharded along the looked-up dimension (an
    embedding with a vocabulary-sharded table) gives a `_MaskPartial`
    DTensor: each process holds the rows it owns. DTensor frees the mask at
    the first reduction, so a second consumer of the same value fails. The
    value is reduced (all-reduced) once, as it is made, instead. Nothing
    plain is involved, so `implicit_replication` does not apply.
    """
    placements = tuple(
        Replicate() if type(p) is _MaskPartial else p for p in value.placements
    )
    return _ReducedLookup.apply(value, placements)


class _ReducedLookup(torch.autograd.Function):
    """`value.redistribute(mesh, placements)` of a lookup result, with the
    gradient DTensor's own redistribution gives, except for a gradient
    that is a partial sum where the lookup was masked: it is all-reduced
    (the lookup's part of a sum is the whole gradient, as for a replicated
    one). DTensor would ask for a partial-to-masked-partial redistribution
    there, which torch 2.11 refuses ("Redistribution from one partial
    type (P(sum)) to another (MaskP(...)) is unsupported"; keras-hub's
    Gemma on a (2, 2) mesh).
    """

    @staticmethod
    def forward(ctx, value, placements):
        ctx.placements = value.placements
        return value.redistribute(value.device_mesh, placements)

    @staticmethod
    def backward(ctx, grad):
        placements = tuple(
            _lookup_gradient_placement(current, target)
            for current, target in zip(grad.placements, ctx.placements)
        )
        return grad.redistribute(grad.device_mesh, placements), None


def _lookup_gradient_placement(current, target):
    """Where a lookup's gradient, laid out as `current`, goes back to a
    lookup result laid out as `target`: `target`, except that a partial
    target takes `Replicate` (as DTensor's backward redistribution does
    for a gradient that is not a partial sum, and for any gradient where
    the target is a masked lookup)."""
    if target.is_partial() and (
        type(target) is _MaskPartial or not current.is_partial()
    ):
        return Replicate()
    return target


def _create(mode, func, args, kwargs):
    """A factory's result is replicated where it is made from Python values.

    All processes run the same program with the same seed, so a tensor
    made from Python values alone (`arange`, `zeros`, `tensor(2.0)`,
    `from_numpy` of a constant) is identical on every process.
    `implicit_replication` would take every plain tensor for replicated,
    including one computed from a process's own data, and would be
    silently wrong there; replicating at creation covers exactly the
    tensors that are identical.
    """
    value = func(*args, **kwargs)
    if _created_from_python_values(value, args, kwargs):
        return mode.replicate(value)
    return value


def _draw_random(mode, func, args, kwargs):
    """Random draws on a DTensor take the values of the global shape.

    On meshes without an offset-based generator (CPU), DTensor draws each
    shard from the same generator state and drops a `generator=` argument,
    so shards repeat each other's values and seeded layers are not
    reproducible. No plain tensor is involved, so `implicit_replication`
    does not help. `normal` made from Python values is a factory.
    """
    _count_draw()
    if mode.draws_locally(args):
        return mode.draw_for_global_shape(func, args, kwargs)
    if func is torch.normal:
        return _create(mode, func, args, kwargs)
    return func(*args, **kwargs)


def _dropout(mode, func, args, kwargs):
    """Dropout on a DTensor draws its mask for the global shape.

    As for `_draw_random`: DTensor's CPU dropout would draw each shard's
    mask from the same generator state.
    """
    _count_draw()
    if mode.draws_locally(args):
        return mode.dropout(*args, **kwargs)
    return func(*args, **kwargs)


def _create_random(mode, func, args, kwargs):
    """A random factory's draw is counted (`draw_count`), then created."""
    _count_draw()
    return _create(mode, func, args, kwargs)


def _repeat_interleave(mode, func, args, kwargs):
    """`repeat_interleave` with a one-element `repeats` tensor, as an int.

    With a tensor `repeats`, torch decomposes `repeat_interleave` below
    DTensor into an index tensor of its own, which then meets the DTensor
    ("got mixed torch.Tensor and DTensor"). That tensor is made inside the
    decomposition, below any scope a caller could open, so
    `implicit_replication` cannot reach it; with an int, DTensor lays out
    the result itself.
    """
    args, kwargs = _repeats_as_int(args, kwargs)
    return func(*args, **kwargs)


def _embedding(mode, func, args, kwargs):
    """Embedding lookups with indices replicated where the table is split.

    DTensor needs the indices replicated on the mesh axes that shard the
    table's rows. Redistributing them first avoids a DTensor ordering
    problem: with indices split on an axis that splits the rows on another
    axis, the lookup's mask was taken from the unreduced indices and did
    not fit the result. The indices are DTensors already, so
    `implicit_replication` does not apply.
    """
    return func(*_replicate_lookup_indices(*args), **kwargs)


def _attention(mode, func, args, kwargs):
    """`scaled_dot_product_attention` with its mask laid out to fit.

    DTensor does not redistribute keyword arguments such as `attn_mask`,
    so the sharding rules would find the mask in a layout no strategy
    accepts. The mask is a DTensor, so `implicit_replication` does not
    apply.
    """
    args, kwargs = _align_attention_mask(args, kwargs)
    return func(*args, **kwargs)


def _convolution(mode, func, args, kwargs):
    """A convolution of a batch, each process on its rows.

    DTensor's convolution cannot be trusted with a split argument: torch
    2.13's runs on the local shards of its arguments without
    redistributing them and lays the result out like the input (with a
    weight split over a mesh axis, a kernel's output channels laid out
    over "model", the result's local tensor holds only some channels
    under the global shape of all of them, and the next operator fails:
    "The size of tensor a (4) must match the size of tensor b (8)");
    torch 2.11's refuses most convolutions outright, even of a batch
    split along its rows ("It requires that input_size[-1] is divisible
    by stride[-1] and stride[-1] equals kernel_size[-1]", a 3 x 3
    "valid" convolution). A convolution transforms each element of a
    batch alone: each process convolves its rows (`_call_on_local_rows`),
    the input split along the batch at most, the weight and bias
    gathered whole, their gradients partial sums over the processes that
    split the batch. An unbatched input (one dimension fewer than the
    weight) is convolved whole.
    """
    value = args[0] if args else kwargs.get("input")
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    batched = weight is None or value.ndim == weight.ndim
    return _call_on_local_rows(func, (0,) if batched else (), args, kwargs)


def _contiguous(mode, func, args, kwargs):
    """`Tensor.contiguous` of a DTensor in the standard memory format.

    DTensor computes a result's strides from its global shape and its
    inputs' global strides, while a redistribution (a partial sum
    reduced, a shard gathered) gives a local tensor in the standard
    format. A DTensor laid out `channels_last` (keras-nightly's pooling
    asks for it) whose input an operator redistributes gets a local
    tensor with other strides than its own, and a later `reshape` views
    it wrongly ("view size is not compatible with input tensor's size
    and stride"). In the standard format the two agree; the values are
    the same. No plain tensor is involved, so `implicit_replication`
    does not apply.
    """
    if args and isinstance(args[0], DTensor):
        kwargs = dict(kwargs)
        kwargs.pop("memory_format", None)
        args = args[:1]
    return func(*args, **kwargs)


def _signal_transform(mode, func, args, kwargs):
    """`stft` and `istft` of a batch of signals, each process on its rows.

    DTensor cannot run them: `torch.stft` frames its input with
    `as_strided`, which DTensor refuses ("as_strided not supported with
    DTensor"), so `ops.stft` and Keras's `MelSpectrogram` failed. Both
    transform each row of a batch alone, along its last dimensions: each
    process transforms its rows (`_call_on_local_rows`), the batch kept
    split along dimension 0; a single signal is transformed whole.
    """
    signal = args[0] if args else kwargs.get("input")
    rows = (0,) if signal.ndim > _SIGNAL_RANK[func] else ()
    return _call_on_local_rows(func, rows, args, kwargs)


def _along_one_dimension(mode, func, args, kwargs):
    """An op along one dimension of a DTensor, each process on its rows.

    - `unfold` (`ops.extract_sequences`, and `MelSpectrogram`'s filters):
      DTensor has no rule for it, nor for its gradient, whose
      `input_sizes` argument it would not make local.
    - `cumprod` (`ops.cumprod`): DTensor runs it, but its gradient's
      formula makes plain tensors that meet the DTensor ("aten.where.self
      got mixed torch.Tensor and DTensor").
    - `cumsum`, `cumprod` and `logcumsumexp` along a split dimension
      given as a negative number (`axis=-1`): torch 2.13's DTensor rule
      does not gather that dimension, and each process accumulates its
      shard alone, silently wrong (`cumsum` of `[[1, 2, 3, 4]]` split in
      two gives `[[1, 3, 3, 7]]`).

    Each takes the rows of the other dimensions alone: those keep their
    split, the op's dimension is gathered (`_call_on_local_rows`), and
    its gradient runs on local tensors.
    """
    value = args[0] if args else kwargs.get("self", kwargs.get("input"))
    if not isinstance(value, DTensor):
        return func(*args, **kwargs)
    name = _DIMENSION_ARGUMENTS[func]
    dimension = args[1] if len(args) > 1 else kwargs.get(name)
    dimension %= max(value.ndim, 1)
    rows = tuple(dim for dim in range(value.ndim) if dim != dimension)
    return _call_on_local_rows(func, rows, args, kwargs)


def _call_on_local_rows(func, rows, args, kwargs):
    """Calls `func` on the local tensor of its first argument, a DTensor
    split along the dimensions `rows` at most, whose rows `func`
    transforms alone.

    The first argument is gathered on the mesh axes that split another
    dimension (or hold a partial sum), every other DTensor argument is
    replicated, and the local result is laid out as the first argument,
    its dimensions `rows` being the first argument's. The gradient goes
    back through the same layouts; the gradient of another argument (a
    convolution's weight) is a partial sum over the mesh axes that split
    the first one. A plain tensor argument may hold a
    process's own values: the call is then left to DTensor, and
    `implicit_replication` is not needed.
    """
    value = args[0] if args else kwargs.get("input", kwargs.get("self"))
    others = (*args[1:], *(v for k, v in kwargs.items() if k not in _FIRST))
    if not isinstance(value, DTensor) or any(
        isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
        for v in others
    ):
        return func(*args, **kwargs)
    placements = [
        p if p.is_shard() and p.dim in rows else Replicate()
        for p in value.placements
    ]
    if placements != list(value.placements):
        value = value.redistribute(value.device_mesh, placements)
    kwargs = {k: v for k, v in kwargs.items() if k not in _FIRST}
    # Each process's gradient of another argument is its rows' part.
    grad_placements = [
        Partial() if p.is_shard() else Replicate() for p in placements
    ]
    others, kwargs = tree.map_structure(
        lambda x: (
            _replicated(x).to_local(grad_placements=grad_placements)
            if isinstance(x, DTensor)
            else x
        ),
        (args[1:], kwargs),
    )
    result = func(value.to_local(), *others, **kwargs).contiguous()
    shape = list(result.shape)
    for p in placements:
        if p.is_shard():
            shape[p.dim] = value.shape[p.dim]
    return DTensor.from_local(
        result,
        value.device_mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_strides(shape),
    )


def _replicated(value):
    """`value`, replicated on every mesh axis."""
    if not isinstance(value, DTensor) or all(
        p.is_replicate() for p in value.placements
    ):
        return value
    return value.redistribute(
        value.device_mesh, [Replicate()] * value.device_mesh.ndim
    )


def _repeats_as_int(args, kwargs):
    """Passes a one-element `repeats` tensor of `repeat_interleave` as int.

    With a tensor `repeats`, torch decomposes `repeat_interleave` below
    DTensor into an index tensor of its own, which then meets the DTensor;
    with an int, DTensor lays the result out itself. That is done where
    the input is a DTensor, or `repeats` is one: under `torch.vmap` the
    input is a batched tensor wrapping a DTensor, and `repeats` (made from
    Python values) a replicated DTensor.
    """
    if not args:
        return args, kwargs
    in_args = len(args) > 1
    repeats = args[1] if in_args else kwargs.get("repeats")
    if not (
        isinstance(repeats, torch.Tensor)
        and repeats.numel() == 1
        and (isinstance(args[0], DTensor) or isinstance(repeats, DTensor))
    ):
        return args, kwargs
    repeats = int(repeats.item())
    if in_args:
        return (args[0], repeats, *args[2:]), kwargs
    return args, dict(kwargs, repeats=repeats)


def _replicate_lookup_indices(indices, table, *args):
    """Replicates embedding indices on the mesh axes that shard the table.

    DTensor needs the indices replicated there anyway. Redistributing them
    first avoids a DTensor ordering problem: when the indices are split on
    an axis that splits the table's rows on another axis, the lookup's
    mask was taken from the unreduced indices and did not fit the result.
    """
    if not (isinstance(indices, DTensor) and isinstance(table, DTensor)):
        return (indices, table, *args)
    placements = [
        Replicate() if table_placement.is_shard() else placement
        for placement, table_placement in zip(
            indices.placements, table.placements
        )
    ]
    if placements != list(indices.placements):
        indices = indices.redistribute(indices.device_mesh, placements)
    return (indices, table, *args)


def _align_attention_mask(args, kwargs):
    """Lays out attention inputs and mask so that they fit each other.

    DTensor does not redistribute keyword arguments such as `attn_mask`,
    so queries, keys and values are first brought to a placement the
    attention rules accept as is (split by batch or by head, else
    replicated), and the mask to the matching placement (split like the
    queries where it has a batch or head dimension of its own).
    """
    query, key, value = args[:3]
    mask = kwargs.get("attn_mask")
    if not (isinstance(query, DTensor) and isinstance(mask, DTensor)):
        return args, kwargs
    placements = [
        p if p.is_shard() and p.dim in (0, 1) else Replicate()
        for p in query.placements
    ]
    mesh = query.device_mesh
    query, key, value = (
        x.redistribute(mesh, placements) if isinstance(x, DTensor) else x
        for x in (query, key, value)
    )
    mask_placements = [
        sharding_rules.mask_placement(mask, p) for p in placements
    ]
    kwargs = dict(kwargs, attn_mask=mask.redistribute(mesh, mask_placements))
    return (query, key, value, *args[3:]), kwargs


def _created_from_python_values(value, args, kwargs):
    """Whether `value` is a plain tensor made from Python values alone.

    Scalars count too: DTensor would take a 0-d tensor for a replicated
    scalar where it meets a DTensor, but not the tensors derived from it
    alone (`broadcast_to(1, shape)`, as metrics do for a missing sample
    weight), which are as identical on every process. So does a 0-d
    DTensor argument, a number whose value DTensor gives every process
    alike (`ops.size(x)` passed to `ops.eye`, as Keras's pairwise losses
    do).
    """
    if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
        return False
    if value.device.type == "meta":
        # Meta tensors (shape inference) hold no values.
        return False
    return not _holds_tensor(args) and not _holds_tensor(kwargs)


def _holds_tensor(value):
    """Whether `value` or the lists, tuples and dicts in it hold a tensor
    other than a 0-d DTensor.

    A factory's arguments are flat, so this recursion is shallower than
    `tree.flatten`, and cheaper in the step's hot path.
    """
    if isinstance(value, torch.Tensor):
        return not (
            type(value) is DTensor and not value._spec.tensor_meta.shape
        )
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return False
    return any(_holds_tensor(item) for item in value)


# Torch functions that create a tensor from Python values alone.
_CREATION_FUNCTIONS = (
    torch.arange,
    torch.as_tensor,
    torch.asarray,
    torch.empty,
    torch.eye,
    torch.from_numpy,
    torch.full,
    torch.linspace,
    torch.logspace,
    torch.ones,
    torch.scalar_tensor,
    torch.tensor,
    torch.tril_indices,
    torch.triu_indices,
    torch.zeros,
    torch.bartlett_window,
    torch.blackman_window,
    torch.hamming_window,
    torch.hann_window,
    torch.kaiser_window,
)
# Torch functions that create a tensor of random values.
_RANDOM_CREATION_FUNCTIONS = (
    torch.rand,
    torch.randint,
    torch.randn,
    torch.randperm,
)
# Torch functions that draw random values for a tensor argument.
_RANDOM_FUNCTIONS = (
    torch.bernoulli,
    torch.multinomial,
    torch.normal,
    torch.poisson,
    torch.rand_like,
    torch.randint_like,
    torch.randn_like,
)
# Convolutions, which DTensor runs wrongly (2.13) or refuses (2.11) on a
# split argument.
_CONVOLUTIONS = (
    torch.conv1d,
    torch.conv2d,
    torch.conv3d,
    torch.conv_transpose1d,
    torch.conv_transpose2d,
    torch.conv_transpose3d,
)
# The keyword names of the first argument of the functions that
# `_call_on_local_rows` runs.
_FIRST = ("input", "self")
# Signal transforms -> the rank of one signal they take (a batch of them
# has one more dimension, the first).
_SIGNAL_RANK = {
    torch.stft: 1,
    torch.Tensor.stft: 1,
    torch.istft: 2,
    torch.Tensor.istft: 2,
}
# Ops along one dimension -> the keyword name of their dimension (their
# second argument).
_DIMENSION_ARGUMENTS = {
    torch.Tensor.unfold: "dimension",
    torch.unfold_copy: "dimension",
    torch.cumprod: "dim",
    torch.Tensor.cumprod: "dim",
    torch.cumsum: "dim",
    torch.Tensor.cumsum: "dim",
    torch.logcumsumexp: "dim",
    torch.Tensor.logcumsumexp: "dim",
}
# Torch function -> handler(mode, func, args, kwargs), which returns the
# function's result; other functions are called as they are.
_HANDLERS = {
    **{func: _create for func in _CREATION_FUNCTIONS},
    **{func: _create_random for func in _RANDOM_CREATION_FUNCTIONS},
    **{func: _draw_random for func in _RANDOM_FUNCTIONS},
    torch.nn.functional.dropout: _dropout,
    torch.repeat_interleave: _repeat_interleave,
    torch.Tensor.repeat_interleave: _repeat_interleave,
    torch.nn.functional.embedding: _embedding,
    torch.nn.functional.scaled_dot_product_attention: _attention,
    **{func: _convolution for func in _CONVOLUTIONS},
    torch.Tensor.contiguous: _contiguous,
    **{func: _signal_transform for func in _SIGNAL_RANK},
    **{func: _along_one_dimension for func in _DIMENSION_ARGUMENTS},
    **in_place_writes.HANDLERS,
    **extreme_reductions.HANDLERS,
    **python_values.HANDLERS,
}
