"""Layers that compute each batch shard alone run on local tensors.

Under a distribution every operator of a step runs on DTensors, and
DTensor's dispatch costs Python time on each of them. Most layers of a
data-parallel model compute each example from that example alone, with
replicated variables: DTensor then runs every operator on each process's
own shard and communicates nothing, so its dispatch buys nothing. Such a
layer runs on plain local tensors instead, as DDP runs a module, and its
backward pass runs on plain tensors too.

The per-sample values of built-in losses (`LossFunctionWrapper.call`,
before `Loss.__call__` reduces them over the batch) are judged and run the
same way; a loss holds no variables and no sublayers.

Which layers these are is decided by DTensor, not by a list of layer
classes. The first call of a layer with a given signature (the global
shapes, dtypes and placements of its tensor arguments, its other
arguments, and the `training` mode of the call context it inherits) runs
on DTensors as usual, and is watched. From the next call
with that signature on, the layer runs locally if the watched call:

- took tensor arguments that are all DTensors on the step's mesh with the
  same placements (the batch placements: split along dimension 0, or
  replicated), none with a Keras mask, and gave tensor outputs that are
  all DTensors with those placements and no Keras mask;
- issued no collective (the sequence numbers of the mesh's process
  groups did not move);
- holds only DTensor variables that are replicated, or sharded only
  over mesh axes that split the batch, and no DTensor attribute of its
  own (`Normalization`'s statistics), and assigned no variable (no
  assignment to a DTensor variable, and its own variables' version
  counters did not move), drew no random values (the
  default generators' states did not move, and the step's torch function
  mode saw no draw), and added no loss;
- laid out no tensor (no `<layer path>/output` layout applied inside it)
  and has no sublayer that recomputes activations, nor a remat mode of
  its own other than "full" (a layer recomputed whole runs its local call
  in a checkpoint of its own).

A layer also runs on DTensors whenever a sublayer has come to recompute
activations since (`remat_layers` marks layers after their first call),
and whenever saved-tensor hooks are active: inside a checkpoint on
DTensors (`torch.utils.checkpoint` in forward, and its recomputation in
backward, which runs outside any scope the forward call entered) every
call must take the path it takes in the other pass.

Such a call ran, on every process, the same local operators on the same
local shards as a plain call of the layer on those shards would. A local
call therefore gives the values of the DTensor call: it reads variables as
local views (`DTensor.to_local`, whose gradient is `Partial` on the mesh
axes that split the batch, as DTensor's own gradient of a replicated
variable used with split inputs is) through a Keras `StatelessScope`, runs
with `replicate_created_tensors` suspended, and returns its outputs as
DTensors with the placements and global shapes of the watched call.

Two things a local call keeps, so that the next one costs less Python
time: the local view of each replicated variable it read with gradients
on (kept on its verdict, and read again while the variable holds the same
value; the view shares the local tensor's storage and version counter,
so it sees the optimizer's in-place updates; in Keras's train step, a
gradient leaf whose gradient goes straight to the variable's bucket,
`accumulating_into_variables`), and, on each DTensor it
returns, the local tensor it computed. A later local call, or a loss
reduction (`batch_reductions`), given such a DTensor unchanged reads that
local tensor (`local_tensor_of`) instead of going through `to_local`: its
gradient reaches the first call as the round trip would bring it.

Variables sharded over the batch axes (fully sharded layouts) are read
whole: the watched call reads each one all-gathered (a replicated DTensor
standing in for its value during the call), and a local call reads the
local tensor of its all-gathered value. The sharded variables of each
block of the layer form a unit (`gathered_units`: the repeated segments
of a functional graph or of the direct sublayers; the rest is the root
unit, kept gathered until backward is done with it): the first
read of one of them gathers them all, in one collective where their
layouts allow it; its gradient, a partial sum over the batch axes, is
reduce-scattered back to the variables' shards in backward, again one
collective per unit. A unit then costs one all-gather in forward and one
reduce-scatter in backward, as FSDP's units do, where DTensor's own
operators would pick their redistributions operator by operator. A
gathered value (but the root unit's) is freed once forward is done with
it, as FSDP's `reshard_after_forward` does:
what backward needs of it is saved as a note, and gathered again when
backward first needs it (saved-tensor hooks; inside a checkpoint, the
recomputation gathers again instead).

A layer whose call depends on Python state other than its arguments and
variables, changed between calls, is outside what the watched call
proves. `KERAS_DTENSOR_BATCH_LOCAL=0` in the environment (read at import)
turns local calls off: every layer (and loss) then runs on DTensors.

Collectives: a local call issues none but the gathers of its sharded
variables, in the order the call reads them, and in backward the
gathers again and the reduce-scatters, in autograd's order; the watched
call issues those of the DTensor call. A verdict depends only on the
program and the global shapes, so every process takes the same path, and
the layers' collectives stay in lockstep.
"""

import contextlib
import os
import weakref

import torch
import torch.utils.checkpoint
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._dtensor_spec import TensorMeta

from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import gathered_units
from keras.src.backend.torch import gradient_buckets

ENABLED_ENV_VAR = "KERAS_DTENSOR_BATCH_LOCAL"
# Whether layers proven local run on local tensors.
ENABLED = os.environ.get(ENABLED_ENV_VAR, "1") != "0"

# Layer -> {call signature: _Verdict, or None where the layer must run on
# DTensors}.
_VERDICTS = weakref.WeakKeyDictionary()

