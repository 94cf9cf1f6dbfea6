"""Whether a layer may run on local shards: its first call, checked.

The first call of a layer (or of a built-in loss's per-sample values)
with a given signature (`batch_local`) runs on DTensors as usual, with
its sharded variables unsharded (`UnshardedVariables`), and is checked
(`check_first_call`). It gives a `LocalCallPlan` where it computed each
batch shard alone: on every process, the same local operators on the
same local shards as a plain call of the layer on those shards, so that
a local call gives the values of the DTensor call. Otherwise it gives
None, and the layer runs on DTensors with that signature. Which layers
these are is decided by DTensor, not by a list of layer classes.

Checked (`_BeforeCall.unchanged`, `_output_specs`): the outputs are
DTensors with the batch placements and no Keras mask; no collective but
the unsharding gathers; no variable assigned, no random draw, no loss
added, no tensor laid out (`note_effect`); variables all readable on
local shards, no DTensor attribute, no remat but the layer's own "full".

Contract: a first call issues the collectives of the DTensor call (and
the unsharding gathers). A plan depends only on the program and the
global shapes, so every process takes the same path and the collectives
stay in lockstep.
A layer whose call depends on Python state other than its arguments and
variables, changed between calls, is outside what the check proves.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate

from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import local_call_state
from keras.src.backend.torch import local_variables
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import torch_runtime
from keras.src.backend.torch import unit_gathering
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import TensorMeta


class LocalCallPlan:
    """How a layer's local call reads its variables and lays out outputs.

    Attributes:
        mesh: the step's DTensor mesh.
        placements: the batch placements of inputs and outputs
            (`batch_layout`).
        gradient_placements: the placements of the gradients of the local
            views of variables: `Partial` on mesh axes that split the
            batch, `Replicate` on the others.
        outputs: per tensor output, in flattening order, its local shape,
            its `DTensorSpec` (mesh, placements, global shape, stride and
            dtype) in the first call, and the placements of its
            gradient's local tensor (`local_views.FromLocal`).
        sublayers: the layer's sublayers in the first call (none for a
            loss).
        units: for each variable sharded over the batch axes, its
            `unit_gathering.Unit`; empty when the layer reads none.
        views: id(variable) -> its `local_variables.CachedView`: the
            local view of each replicated variable a local call read with
            gradients on, cached for the next calls.
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
        """Whether a remat mode now keeps `layer` on DTensors (a sublayer
        may have come to recompute activations since: `remat_layers`
        marks layers after their first call)."""
        return remat_anywhere(layer, self.sublayers)


def check_first_call(layer, upstream_call, args, kwargs, placements, mesh):
    """Calls the layer on DTensors and checks whether it may run locally.

    Returns:
        The outputs, and the `LocalCallPlan` (None: the layer must run on
        DTensors with this signature).
    """
    before = _BeforeCall(layer, mesh, placements)
    with UnshardedVariables(layer, placements, before.groups) as unsharded:
        outputs = upstream_call(layer, *args, **kwargs)
    if not before.unchanged(layer, unsharded.collectives):
        return outputs, None
    output_specs = _output_specs(outputs, placements, mesh)
    if output_specs is None:
        return outputs, None
    plan = LocalCallPlan(mesh, placements, output_specs, sublayers(layer))
    plan.units = unit_gathering.local_call_units(
        layer, unsharded.sharded, plan.gradient_placements
    )
    return outputs, plan


class _BeforeCall:
    """What a first call must leave unchanged to be local."""

    def __init__(self, layer, mesh, placements):
        self.groups = [mesh.get_group(i) for i in range(mesh.ndim)]
        self.placements = placements
        # A collective moves the sequence number of its process group.
        self.sequence = _sequence_numbers(self.groups)
        # A random draw moves a default generator's state, or is seen by
        # the step's torch function mode.
        self.generators = generator_states()
        self.draws = created_tensors.draw_count()
        self.effects = _effects_and_owned_writes()
        self.variables = _variable_versions(layer, placements)
        self.losses = loss_count(layer)
        self.holds_dtensors = holds_dtensor_attributes(layer)

    def unchanged(self, layer, gathers):
        """Whether the call communicated, drew, assigned or relaid nothing.

        Args:
            layer: the first-called layer.
            gathers: per mesh dimension, the collectives that unsharded
                variables for the call (`UnshardedVariables`), the only
                ones it may have issued.
        """
        if (
            self.variables is None
            or self.holds_dtensors
            or remat_anywhere(layer)
        ):
            return False
        expected = [
            number + gathers[dim] for dim, number in enumerate(self.sequence)
        ]
        return (
            _sequence_numbers(self.groups) == expected
            and created_tensors.draw_count() == self.draws
            and _effects_and_owned_writes() == self.effects
            and _same_versions(
                _variable_versions(layer, self.placements), self.variables
            )
            and loss_count(layer) == self.losses
            and same_states(generator_states(), self.generators)
        )


