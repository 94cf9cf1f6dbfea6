"""Inference calls on local shards, where they reproduce DTensor's.

`batch_local` runs a layer on local tensors where its first call proves,
by placements, that each process computes its batch rows alone with
replicated variables. A tensor-parallel layer (variables split over a
model axis: keras-hub's query, key, value and output projections and its
MLP's; inputs split by heads: its rotary embedding) fails that proof and
runs on DTensors, whose dispatch costs Python time on each operator. In
`generate()`, where each token's operators are small, that dispatch is
most of a token's time.

Without gradients (`generate()`, `predict`), such a call is checked
otherwise (`call_layer`). The first call of a layer with a signature
(`batch_local._signature`) runs on DTensors, noting what its local runs
must replay (`local_replays`: its reshapes by global sizes, the
all-reduces where its sublayers end), then once more on the local
tensors of its arguments and variables, with the step's torch function
mode suspended, replaying them (`_run_locally`). The layer runs locally
from then on where, on every process, the DTensor call issued no
collective (but the verdicts of its sublayers' first calls and the
all-reduces at layer ends), drew nothing, noted no effect
(`local_call_checks.note_effect`: a relayout that moves values, a write
of gathered values at local indices), added no loss and held no DTensor
attribute, and the local run returned each output's local tensor bit
for bit, in its shape and dtype. The processes agree on the verdict by
one all-reduce (its minimum), so all take the same path. A later call
with the signature runs on local tensors, replaying the first call's
notes, and lays its outputs out as the first call's
(`local_calls.as_dtensor`), partial sums included:
`batch_local.partial_sums_reduced` reduces them where the layer ends.
keras-hub's attention layers and decoder blocks so generate on local
shards.

With gradients on, `batch_local` decides alone: no gradient is recorded
on this path.

Contract: a first call issues the DTensor call's collectives and one
all-reduce over every process (the verdict), in the same order on every
process; a local call issues the all-reduces its first call issued at
layer ends, in the same order, and no other. A layer whose call depends
on values other than its first call's in a way that the comparison
cannot see (a branch on a value, a write whose position along a split
dimension depends on a value, Python state changed between calls) is
outside what the check proves, as in `batch_local`.
"""

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import local_call_checks
from keras.src.backend.torch import local_call_state
from keras.src.backend.torch import local_calls
from keras.src.backend.torch import local_replays
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import torch_runtime


def applies(leaves, mesh):
    """Whether a call may take this path: no gradient is recorded and its
    tensor arguments (`leaves`) are DTensors on the step's `mesh`."""
    return (
        not torch.is_grad_enabled()
        and bool(leaves)
        and all(leaf.device_mesh == mesh for leaf in leaves)
    )


def call_layer(layer, upstream_call, args, kwargs, signature, on_dtensors):
    """Calls `layer` locally where its first call with `signature` proved
    it exact; else on DTensors (`on_dtensors()`).

    Args:
        layer: the Keras layer.
        upstream_call: upstream `Layer.__call__`.
        args: the positional arguments of the call.
        kwargs: the keyword arguments of the call.
        signature: the call's signature (`batch_local._signature`).
        on_dtensors: a function of no argument making the call on
            DTensors, as `batch_local` does.
    """

    def run_locally(plan):
        outputs = _run_locally(layer, upstream_call, args, kwargs, plan.replay)
        return local_calls.as_dtensors(layer, outputs, plan.outputs)

    return checked_call(
        layer,
        (_KEY, signature),
        lambda: _check_first_call(
            layer, upstream_call, args, kwargs, on_dtensors
        ),
        run_locally,
        on_dtensors,
    )


def checked_call(layer, key, check, run_locally, on_dtensors):
    """A call on a path whose first call per `key` is checked: this one's
    and `training_local_calls`'.

    Args:
        layer: the Keras layer.
        key: `(path, signature)`, the plan's key among the layer's
            `batch_local` plans.
        check: a function of no argument making the first call; returns
            its outputs and the plan (None: the layer runs on DTensors).
        run_locally: a function of the plan making a local call.
        on_dtensors: a function of no argument making the call on
            DTensors.
    """
    plans = local_call_state.caches().plans.setdefault(layer, {})
    if key not in plans:
        outputs, plans[key] = check()
        return outputs
    plan = plans[key]
    if plan is None:
        return on_dtensors()
    return run_locally(plan)


# Marks this path's plans among a layer's `batch_local` plans.
_KEY = "inference"


def runs_locally(layer, path=_KEY):
    """Whether a call of `layer` on a `path` ("inference", this one's, or
    "training") was proven local (for tests and reports)."""
    return any(
        plan is not None
        for key, plan in local_call_state.caches().plans.get(layer, {}).items()
        if type(key) is tuple and key[:1] == (path,)
    )


def _check_first_call(layer, upstream_call, args, kwargs, on_dtensors):
    """Runs the call on DTensors, then locally, and compares them.

    Returns:
        The DTensor call's outputs, and the `_Plan` of its local calls,
        or None where the layer must run on DTensors.
    """
    mesh = torch_internals.spec_of(
        local_call_checks.tensor_leaves((args, kwargs))[0]
    ).mesh
    before = Before(layer, mesh)
    with local_replays.recording() as record:
        outputs = on_dtensors()
    replay = local_replays.ReplayPlan(record)
    with local_replays.paused():
        exact = before.unchanged(layer) and _runs_locally_alike(
            layer, upstream_call, args, kwargs, outputs, replay
        )
        agreed = agreed_everywhere(exact, mesh)
    if not agreed:
        return outputs, None
    specs = tuple(
        local_call_checks.output_spec(leaf, leaf.device_mesh)
        for leaf in local_call_checks.tensor_leaves(outputs)
    )
    return outputs, _Plan(specs, replay)