# Attribute of a replicated DTensor variable value read through a local
# view: {gradient placements: DTensorSpec of the view's gradient}.
_GRADIENT_SPECS_ATTRIBUTE = "_keras_local_view_gradient_specs"

# Attribute of a DTensor output of a local call: (the local tensor the
# call computed, the DTensor's version counter when it was made).
_COMPUTED_LOCALLY_ATTRIBUTE = "_keras_computed_locally"

# id(variable) -> its sharded value, while a watched call reads the
# variable gathered (`_GatheredVariables`).
_SWAPPED = {}

# The number of local calls running (nested calls count each).
_LOCAL_CALLS = [0]

# The number of steps running whose backward pass accumulates into the
# variables (`accumulating_into_variables`).
_ACCUMULATING_STEPS = [0]

# Argument values other than tensors that a signature holds as they are.
_SCALARS = (bool, int, float, str, type(None))


class _NotLocal(Exception):
    """A call's arguments rule out a local call."""


def call_layer(layer, upstream_call, args, kwargs):
    """Calls `layer` inside a distributed step: locally where proven exact.

    Args:
        layer: the Keras layer.
        upstream_call: upstream `Layer.__call__`.
        args: the positional arguments of the call.
        kwargs: the keyword arguments of the call.

    Returns:
        The layer's outputs, as DTensors wherever the call took DTensors.
    """
    mode = created_tensors.current_mode()
    if mode is None or not local_calls_allowed():
        return upstream_call(layer, *args, **kwargs)
    try:
        leaves = []
        # A sublayer takes `training` from its caller's call context.
        training = call_context_training()
        signature = _signature((args, kwargs, training), leaves)
        placements = _batch_placements(leaves, mode.mesh)
    except _NotLocal:
        return upstream_call(layer, *args, **kwargs)
    verdicts = _VERDICTS.setdefault(layer, {})
    if signature not in verdicts:
        outputs, verdicts[signature] = _watch(
            layer, upstream_call, args, kwargs, placements, mode.mesh
        )
        return outputs
    verdict = verdicts[signature]
    if verdict is None or verdict.recomputes(layer):
        return upstream_call(layer, *args, **kwargs)
    return _call_locally(layer, upstream_call, args, kwargs, verdict)


def local_calls_allowed():
    """Whether a call may run locally here: local calls are on, the step
    is not being compiled, and no saved-tensor hooks are active (a local
    call inside a checkpoint must take the path of its other pass)."""
    return (
        ENABLED
        and not torch.compiler.is_compiling()
        and not _saved_tensors_hooked()
    )


def call_context_training():
    """The `training` mode a call inherits from its caller's call context
    (None outside any call)."""
    context = global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.get_value("training")


def _saved_tensors_hooked():
    """Whether autograd's saved tensors pass through hooks (e.g. remat)."""
    return (
        torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    )


def _signature(value, leaves):
    """A hashable signature of call arguments; DTensors go to `leaves`.

    Raises:
        _NotLocal: for a plain tensor, a Keras mask or any other object
            whose effect on the call cannot be told from its value.
    """
    if isinstance(value, DTensor):
        if getattr(value, "_keras_mask", None) is not None:
            raise _NotLocal
        leaves.append(value)
        # Read from the spec: a tensor's `shape` and `dtype` go through
        # the step's torch function mode.
        spec = value._spec
        meta = spec.tensor_meta
        return (DTensor, meta.shape, meta.dtype, spec.placements)
    if isinstance(value, _SCALARS):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value),) + tuple(_signature(x, leaves) for x in value)
    if isinstance(value, dict):
        return (dict,) + tuple(
            (key, _signature(x, leaves)) for key, x in value.items()
        )
    raise _NotLocal


def _batch_placements(leaves, mesh):
    """The one placement tuple of the DTensor arguments, if it is allowed.

    On a mesh axis of one process, a placement other than a split of the
    batch is read as `Replicate` (`_batch_layout`): arguments whose
    placements differ only there have the same batch placements.

    Raises:
        _NotLocal: without DTensor arguments, with several placements, on
            another mesh, or with a split along a dimension other than 0
            over more than one process.
    """
    if not leaves:
        raise _NotLocal
    placements = leaves[0].placements
    for leaf in leaves:
        if leaf.device_mesh != mesh:
            raise _NotLocal
        if leaf.placements != placements:
            break
    else:
        if _splits_only_the_batch(placements):
            return placements
    placements = _batch_layout(placements, mesh)
    if not _splits_only_the_batch(placements):
        raise _NotLocal
    for leaf in leaves:
        if _batch_layout(leaf.placements, mesh) != placements:
            raise _NotLocal
    return placements


def _splits_only_the_batch(placements):
    return all(p.is_replicate() or p.is_shard(0) for p in placements)


def _batch_layout(placements, mesh):
    """`placements`, with `Replicate` on the mesh axes of one process
    where they are not a split of the batch (dimension 0).

    The local tensor of such a DTensor holds the whole dimension (or the
    whole sum) on those axes: a local call reads it as it reads a
    replicated one.
    """
    return tuple(
        Replicate() if not p.is_shard(0) and mesh.size(mesh_dim) == 1 else p
        for mesh_dim, p in enumerate(placements)
    )


def keeps_local_values(value, layout):
    """Whether laying `value` (a DTensor) out as `layout` leaves its local
    tensor as it is: the placements differ only on mesh axes of one
    process, where DTensor moves nothing.

    Such a relayout is not an effect (`note_effect`): a local call, which
    computes on local tensors, skips it.
    """
    mesh = layout.mesh
    if value.device_mesh != mesh:
        return False
    return all(
        a == b or mesh.size(mesh_dim) == 1
        for mesh_dim, (a, b) in enumerate(
            zip(value.placements, layout.placements)
        )
    )


