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
all-reduces where its sublayers end), then twice more on copies of its
arguments (`shard_local_checks.run_copies`: on DTensors, and on their
local tensors with the step's torch function mode suspended, replaying
the notes). The layer runs locally
from then on where, on every process, the DTensor call issued no
collective (but the verdicts of its sublayers' first calls and the
all-reduces at layer ends), drew nothing, noted no effect
(`local_call_checks.note_effect`: a relayout that moves values, a write
of gathered values at local indices), added no loss and held no DTensor
attribute, and the local run returned each output's local tensor, in
its shape and dtype, up to rounding (`gradient_comparisons.same`). The
processes agree on the verdict by
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

from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.torch import gradient_comparisons
from keras.src.backend.torch import local_call_checks
from keras.src.backend.torch import local_calls
from keras.src.backend.torch import local_replays
from keras.src.backend.torch import shard_local_checks
from keras.src.backend.torch import torch_internals


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

    return shard_local_checks.checked_call(
        layer,
        (_KEY, signature),
        lambda: _check_first_call(
            layer, upstream_call, args, kwargs, on_dtensors
        ),
        run_locally,
        on_dtensors,
    )


# Marks this path's plans among a layer's `batch_local` plans.
_KEY = "inference"


def runs_locally(layer):
    """Whether a call of `layer` on this path was proven local (for
    tests and reports)."""
    return shard_local_checks.runs_locally(layer, _KEY)


def _check_first_call(layer, upstream_call, args, kwargs, on_dtensors):
    """Runs the call on DTensors, then locally, and compares them.

    Returns:
        The DTensor call's outputs, and the `_Plan` of its local calls,
        or None where the layer must run on DTensors.
    """
    mesh = torch_internals.spec_of(
        local_call_checks.tensor_leaves((args, kwargs))[0]
    ).mesh
    before = shard_local_checks.Before(layer, mesh)
    with local_replays.recording() as record:
        outputs = on_dtensors()
    replay = local_replays.ReplayPlan(record)
    with local_replays.paused():
        exact = before.unchanged(layer) and _runs_locally_alike(
            layer, upstream_call, args, kwargs, outputs, replay
        )
        agreed = shard_local_checks.agreed_everywhere(exact, mesh)
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


def _runs_locally_alike(layer, upstream_call, args, kwargs, outputs, replay):
    """Whether the call run on local tensors (replaying `replay`) returns,
    for each DTensor output, the local tensor of the call on DTensors
    exactly (and no other tensor), both with the check's values of the
    variables (`shard_local_checks.run_copies`)."""
    if not all(
        type(leaf) is DTensor and getattr(leaf, "_keras_mask", None) is None
        for leaf in local_call_checks.tensor_leaves(outputs)
    ):
        return False
    try:
        theirs, _, _ = shard_local_checks.run_copies(
            layer, upstream_call, args, kwargs, None
        )
        mine, _, _ = shard_local_checks.run_copies(
            layer, upstream_call, args, kwargs, replay
        )
    except Exception:
        # The layer cannot run on local tensors (a shape made from a
        # global size): it runs on DTensors.
        return False
    return all(
        type(their) is DTensor for their in theirs
    ) and gradient_comparisons.all_same(
        mine, [torch_internals.local_tensor(their) for their in theirs]
    )


def _run_locally(layer, upstream_call, args, kwargs, replay):
    """Calls the layer on the local tensors of its arguments, variables
    read as their local tensors, the step's torch function mode
    suspended, replaying `replay` (a `local_replays.ReplayPlan`)."""
    args, kwargs = local_calls.map_tensors(
        (args, kwargs), local_calls.local_tensor_of
    )
    with shard_local_checks.local_run(replay), _LocalVariables():
        return upstream_call(layer, *args, **kwargs)


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
