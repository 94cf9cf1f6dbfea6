"""Sharded variables of a local call, unsharded unit by unit.

A local call (`batch_local`) reads a variable that is replicated as its
local tensor, and one sharded over the mesh axes that split the batch (a
fully sharded layout) unsharded: all-gathered whole (`readable_locally`,
`is_sharded`, `unshard`). The sharded variables of each block of the
layer form a `Unit` (`gathered_units`, FSDP's parameter groups;
`local_call_units`), and `UnitGathering` unshards them for one call:
the first read of a unit's variable unshards the whole unit, in one
collective where the layouts allow it, and issues the next unit's gather
ahead (FSDP2's prefetch), one gather in flight at a time. Its gradient,
a partial sum over the batch axes, is reduce-scattered back to the
shards in backward, one collective per unit: a unit costs one all-gather
in forward and one reduce-scatter in backward, as FSDP's units do, where
DTensor's own operators would pick their redistributions operator by
operator. The root unit (the
variables outside every block) is kept unsharded for the whole call and
for backward; the others are freed after forward
(`reshard_after_forward`).

Contract: a local call issues the gathers of its units in the order it
reads them (with each prefetch right after the gather before it), and
waits at its end for a prefetch it never read; the same program on the
same global shapes gives the same order on every process.
"""

from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras.src.backend.torch import gathered_units
from keras.src.backend.torch import local_views


def readable_locally(value, placements):
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


def is_sharded(value, placements):
    """Whether a readable `value` is split over mesh axes that split the
    batch (read unsharded), given the call's batch or gradient placements.

    A split over another axis (of one process: `readable_locally`)
    leaves the whole value in the local tensor.
    """
    return any(
        p.is_shard() and (batch.is_shard() or batch.is_partial())
        for p, batch in zip(value.placements, placements)
    )


def unshard(value):
    """The full value of a sharded DTensor variable, replicated.

    All-gathers over the mesh axes that split it, differentiably: the
    gradient, a partial sum over the batch axes in a local call, is
    reduce-scattered back to the variable's placements in backward.
    """
    mesh = value.device_mesh
    return value.redistribute(mesh, (Replicate(),) * mesh.ndim)


def gathered_over_batch_axes(value, placements):
    """`value` all-gathered over the mesh axes that split the batch, its
    placements on the other axes kept.

    How a call on DTensors reads a variable split over both the batch and
    a model axis (keras-hub's kernels on a (2, 2) mesh: hidden size over
    "batch", heads over "model"): as FSDP's units over the batch axes,
    tensor-parallel over the model axes. Differentiable: the gradient, a
    partial sum over the batch axes, is reduce-scattered back in
    backward.
    """
    target = tuple(
        Replicate() if p.is_shard() and not batch.is_replicate() else p
        for p, batch in zip(value.placements, placements)
    )
    return value.redistribute(value.device_mesh, target)


class Unit:
    """Sharded variables unsharded together (`gathered_units`).

    Attributes:
        variables: the Keras variables, a tuple.
        plan: the `gathered_units.UnitPlan` that gathers them in one
            collective, or None where each one is gathered alone.
        kept: whether its unsharded values are kept for the whole call
            and for backward (the root unit of a model of blocks), not
            freed after forward and unsharded again.
        next: the unit with a plan that follows it in order of use,
            gathered ahead when this one is gathered; or None.
    """

    def __init__(self, variables, values, gradient_placements, kept=False):
        self.variables = variables
        self.plan = gathered_units.unit_plan(values, gradient_placements)
        self.kept = kept
        # Set by `local_call_units`.
        self.next = None


def local_call_units(layer, sharded, gradient_placements):
    """Per sharded variable (by id), its `Unit`; empty without any.

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
        unit = Unit(group, group_values, gradient_placements, kept)
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


class UnitGathering:
    """The units one local call unshards, as it reads their variables.

    Attributes:
        units: id(variable) -> its `Unit` (`local_call_units`).
        resharding: the call's `reshard_after_forward.ReshardAfterForward`,
            which frees unsharded values after forward; or None (inside a
            checkpoint, which frees them with the rest).
        unread: the views of the last unsharded unit's variables not
            read yet.
        kept: the views of kept units' variables, for the whole call.
        prefetched: id(unit) -> its `StartedGather`, for units gathered
            ahead.
        started: ids of the units gathered, or gathered ahead, in this
            call.
    """

    def __init__(self, units, resharding=None):
        self.units = units
        self.resharding = resharding
        self.unread = {}
        self.kept = {}
        self.prefetched = {}
        self.started = set()

    def view(self, variable, value, spec):
        """The local view of a sharded value, unsharded for this read.

        A variable of a unit takes the view its unit's gather made, unless
        it was read already or another unit was gathered since: then the
        unit is gathered again. A kept unit's views serve every read of
        the call.

        Args:
            variable: the Keras variable read.
            value: its sharded DTensor value.
            spec: the spec of its view's gradient.
        """
        view = self.unread.pop(id(variable), None)
        if view is None:
            view = self.kept.get(id(variable))
        if view is not None:
            return view
        unit = self.units.get(id(variable))
        if unit is None or unit.plan is None:
            view = local_views.LocalView.apply(unshard(value), spec)
            if self.resharding is not None:
                self.resharding.register(None, (value,), (view,))
            return view
        values = tuple(v._value for v in unit.variables)
        views = self._gather_unit(unit, values)
        views = {id(v): view for v, view in zip(unit.variables, views)}
        if unit.kept:
            # Saved for backward as they are: not gathered again.
            self.kept.update(views)
            return views[id(variable)]
        if self.resharding is not None:
            self.resharding.register(unit.plan, values, views.values())
        self.unread = views
        return self.unread.pop(id(variable))

    def _gather_unit(self, unit, values):
        """The views of `unit`'s `values`, from its prefetch where that
        gathered these same values; then the next unit is prefetched."""
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
        self.prefetch(unit.next)
        return views

    def prefetch(self, unit):
        """Issues the gather of `unit` ahead, unless it was gathered or
        gathered ahead in this call already (or is None)."""
        if unit is None or id(unit) in self.started:
            return
        self.started.add(id(unit))
        values = tuple(v._value for v in unit.variables)
        self.prefetched[id(unit)] = gathered_units.StartedGather(
            unit.plan, values
        )

    def wait_prefetched(self):
        """Waits for the gathers of units gathered ahead but never read."""
        prefetched, self.prefetched = self.prefetched, {}
        for started in prefetched.values():
            started.wait()


def _same_objects(first, second):
    return len(first) == len(second) and all(
        a is b for a, b in zip(first, second)
    )