def running_locally():
    """Whether a local call is running: its tensors are local shards."""
    return _LOCAL_CALLS[0] > 0


@contextlib.contextmanager
def accumulating_into_variables():
    """Marks a step whose backward pass accumulates into the variables.

    Inside it, local calls read replicated variables as gradient leaves
    (`gradient_buckets.gradient_leaf`), whose gradients autograd hands
    to the buckets as soon as each is complete. For a step that calls
    `loss.backward()` and reads the variables' gradients, as Keras's
    train step does: `torch.autograd.grad` of a variable does not see its
    gradient leaves.
    """
    _ACCUMULATING_STEPS[0] += 1
    try:
        yield
    finally:
        _ACCUMULATING_STEPS[0] -= 1


class _Verdict:
    """How a layer's local call lays out its outputs.

    Attributes:
        mesh: the step's DTensor mesh.
        placements: the batch placements of inputs and outputs
            (`_batch_layout`).
        gradient_placements: the placements of the gradients of the local
            views of variables: `Partial` on mesh axes that split the
            batch, `Replicate` on the others.
        outputs: per tensor output, in flattening order, its local shape,
            its `DTensorSpec` (mesh, placements, global shape, stride and
            dtype) in the watched call, and the placements of its
            gradient's local tensor (`_AsDTensor`).
        sublayers: the layer's sublayers in the watched call (none for a
            loss).
        units: for each variable sharded over the batch axes, its
            `_Unit` (the variables gathered with it); empty when the layer
            reads none.
        views: id(variable) -> `(value, local tensor, view, whether it
            was made in a step accumulating into the variables)`: the
            local view of each replicated variable a local call read with
            gradients on, kept for the next calls (`_LocalVariables`).
    """

    def __init__(self, mesh, placements, outputs, sublayers):
        self.mesh = mesh
        self.sublayers = sublayers
        self.placements = placements
        self.gradient_placements = tuple(
            Partial() if p.is_shard() else Replicate() for p in placements
        )
        self.outputs = outputs
        self.units = {}
        self.views = {}

    def recomputes(self, layer):
        """Whether a remat mode now keeps `layer` on DTensors."""
        return _remat_anywhere(layer, self.sublayers)


def _watch(layer, upstream_call, args, kwargs, placements, mesh):
    """Calls the layer on DTensors and judges whether it may run locally.

    Returns:
        The outputs, and the `_Verdict` (None: the layer must run on
        DTensors with this signature).
    """
    before = _Snapshot(layer, mesh, placements)
    with _GatheredVariables(layer, placements, before.groups) as gathered:
        outputs = upstream_call(layer, *args, **kwargs)
    verdict = None
    if before.unchanged(layer, gathered.collectives):
        output_specs = _output_specs(outputs, placements, mesh)
        if output_specs is not None:
            verdict = _Verdict(
                mesh, placements, output_specs, _sublayers(layer)
            )
            verdict.units = _units(
                layer, gathered.sharded, verdict.gradient_placements
            )
    return outputs, verdict


class _Snapshot:
    """What a watched call must leave unchanged to be local."""

    def __init__(self, layer, mesh, placements):
        self.groups = [mesh.get_group(i) for i in range(mesh.ndim)]
        self.placements = placements
        self.sequence = self._sequence_numbers()
        self.generators = _generator_states()
        self.draws = created_tensors.draw_count()
        self.effects = _effect_count()
        self.variables = _variable_versions(layer, placements)
        self.losses = _loss_count(layer)
        self.holds_dtensors = _holds_dtensor_attributes(layer)

    def _sequence_numbers(self):
        return _sequence_numbers(self.groups)

    def unchanged(self, layer, gathers):
        """Whether the call communicated, drew, assigned or relaid nothing.

        Args:
            layer: the watched layer.
            gathers: per mesh dimension, the collectives that gathered
                sharded variables for the call (`_GatheredVariables`), the
                only ones it may have issued.
        """
        if (
            self.variables is None
            or self.holds_dtensors
            or _remat_anywhere(layer)
        ):
            return False
        expected = [
            number + gathers[dim] for dim, number in enumerate(self.sequence)
        ]
        return (
            self._sequence_numbers() == expected
            and created_tensors.draw_count() == self.draws
            and _effect_count() == self.effects
            and _same_versions(
                _variable_versions(layer, self.placements), self.variables
            )
            and _loss_count(layer) == self.losses
            and _same_states(_generator_states(), self.generators)
        )


def _sequence_numbers(groups):
    """The collectives issued so far on each process group."""
    return [group._get_sequence_number_for_group() for group in groups]


def _variable_versions(layer, placements):
    """The layer's variables' values and their versions.

    None unless every value is a DTensor that a local call can read
    (`_readable_locally`). An assignment either replaces a value or writes
    into its local tensor (a new version).
    """
    versions = []
    for variable in getattr(layer, "variables", ()):
        value = variable._value
        if not _readable_locally(value, placements):
            return None
        versions.append((value, value._local_tensor._version))
    return versions


def _holds_dtensor_attributes(owner):
    """Whether a layer (or a loss), or one of its sublayers, holds a
    DTensor as an attribute of its own (not a variable's value).

    A local call reads variables through local views, but such a tensor
    as it is: a DTensor among local tensors. `Normalization` holds its
    statistics so, computed from its variables when it is adapted.
    """
    return any(
        isinstance(value, DTensor)
        for layer in (owner,) + _sublayers(owner)
        for value in vars(layer).values()
    )