def _sequence_numbers(groups):
    """The collectives issued so far on each process group."""
    return [torch_runtime.sequence_number(group) for group in groups]


def _variable_versions(layer, placements):
    """The layer's variables' values and their versions.

    None unless every value is a DTensor that a local call can read
    (`unit_gathering.readable_locally`). An assignment either replaces a
    value or writes into its local tensor (a new version).
    """
    versions = []
    for variable in getattr(layer, "variables", ()):
        value = variable._value
        if not unit_gathering.readable_locally(value, placements):
            return None
        versions.append(
            (value, torch_runtime.version(torch_internals.local_tensor(value)))
        )
    return versions


def holds_dtensor_attributes(owner):
    """Whether a layer (or a loss), or one of its sublayers, holds a
    DTensor as an attribute of its own (not a variable's value).

    A local call reads variables through local views, but such a tensor
    as it is: a DTensor among local tensors. `Normalization` holds its
    statistics so, computed from its variables when it is adapted.
    """
    return any(
        isinstance(value, DTensor)
        for layer in (owner,) + sublayers(owner)
        for value in vars(layer).values()
    )


class UnshardedVariables:
    """Reads the layer's sharded variables unsharded during a call.

    In a first call, the call then runs on DTensors as a local call would
    run on local tensors: with every variable a local call can read
    replicated. Each sharded variable's value is replaced by its
    unsharded value for the duration of the call, so Keras reads it as
    usual, and restored after it. A sublayer called inside the call finds
    its variables unsharded already, and their sharded values in the step
    state's `unsharded`. A variable split over the batch axes and a model
    axis is gathered over the batch axes only
    (`unit_gathering.gathered_over_batch_axes`); with `readable=False`
    (a later call on DTensors, `batch_local`) only such variables are.

    Attributes:
        collectives: per mesh dimension (process group in `groups`, if
            given), the collectives the gathers issued.
        sharded: the layer's sharded variables and their sharded values.
    """

    def __init__(self, layer, placements, groups=None, readable=True):
        self.layer = layer
        self.groups = groups
        self.placements = placements
        self.collectives = [0] * len(groups or ())
        self.sharded = []
        unsharded = local_call_state.step_state().unsharded
        for variable in getattr(layer, "variables", ()):
            value = unsharded.get(id(variable), variable._value)
            if not isinstance(value, DTensor) or not (
                unit_gathering.is_sharded(value, placements)
            ):
                continue
            if readable or not unit_gathering.readable_locally(
                value, placements
            ):
                self.sharded.append((variable, value))
        self.swapped = []

    def _unsharded(self, value):
        """A readable value whole; any other gathered over the batch axes
        only (`unit_gathering.gathered_over_batch_axes`)."""
        if unit_gathering.readable_locally(value, self.placements):
            return unit_gathering.unshard(value)
        return unit_gathering.gathered_over_batch_axes(value, self.placements)

    def __enter__(self):
        unsharded = local_call_state.step_state().unsharded
        own = [pair for pair in self.sharded if id(pair[0]) not in unsharded]
        if not own:
            return self
        before = _sequence_numbers(self.groups or ())
        try:
            for variable, value in own:
                full = self._unsharded(value)
                variable._value = full
                unsharded[id(variable)] = value
                self.swapped.append(
                    (
                        variable,
                        value,
                        full,
                        torch_runtime.version(
                            torch_internals.local_tensor(full)
                        ),
                    )
                )
        except BaseException:
            self._restore()
            raise
        after = _sequence_numbers(self.groups or ())
        self.collectives = [b - a for a, b in zip(before, after)]
        return self

    def _restore(self):
        """Gives the variables their values back; returns the paths of
        those whose unsharded value was written into."""
        unsharded = local_call_state.step_state().unsharded
        changed = []
        for variable, value, full, version in self.swapped:
            unsharded.pop(id(variable), None)
            if variable._value is full:
                variable._value = value
            if (
                torch_runtime.version(torch_internals.local_tensor(full))
                != version
            ):
                changed.append(variable.path)
        return changed

    def __exit__(self, *exc_info):
        changed = self._restore()
        if changed and exc_info[0] is None:
            raise RuntimeError(
                f"{local_variables.describe(self.layer)} assigned its "
                f"sharded variables {changed} in its call. Variables "
                "sharded over the batch axes are read gathered in a "
                "training step and cannot be assigned in a layer's call."
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


def loss_count(layer):
    """The number of losses added by the layer and its sublayers' calls."""
    return sum(
        len(sub._losses)
        for sub in (layer, *sublayers(layer))
        if hasattr(sub, "_losses")
    )


def remat_anywhere(layer, layer_sublayers=None):
    """Whether a remat mode on the layer or a sublayer keeps DTensors.

    `layer_sublayers` defaults to the layer's current ones.
    """
    if layer_sublayers is None:
        layer_sublayers = sublayers(layer)
    # The common case (no sublayer recomputed), checked on every call in
    # one comprehension rather than a call per sublayer.
    modes = [getattr(sub, "_remat_mode", None) for sub in layer_sublayers]
    if modes.count(None) == len(modes):
        return _remat_keeps_dtensors(layer, layer)
    return any(
        _remat_keeps_dtensors(layer, sub) for sub in (layer, *layer_sublayers)
    )


def sublayers(owner):
    """A layer's sublayers, as a tuple; none for a loss."""
    flatten = getattr(owner, "_flatten_layers", None)
    if flatten is None:
        return ()
    return tuple(flatten(include_self=False))


def _remat_keeps_dtensors(layer, sub):
    """Whether `sub`'s remat mode rules out a local call of `layer`.

    A local call of a layer recomputed whole (remat mode "full") runs in a
    checkpoint of its own (`local_calls`). A recomputed sublayer would
    recompute outside the local call's scope, and other modes recompute
    part of a call.
    """
    mode = getattr(sub, "_remat_mode", None)
    if mode is None:
        return False
    return sub is not layer or mode.mode != "full"


def generator_states():
    """The states of the default random generators (CPU, current CUDA)."""
    states = [torch.default_generator.get_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def same_states(first, second):
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
    A first call during which one happened is not local. Nothing is
    counted under `torch.compile`, where no call is checked.
    """
    if torch.compiler.is_compiling():
        return
    local_call_state.step_state().effects += 1


def note_owned_write():
    """Counts a write of the values each process holds into the elements
    it owns, at local indices (`in_place_writes`).

    An effect for this module's check, which reasons on placements alone;
    not for `inference_local_calls`, which compares a local run's values
    with the DTensor call's, bit for bit.
    """
    if torch.compiler.is_compiling():
        return
    local_call_state.step_state().owned_writes += 1


def _effects_and_owned_writes():
    state = local_call_state.step_state()
    return state.effects + state.owned_writes


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


def batch_layout(placements, mesh):
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


def _output_specs(outputs, placements, mesh):
    """Per tensor output its local shape, spec and gradient placements.

    Returns None unless every tensor output is a DTensor on `mesh` with
    the batch `placements` (`batch_layout`) and no Keras mask.
    """
    specs = []
    for leaf in tensor_leaves(outputs):
        if (
            not isinstance(leaf, DTensor)
            or leaf.device_mesh != mesh
            or getattr(leaf, "_keras_mask", None) is not None
        ):
            return None
        if (
            leaf.placements != placements
            and batch_layout(leaf.placements, mesh) != placements
        ):
            return None
        specs.append(output_spec(leaf, mesh))
    return tuple(specs) if specs else None


def output_spec(leaf, mesh):
    """A DTensor output's local shape, spec and gradient placements."""
    spec = DTensorSpec(
        mesh,
        tuple(leaf.placements),
        tensor_meta=TensorMeta(leaf.shape, leaf.stride(), leaf.dtype),
    )
    # As `from_local`'s gradient: `Replicate` for `Partial`.
    gradient_placements = tuple(
        Replicate() if p.is_partial() else p for p in leaf.placements
    )
    return (torch_internals.local_tensor(leaf).shape, spec, gradient_placements)


def tensor_leaves(value):
    """The tensors in nested tuples, lists and dicts, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (tuple, list)):
        return []
    return [leaf for item in value for leaf in tensor_leaves(item)]