class _Plan(NamedTuple):
    """How a layer runs locally with a signature.

    Attributes:
        outputs: per tensor output, its local shape, spec and gradient
            placements (`local_call_checks.output_spec`).
        replay: what its local runs replay of its first call
            (`local_replays.ReplayPlan`).
    """

    outputs: tuple
    replay: local_replays.ReplayPlan


class Before:
    """What the DTensor call must leave unchanged: collectives issued on
    the mesh's groups and the default group (but verdicts and the
    all-reduces at layer ends), draws, effects, losses, generator
    states."""

    def __init__(self, layer, mesh):
        self.groups = _groups(mesh)
        self.sequence = [torch_runtime.sequence_number(g) for g in self.groups]
        state = local_call_state.step_state()
        self.verdicts = state.verdicts
        self.layer_ends = local_replays.collectives_at_layer_ends()
        self.effects = state.effects
        self.draws = created_tensors.draw_count()
        self.generators = local_call_checks.generator_states()
        self.losses = local_call_checks.loss_count(layer)

    def unchanged(self, layer):
        """Whether the call left all of it unchanged, but the verdicts and
        the all-reduces at layer ends (which a local run replays)."""
        state = local_call_state.step_state()
        verdicts = state.verdicts - self.verdicts
        ends = local_replays.collectives_at_layer_ends()
        expected = [
            number
            + (verdicts if group is dist.group.WORLD else 0)
            + ends.get(group, 0)
            - self.layer_ends.get(group, 0)
            for group, number in zip(self.groups, self.sequence)
        ]
        return (
            [torch_runtime.sequence_number(g) for g in self.groups] == expected
            and state.effects == self.effects
            and created_tensors.draw_count() == self.draws
            and local_call_checks.loss_count(layer) == self.losses
            and local_call_checks.same_states(
                local_call_checks.generator_states(), self.generators
            )
            and not local_call_checks.holds_dtensor_attributes(layer)
        )


def _groups(mesh):
    """The default group, then each `mesh` axis's group that is not it."""
    groups = [dist.group.WORLD]
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        if all(group is not other for other in groups):
            groups.append(group)
    return groups


def _runs_locally_alike(layer, upstream_call, args, kwargs, outputs, replay):
    """Whether the call run on local tensors (replaying `replay`) returns,
    for each DTensor output, its local tensor exactly (and no other
    tensor)."""
    expected = local_call_checks.tensor_leaves(outputs)
    if not all(
        type(leaf) is DTensor and getattr(leaf, "_keras_mask", None) is None
        for leaf in expected
    ):
        return False
    try:
        local = _run_locally(layer, upstream_call, args, kwargs, replay)
    except Exception:
        # The layer cannot run on local tensors (a shape made from a
        # global size): it runs on DTensors.
        return False
    local = local_call_checks.tensor_leaves(local)
    return len(local) == len(expected) and all(
        type(mine) is torch.Tensor
        and mine.dtype == theirs.dtype
        and mine.shape == torch_internals.local_tensor(theirs).shape
        and torch.equal(mine, torch_internals.local_tensor(theirs))
        for mine, theirs in zip(local, expected)
    )


def agreed_everywhere(exact, mesh):
    """Whether `exact` holds on every process: one all-reduce of its
    minimum over the default group, on every process alike."""
    with plain():
        verdict = torch.tensor([int(exact)], device=mesh.device_type)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    local_call_state.step_state().verdicts += 1
    return bool(verdict.item())


def _run_locally(layer, upstream_call, args, kwargs, replay):
    """Calls the layer on the local tensors of its arguments, variables
    read as their local tensors, the step's torch function mode
    suspended, replaying `replay` (a `local_replays.ReplayPlan`)."""
    args, kwargs = local_calls.map_tensors(
        (args, kwargs), local_calls.local_tensor_of
    )
    state = local_call_state.step_state()
    state.local_calls += 1
    try:
        with (
            _LocalVariables(),
            plain(),
            local_replays.replaying(local_replays.Replay(replay)),
        ):
            return upstream_call(layer, *args, **kwargs)
    finally:
        state.local_calls -= 1


def plain():
    """A context where torch functions make plain tensors: the step's
    mode suspended, where it is the innermost one."""
    if created_tensors.current_mode() is None:
        return contextlib.nullcontext()
    return created_tensors.suspended()


class _LocalVariables(StatelessScope):
    """A `StatelessScope` that reads each DTensor variable as its local
    tensor (no gradient is recorded on this path)."""

    def __init__(self):
        super().__init__(initialize_variables=False)

    def get_current_value(self, variable):
        value = self.state_mapping.get(id(variable))
        if value is not None:
            return value
        value = variable._value
        if isinstance(value, DTensor):
            return torch_internals.local_tensor(value)
        return value

    def add_update(self, update):
        # Not made on the variable: the check's local run fails, and the
        # layer runs on DTensors.
        variable, _ = update
        raise RuntimeError(
            f"Variable '{variable.path}' was assigned in a local run."
        )