def _readable_locally(value, placements):
    """Whether a local call can read `value`.

    It can read a DTensor that is replicated on every mesh axis, or split
    only along mesh axes that split the batch (a fully sharded variable):
    the local call reads its full value, all-gathered over those axes.

    Args:
        value: a variable's value.
        placements: the call's batch placements, or the gradient
            placements of its variable views (`Partial` where the batch
            is split).
    """
    if not isinstance(value, DTensor):
        return False
    mesh = value.device_mesh
    return all(
        p.is_replicate()
        or (p.is_shard() and (batch.is_shard() or batch.is_partial()))
        or mesh.size(mesh_dim) == 1
        for mesh_dim, (p, batch) in enumerate(zip(value.placements, placements))
    )


def _is_sharded(value, placements):
    """Whether a readable `value` is split over mesh axes that split the
    batch (read gathered), given the call's batch or gradient placements.

    A split over another axis (of one process: `_readable_locally`)
    leaves the whole value in the local tensor.
    """
    return any(
        p.is_shard() and (batch.is_shard() or batch.is_partial())
        for p, batch in zip(value.placements, placements)
    )


def _gather(value):
    """The full value of a sharded DTensor variable, replicated.

    All-gathers over the mesh axes that split it, differentiably: the
    gradient, a partial sum over the batch axes in a local call, is
    reduce-scattered back to the variable's placements in backward.
    """
    mesh = value.device_mesh
    return value.redistribute(mesh, (Replicate(),) * mesh.ndim)


class _GatheredVariables:
    """Reads the layer's sharded variables gathered during a watched call.

    The call then runs on DTensors as a local call would run on local
    tensors: with every variable replicated. Each sharded variable's
    value is replaced by its gathered value for the duration of the call,
    so Keras reads it as usual, and restored after it. A sublayer watched
    inside the call finds its variables gathered already, and their
    sharded values in `_SWAPPED`.

    Attributes:
        collectives: per mesh dimension (process group in `groups`), the
            collectives the gathers issued.
        sharded: the layer's sharded variables and their sharded values.
    """

    def __init__(self, layer, placements, groups):
        self.layer = layer
        self.groups = groups
        self.collectives = [0] * len(groups)
        self.sharded = []
        for variable in getattr(layer, "variables", ()):
            value = _SWAPPED.get(id(variable), variable._value)
            if _readable_locally(value, placements) and _is_sharded(
                value, placements
            ):
                self.sharded.append((variable, value))
        self.swapped = []

    def __enter__(self):
        own = [pair for pair in self.sharded if id(pair[0]) not in _SWAPPED]
        if not own:
            return self
        before = _sequence_numbers(self.groups)
        try:
            for variable, value in own:
                gathered = _gather(value)
                variable._value = gathered
                _SWAPPED[id(variable)] = value
                self.swapped.append(
                    (variable, value, gathered, gathered._local_tensor._version)
                )
        except BaseException:
            self._restore()
            raise
        after = _sequence_numbers(self.groups)
        self.collectives = [b - a for a, b in zip(before, after)]
        return self

    def _restore(self):
        """Gives the variables their values back; returns the paths of
        those whose gathered value was written into."""
        changed = []
        for variable, value, gathered, version in self.swapped:
            _SWAPPED.pop(id(variable), None)
            if variable._value is gathered:
                variable._value = value
            if gathered._local_tensor._version != version:
                changed.append(variable.path)
        return changed

    def __exit__(self, *exc_info):
        changed = self._restore()
        if changed and exc_info[0] is None:
            raise RuntimeError(
                f"{_describe(self.layer)} assigned its sharded variables "
                f"{changed} in its call. Variables sharded over the batch "
                "axes are read gathered in a training step and cannot be "
                "assigned in a layer's call."
            )


def _same_versions(first, second):
    return (
        first is not None
        and second is not None
        and len(first) == len(second)
        and all(
            a is b and version_a == version_b
            for (a, version_a), (b, version_b) in zip(first, second)
        )
    )


def _loss_count(layer):
    """The number of losses added by the layer and its sublayers' calls."""
    return sum(
        len(sub._losses)
        for sub in (layer, *_sublayers(layer))
        if hasattr(sub, "_losses")
    )


def _remat_anywhere(layer, sublayers=None):
    """Whether a remat mode on the layer or a sublayer keeps DTensors.

    `sublayers` defaults to the layer's current ones.
    """
    if sublayers is None:
        sublayers = _sublayers(layer)
    # The common case (no sublayer recomputed), checked on every call in
    # one comprehension rather than a call per sublayer.
    modes = [getattr(sub, "_remat_mode", None) for sub in sublayers]
    if modes.count(None) == len(modes):
        return _remat_keeps_dtensors(layer, layer)
    return any(_remat_keeps_dtensors(layer, sub) for sub in (layer, *sublayers))


def _sublayers(owner):
    """A layer's sublayers, as a tuple; none for a loss."""
    flatten = getattr(owner, "_flatten_layers", None)
    if flatten is None:
        return ()
    return tuple(flatten(include_self=False))


def _describe(owner):
    """How errors name a layer (its path) or a loss (its class and name)."""
    path = getattr(owner, "path", None)
    if path is not None:
        return f"Layer '{path}'"
    return f"{type(owner).__name__} '{owner.name}'"


def _remat_keeps_dtensors(layer, sub):
    """Whether `sub`'s remat mode rules out a local call of `layer`.

    A local call of a layer recomputed whole (remat mode "full") runs in a
    checkpoint of its own (`_recompute_locally`). A recomputed sublayer
    would recompute outside the local call's scope, and other modes
    recompute part of a call.
    """
    mode = getattr(sub, "_remat_mode", None)
    if mode is None:
        return False
    return sub is not layer or mode.mode != "full"


def _generator_states():
    """The states of the default random generators (CPU, current CUDA)."""
    states = [torch.default_generator.get_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def _same_states(first, second):
    return len(first) == len(second) and all(
        torch.equal(a, b) for a, b in zip(first, second)
    )


def note_effect():
    """Counts an effect that a local call could not reproduce.

    Called for each relayout that moves values (`distribute_tensor`: a
    `<layer path>/output` layout would take a local tensor for a global
    one; one that leaves local tensors as they are, `keeps_local_values`,
    is skipped by a local call) and each assignment to a DTensor variable
    (a local call would compute it from one shard).
    A watched call during which one happened is not local. Nothing is
    counted under `torch.compile`, where no call is watched.
    """
    if torch.compiler.is_compiling():
        return
    count = global_state.get_global_attribute("batch_local_effects", 0)
    global_state.set_global_attribute("batch_local_effects", count + 1)


def _effect_count():
    return global_state.get_global_attribute("batch_local_effects", 0)


def _output_specs(outputs, placements, mesh):
    """Per tensor output its local and global shape, global stride and
    placements.

    Returns None unless every tensor output is a DTensor on `mesh` with
    the batch `placements` (`_batch_layout`) and no Keras mask.
    """
    specs = []
    for leaf in _tensor_leaves(outputs):
        if (
            not isinstance(leaf, DTensor)
            or leaf.device_mesh != mesh
            or getattr(leaf, "_keras_mask", None) is not None
        ):
            return None
        if (
            leaf.placements != placements
            and _batch_layout(leaf.placements, mesh) != placements
        ):
            return None
        specs.append(
            (
                leaf._local_tensor.shape,
                DTensorSpec(
                    mesh,
                    tuple(leaf.placements),
                    tensor_meta=TensorMeta(
                        leaf.shape, leaf.stride(), leaf.dtype
                    ),
                ),
                # As `from_local`'s gradient: `Replicate` for `Partial`.
                tuple(
                    Replicate() if p.is_partial() else p
                    for p in leaf.placements
                ),
            )
        )
    return tuple(specs) if specs else None


def _tensor_leaves(value):
    """The tensors in nested tuples, lists and dicts, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (tuple, list)):
        return []
    return [leaf for item in value for leaf in _tensor_leaves(item)]


def computed_locally(value):
    """Whether `value`, a DTensor, is a local call's output, unchanged
    since: its local tensor is the one the call computed."""
    computed = getattr(value, _COMPUTED_LOCALLY_ATTRIBUTE, None)
    return computed is not None and computed[1] == value._version


def local_tensor_of(value):
    """The local tensor of a DTensor, for a computation on local tensors.

    A DTensor that a local call returned, unchanged since, gives the
    tensor that the call computed, with its autograd history: its
    gradient reaches the call as directly as the round trip through
    `from_local` and `to_local` would bring it (a gradient split as the
    DTensor is, per process), without those two autograd nodes. Any
    other DTensor gives `to_local()` (detached where it requires no
    gradient).
    """
    computed = getattr(value, _COMPUTED_LOCALLY_ATTRIBUTE, None)
    if computed is not None and computed[1] == value._version:
        return computed[0]
    if not value.requires_grad:
        # No gradient to route back (a batch of inputs): a new tensor
        # object on the same storage, as `to_local()` gives, without its
        # autograd function.
        return value._local_tensor.detach()
    return value.to_local()


def _call_locally(layer, upstream_call, args, kwargs, verdict):
    """Runs the layer on local shards and lays its outputs out again."""
    args, kwargs = _map_tensors((args, kwargs), local_tensor_of)
    if getattr(layer, "_remat_mode", None) is None:
        outputs = _run_locally(layer, upstream_call, args, kwargs, verdict)
    else:
        outputs = _recompute_locally(
            layer, upstream_call, args, kwargs, verdict
        )
    specs = iter(verdict.outputs)

    def to_dtensor(local):
        local_shape, spec, gradient_placements = next(specs)
        if local.shape != local_shape or local.dtype != spec.tensor_meta.dtype:
            raise RuntimeError(
                f"{_describe(layer)} ran on local shards and returned "
                f"shape {tuple(local.shape)} and dtype {local.dtype} where "
                f"its first call returned {tuple(local_shape)} and "
                f"{spec.tensor_meta.dtype} per process. Its call depends on "
                "something other than its arguments and variables."
            )
        output = _AsDTensor.apply(local, spec, gradient_placements)
        setattr(output, _COMPUTED_LOCALLY_ATTRIBUTE, (local, output._version))
        return output

    return _map_tensors(outputs, to_dtensor)


def _run_locally(layer, upstream_call, args, kwargs, verdict):
    """Calls the layer on local tensors, reading local variable views.

    The step's torch function mode is suspended; a recomputation in a
    backward pass outside the step runs without it already.
    """
    if created_tensors.current_mode() is None:
        suspended = contextlib.nullcontext()
    else:
        suspended = created_tensors.suspended()
    # Inside a checkpoint, the checkpoint frees the gathered values with
    # the rest, and its recomputation gathers them again.
    hooked = _saved_tensors_hooked()
    regather = bool(verdict.units) and not hooked
    scope = _LocalVariables(
        layer,
        verdict.gradient_placements,
        verdict.units,
        regather,
        # A checkpoint's two passes read views made in each.
        views=None if hooked else verdict.views,
    )
    _LOCAL_CALLS[0] += 1
    try:
        with scope, suspended, scope.freeing_gathered_values():
            return upstream_call(layer, *args, **kwargs)
    finally:
        _LOCAL_CALLS[0] -= 1


def _recompute_locally(layer, upstream_call, args, kwargs, verdict):
    """A local call of a layer recomputed whole, in one checkpoint.

    The checkpoint holds the whole local call, scope included, so the
    recomputation in backward reads the same local views; inside it the
    layer's own remat is off (one checkpoint, not two).
    """

    def run():
        mode = layer._remat_mode
        layer._remat_mode = None
        try:
            return _run_locally(layer, upstream_call, args, kwargs, verdict)
        finally:
            layer._remat_mode = mode

    return torch.utils.checkpoint.checkpoint(run, use_reentrant=False)


def _map_tensors(value, function):
    """`value` with `function` applied to its tensors (tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, tuple):
        return tuple(_map_tensors(x, function) for x in value)
    if isinstance(value, list):
        return [_map_tensors(x, function) for x in value]
    if isinstance(value, dict):
        return {k: _map_tensors(x, function) for k, x in value.items()}
    return value


class _LocalVariables(StatelessScope):
    """A `StatelessScope` that reads each variable as its local view.

    The view of a replicated DTensor variable is its local tensor, whose
    gradient goes back to the variable as a DTensor with
    `gradient_placements`. The view of a variable sharded over the batch
    axes is the local tensor of its all-gathered value (one all-gather
    per read, not kept by the scope); its gradient is reduce-scattered
    back to the variable's placements.
    """

    def __init__(
        self,
        layer,
        gradient_placements,
        units=None,
        regather=False,
        views=None,
    ):
        super().__init__(initialize_variables=False)
        self.layer = layer
        self.gradient_placements = gradient_placements
        self.units = units or {}
        # Views of replicated variables kept from call to call, or None.
        self.views = views
        # Gathered views of the last gathered unit's variables not read yet.
        self.unread = {}
        # Gathered views of kept units' variables, for the whole call.
        self.kept = {}
        # id(unit) -> its `StartedGather`, for units gathered ahead.
        self.prefetched = {}
        # ids of the units gathered, or gathered ahead, in this call.
        self.started = set()
        # Storage address of each gathered value -> its `_GatheredSource`
        # and index, when gathered values are freed after forward.
        self.gathered = {} if regather else None

    def get_current_value(self, variable):
        view = self.state_mapping.get(id(variable))
        if view is None and self.views is not None:
            view = self._kept_view(variable)
        if view is None:
            value = variable._value
            # Only a layer with units reads sharded variables (its watched
            # call proved it); replicated reads skip the check.
            if self.units and _is_sharded(value, self.gradient_placements):
                # Not kept: freed as soon as forward is done with it.
                return self._gathered_view(
                    variable, value, self._gradient_spec(variable)
                )
            if value.requires_grad:
                view = self._new_view(value, self._gradient_spec(variable))
            else:
                # No gradient to send back (a non-trainable variable): the
                # local tensor as `_LocalView` gives it, without the
                # autograd function.
                view = value._local_tensor.detach()
            self.state_mapping[id(variable)] = view
            if self.views is not None and view.requires_grad:
                self.views[id(variable)] = (
                    value,
                    value._local_tensor,
                    view,
                    _ACCUMULATING_STEPS[0] > 0,
                )
        return view

    def _new_view(self, value, spec):
        """The local view of a replicated value: a gradient leaf inside a
        step that accumulates into the variables (and keeps views), else
        the output of `_LocalView`."""
        if (
            _ACCUMULATING_STEPS[0]
            and self.views is not None
            and value.requires_grad
            and torch.is_grad_enabled()
        ):
            leaf = gradient_buckets.gradient_leaf(
                value, spec.placements, value._local_tensor
            )
            if leaf is not None:
                return leaf
        return _LocalView.apply(value, spec)

    def _kept_view(self, variable):
        """The view an earlier call made of this variable, if still good.

        A view reads the local tensor (it shares its storage and version
        counter, so it sees the optimizer's in-place updates) and sends
        its gradient to the variable's value, as a new view would. It is
        good while the variable holds the same value with the same local
        tensor, and is read with gradients on, as when it was made.
        """
        kept = self.views.get(id(variable))
        if kept is None:
            return None
        value, local, view, accumulating = kept
        if (
            variable._value is not value
            or value._local_tensor is not local
            or not value.requires_grad
            or not torch.is_grad_enabled()
            # Views made for steps that accumulate may be gradient
            # leaves; other steps need views that lead back to the value.
            or accumulating != (_ACCUMULATING_STEPS[0] > 0)
        ):
            return None
        self.state_mapping[id(variable)] = view
        return view

    def _gathered_view(self, variable, value, spec):
        """The local view of a sharded value, all-gathered for this read.

        A variable of a unit takes the view its unit's gather made, unless
        it was read already or another unit was gathered since: then the
        unit is gathered again. A kept unit's views serve every read of
        the call.
        """
        view = self.unread.pop(id(variable), None)
        if view is None:
            view = self.kept.get(id(variable))
        if view is not None:
            return view
        unit = self.units.get(id(variable))
        if unit is None or unit.plan is None:
            view = _LocalView.apply(_gather(value), spec)
            self._register(_GatheredSource(None, (value,)), (view,))
            return view
        values = tuple(v._value for v in unit.variables)
        started = self.prefetched.pop(id(unit), None)
        if started is not None and not _same_objects(started.values, values):
            started.wait()
            started = None
        self.started.add(id(unit))
        if started is None:
            started = gathered_units.StartedGather(unit.plan, values)
        views = gathered_units.gather_unit(unit.plan, started, values)
        # Issued once this unit's gather is done, so that one gather at a
        # time is in flight; it runs while this unit computes.
        self._prefetch(unit.next)
        views = {id(v): view for v, view in zip(unit.variables, views)}
        if unit.kept:
            # Saved for backward as they are: not gathered again.
            self.kept.update(views)
            return views[id(variable)]
        self._register(_GatheredSource(unit.plan, values), views.values())
        self.unread = views
        return self.unread.pop(id(variable))

    def _prefetch(self, unit):
        """Issues the gather of `unit` ahead, unless it was gathered or
        gathered ahead in this call already (or is None)."""
        if unit is None or id(unit) in self.started:
            return
        self.started.add(id(unit))
        values = tuple(v._value for v in unit.variables)
        self.prefetched[id(unit)] = gathered_units.StartedGather(
            unit.plan, values
        )

    def __exit__(self, *exc_info):
        prefetched, self.prefetched = self.prefetched, {}
        try:
            # A unit gathered ahead but never read: its gather is waited
            # for.
            for started in prefetched.values():
                started.wait()
        finally:
            super().__exit__(*exc_info)

    def _register(self, source, views):
        """Notes where gathered `views` lie, for the saved-tensor hooks."""
        if self.gathered is None:
            return
        for index, view in enumerate(views):
            if not view.is_contiguous():
                continue
            source.offsets[index] = view.storage_offset()
            storage = view.untyped_storage().data_ptr()
            self.gathered[storage] = (source, index)
            # The address may be reused once the view and its storage are
            # freed: by then no saved tensor may be taken for it.
            weakref.finalize(view, self.gathered.pop, storage, None)

    def freeing_gathered_values(self):
        """Saved-tensor hooks that free gathered values after forward.

        Autograd saves what backward needs; a saved gathered value (or a
        view of one) is saved as a note of where it lies in the value, and
        is gathered again, once per backward pass, when backward first
        needs it. Other tensors are saved as they are.
        """
        if self.gathered is None:
            return contextlib.nullcontext()
        gathered = self.gathered

        def pack(tensor):
            if type(tensor) is not torch.Tensor:
                return tensor
            found = gathered.get(tensor.untyped_storage().data_ptr())
            if found is None or tensor.dtype != found[0].dtype:
                return tensor
            return _SavedGathered(*found, tensor)

        def unpack(saved):
            if isinstance(saved, _SavedGathered):
                return saved.tensor()
            return saved

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _gradient_spec(self, variable):
        """The spec of the gradient of the variable's local view.

        Made once per value and gradient placements, and kept on the
        value (a DTensor whose placements never change; a sharded value's
        global shape and stride are its gathered value's).
        """
        value = variable._value
        specs = getattr(value, _GRADIENT_SPECS_ATTRIBUTE, None)
        if specs is None:
            readable = _readable_locally(value, self.gradient_placements)
            sharded = _is_sharded(value, self.gradient_placements)
            if not readable or (not self.units and sharded):
                raise RuntimeError(
                    f"{_describe(self.layer)} runs on local shards but "
                    f"read variable '{variable.path}', which is neither "
                    "replicated nor sharded over the batch axes only, and "
                    "is not one of its variables."
                )
            specs = {}
            setattr(value, _GRADIENT_SPECS_ATTRIBUTE, specs)
        spec = specs.get(self.gradient_placements)
        if spec is None:
            spec = _spec(value.device_mesh, self.gradient_placements, value)
            specs[self.gradient_placements] = spec
        return spec

    def add_update(self, update):
        variable, _ = update
        raise RuntimeError(
            f"{_describe(self.layer)} runs on local shards but assigned "
            f"variable '{variable.path}', which its first call did not."
        )


class _GatheredSource:
    """Gathered values of a local call, by reference.

    Holds the variables' sharded values, not the gathered ones, so that
    these are freed once forward no longer uses them. `local(index)`
    gathers them again for backward (one collective per unit and backward
    pass), once for every saved use.
    """

    def __init__(self, plan, values):
        self.plan = plan
        self.values = values
        self.dtype = values[0].dtype
        # Per gathered value, its storage offset in forward.
        self.offsets = {}
        self.uses = 0
        self.cache = None

    def local(self, index):
        """A gathered local tensor, for one saved use in backward."""
        if self.cache is None:
            with torch.no_grad():
                if self.plan is None:
                    local = _gather(self.values[0])._local_tensor
                    self.cache = [local.contiguous()]
                else:
                    self.cache = self.plan.gather(
                        [value._local_tensor for value in self.values]
                    )
        local = self.cache[index]
        self.uses -= 1
        if self.uses == 0:
            # The last saved use: backward frees it after this node.
            self.cache = None
        return local


class _SavedGathered:
    """A saved gathered value (or a view of one), gathered again when
    backward unpacks it."""

    def __init__(self, source, index, tensor):
        source.uses += 1
        self.source = source
        self.index = index
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset() - source.offsets[index]

    def tensor(self):
        local = self.source.local(self.index)
        return local.as_strided(
            self.size, self.stride, local.storage_offset() + self.offset
        )


class _Unit:
    """Sharded variables gathered together (`gathered_units`).

    Attributes:
        variables: the Keras variables, a tuple.
        plan: the `gathered_units.UnitPlan` that gathers them in one
            collective, or None where each one is gathered alone.
        kept: whether its gathered values are kept for the whole call
            and for backward (the root unit of a model of blocks), not
            freed after forward and gathered again.
        next: the unit with a plan that follows it in order of use,
            gathered ahead when this one is gathered; or None.
    """

    def __init__(self, variables, values, gradient_placements, kept=False):
        self.variables = variables
        self.plan = gathered_units.unit_plan(values, gradient_placements)
        self.kept = kept
        # The unit gathered ahead when this one is gathered (`_units`).
        self.next = None


def _units(layer, sharded, gradient_placements):
    """Per sharded variable (by id), its `_Unit`; empty without any.

    Args:
        layer: the layer that runs locally.
        sharded: its sharded variables and their sharded values.
        gradient_placements: the gradient placements of its local views.
    """
    if not sharded:
        return {}
    values = {id(variable): value for variable, value in sharded}
    # A layer recomputed whole is one unit, as FSDP wraps a block.
    whole = getattr(layer, "_remat_mode", None) is not None
    groups = None
    if not whole:
        groups = gathered_units.block_units(layer, lambda v: id(v) in values)
    if groups is None:
        groups = _joined_units(layer, values, whole, gradient_placements)
    units = {}
    previous = None
    for group, kept in groups:
        group_values = [values[id(v)] for v in group]
        unit = _Unit(group, group_values, gradient_placements, kept)
        units.update((id(variable), unit) for variable in group)
        if unit.plan is None:
            continue
        if previous is not None:
            previous.next = unit
        previous = unit
    return units


def _joined_units(layer, values, whole, gradient_placements):
    """Units of a layer with no repeated blocks: those of its sublayers
    (`owned_units`), consecutive ones joined up to the unit cap; a list
    of `(variables, kept)`, none kept."""
    owned = gathered_units.owned_units(layer, lambda v: id(v) in values, whole)
    candidates = []
    for owner, group in owned:
        group_values = [values[id(v)] for v in group]
        key = _join_key(owner, group_values, gradient_placements)
        nbytes = sum(
            value.numel() * value.element_size() for value in group_values
        )
        candidates.append((key, nbytes, group))
    groups = gathered_units.join_small_units(
        candidates, gathered_units.unit_cap_bytes()
    )
    return [(group, False) for group in groups]


def _same_objects(first, second):
    return len(first) == len(second) and all(
        a is b for a, b in zip(first, second)
    )


def _join_key(owner, values, gradient_placements):
    """Which units one collective may gather together (None: no other).

    A unit joins others of its mesh and dtype when it is gathered in one
    collective itself; a sublayer recomputed in backward stays alone (its
    recomputation gathers its own values again).
    """
    if owner is not None and getattr(owner, "_remat_mode", None) is not None:
        return None
    if gathered_units.unit_plan(values, gradient_placements) is None:
        return None
    return (values[0].device_mesh, values[0].dtype)


def _spec(mesh, placements, tensor):
    """A spec of `tensor`'s shape, stride and dtype (global = local here)."""
    return DTensorSpec(
        mesh,
        placements,
        tensor_meta=TensorMeta(tensor.shape, tensor.stride(), tensor.dtype),
    )


class _AsDTensor(torch.autograd.Function):
    """A local call's output as a DTensor with the watched call's spec.

    As `DTensor.from_local(local, mesh, placements, shape=..., stride=...)`
    with the spec made once per verdict output rather than once per call.
    Its gradient is the local tensor of the output's gradient, brought
    first to `gradient_placements` (the output's, `Replicate` where they
    are `Partial`, as `from_local`'s) where it has others.
    """

    @staticmethod
    def forward(ctx, local, spec, gradient_placements):
        ctx.placements = gradient_placements
        ctx.set_materialize_grads(False)
        # Around a new tensor object sharing `local`'s storage, as
        # `from_local`; autograd makes the DTensor this function's output.
        return dtensor_layouts.dtensor_from_spec(
            local.detach(), dtensor_layouts.copy_spec(spec)
        )

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None
        if grad._spec.placements != ctx.placements:
            grad = grad.redistribute(grad.device_mesh, ctx.placements)
        if torch.is_grad_enabled():
            # Backward builds a graph: the gradient stays differentiable.
            return grad.to_local(), None, None
        return grad._local_tensor, None, None


class _LocalView(torch.autograd.Function):
    """The local tensor of a replicated DTensor variable, for a local call.

    As `DTensor.to_local(grad_placements=...)`, with the gradient's spec
    made once per variable rather than twice per backward pass.
    """

    @staticmethod
    def forward(ctx, value, gradient_spec):
        ctx.gradient_spec = gradient_spec
        ctx.set_materialize_grads(False)
        # A new tensor object, which autograd makes the output, sharing
        # the local tensor's storage and version counter. Not a view in
        # autograd's sense, so that the optimizer's in-place updates of
        # the local tensor leave it this function's output (`views`).
        return value._local_tensor.detach()

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None
        spec = ctx.gradient_spec
        if gradient_buckets.reduce_local_gradient(
            ctx.next_functions[0][0], grad, spec.placements
        ):
            return None, None
        if grad.stride() == spec.tensor_meta.stride:
            # A copy, as DTensor does: specs are not shared between tensors.
            spec = dtensor_layouts.copy_spec(spec)
        else:
            spec = _spec(spec.mesh, spec.placements, grad)
        return dtensor_layouts.dtensor_from_spec(grad, spec), None
