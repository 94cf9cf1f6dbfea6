"""Training calls on local shards, where they reproduce DTensor's, gradients
included.

A layer split over a model axis (keras-hub's query, key, value and output
projections, its MLP's, its attention layers) is not batch-local
(`batch_local`), and without gradients it runs locally where its first
call proves it exact (`inference_local_calls`). With gradients on, a
local run must also give each argument and each variable the gradient
DTensor's backward would, and in its placements: a column-parallel
layer's input gradient is a partial sum over the model axis, its
kernel's gradient is split as the kernel.

The first call of a layer with a signature runs on DTensors, noting what
a local run must replay (`local_replays`: reshapes by global sizes, cuts
of replicated operands, the all-reduces where its sublayers end). Where
that call issued no collective (but its sublayers' verdicts and those
all-reduces), drew nothing, noted no effect and added no loss on every
process (a first verdict), the check runs the layer twice more on
copies of its arguments (`shard_local_checks.run_copies`: on DTensors,
its sublayers on DTensors too, and on their local tensors, replaying
the notes) and takes both backward from the same cotangent
(`gradient_comparisons.cotangent`). The layer runs locally from then on
where, on every process, the local run gave each output's and each
gradient's local tensor as `gradient_comparisons` compares them (up to
rounding; a gradient a cut pads, as a partial sum), and no tensor else
(a second verdict). The gradients'
placements are then DTensor's: a local call reads its arguments through
`to_local(grad_placements=...)` and its variables through
`local_views.LocalView` with those placements, and lays its outputs out
as the first call's (`local_calls.as_dtensor`). A replayed all-reduce's
gradient is the reduced sum's, as DTensor's (`local_replays`): an
attention layer, whose output projection ends in one, is Megatron's
`f`/`g` pair on local shards.

Contract: a first call issues the DTensor call's collectives, then one
all-reduce over every process (the first verdict), then, where that
agreed, the collectives of the two check runs (their layer ends, and the
DTensor one's backward) and a second verdict, in the same order on every
process. A local call issues the all-reduces its first call issued at
layer ends, in the same order; in backward, only the redistributions of
gradients that reach its outputs laid out otherwise than the check's
cotangents (`FromLocal`). A layer whose call depends on values other
than its first call's in a way the comparison cannot see is outside what
the check proves, as in `inference_local_calls`.
"""

from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from keras.src.backend.torch import gradient_comparisons
from keras.src.backend.torch import local_call_checks
from keras.src.backend.torch import local_calls
from keras.src.backend.torch import local_replays
from keras.src.backend.torch import local_variables
from keras.src.backend.torch import local_views
from keras.src.backend.torch import shard_local_checks
from keras.src.backend.torch import torch_internals

# Marks this path's plans among a layer's `batch_local` plans.
_KEY = "training"


def applies(leaves, mesh):
    """Whether a call may take this path: gradients are recorded and its
    tensor arguments (`leaves`) are DTensors on the step's `mesh`."""
    return (
        torch.is_grad_enabled()
        and bool(leaves)
        and all(leaf.device_mesh == mesh for leaf in leaves)
    )


def call_layer(layer, upstream_call, args, kwargs, signature, on_dtensors):
    """Calls `layer` locally where its first call with `signature` proved
    it exact, gradients included; else on DTensors (`on_dtensors()`).
    The arguments are `inference_local_calls.call_layer`'s."""

    def run_locally(plan):
        if _recomputed(layer, plan.sublayers):
            return on_dtensors()
        return _call_locally(layer, upstream_call, args, kwargs, plan)

    return shard_local_checks.checked_call(
        layer,
        (_KEY, signature),
        lambda: _check_first_call(
            layer, upstream_call, args, kwargs, on_dtensors
        ),
        run_locally,
        on_dtensors,
    )


def runs_locally(layer):
    """Whether a call of `layer` on this path was proven local (for
    tests and reports)."""
    return shard_local_checks.runs_locally(layer, _KEY)


def _recomputed(layer, sublayers):
    """Whether the layer or a sublayer has a remat mode: a check's runs
    would recompute it in their backward, and its recomputation would
    take the path of its other pass (`batch_local`)."""
    return any(
        getattr(sub, "_remat_mode", None) is not None
        for sub in (layer, *sublayers)
    )


class _Plan(NamedTuple):
    """How a layer runs locally with a signature, gradients included.

    Attributes:
        outputs: per tensor output, its local shape, spec and gradient
            placements (`local_call_checks.output_spec`).
        replay: what its local runs replay of its first call
            (`local_replays.ReplayPlan`).
        arguments: per tensor argument, in flattening order, the spec of
            its gradient (None: no gradient).
        variables: id(variable) -> the spec of its gradient (None: no
            gradient), for each variable the call read.
        sublayers: the layer's sublayers in the first call.
    """

    outputs: tuple
    replay: local_replays.ReplayPlan
    arguments: tuple
    variables: dict
    sublayers: tuple


def _check_first_call(layer, upstream_call, args, kwargs, on_dtensors):
    """Runs the call on DTensors, then, where that may run locally, the
    check (`_gradients_alike`).

    Returns:
        The DTensor call's outputs, and the `_Plan` of its local calls,
        or None where the layer must run on DTensors.
    """
    leaves = local_call_checks.tensor_leaves((args, kwargs))
    mesh = torch_internals.spec_of(leaves[0]).mesh
    before = shard_local_checks.Before(layer, mesh)
    with local_replays.recording() as record:
        outputs = on_dtensors()
    replay = local_replays.ReplayPlan(record)
    with local_replays.paused():
        # The check's DTensor backward may communicate: every process
        # runs it, or none.
        candidate = shard_local_checks.agreed_everywhere(
            before.unchanged(layer)
            and not _recomputed(layer, local_call_checks.sublayers(layer)),
            mesh,
        )
        gradients = None
        if candidate:
            gradients = _gradients_alike(
                layer, upstream_call, args, kwargs, outputs, replay
            )
        if not candidate or not shard_local_checks.agreed_everywhere(
            gradients is not None, mesh
        ):
            return outputs, None
    specs = tuple(
        local_call_checks.output_spec(leaf, leaf.device_mesh)
        for leaf in local_call_checks.tensor_leaves(outputs)
    )
    arguments, variables = gradients
    return outputs, _Plan(
        specs,
        replay,
        arguments,
        variables,
        local_call_checks.sublayers(layer),
    )


def _gradients_alike(layer, upstream_call, args, kwargs, outputs, replay):
    """Runs the layer on DTensors and on local tensors, each on detached
    copies of its arguments and variables, and both backward.

    Returns:
        None unless the local run gave each output's local tensor and
        each gradient's exactly; else the specs of the gradients of the
        arguments, and of the variables by id.
    """
    expected = local_call_checks.tensor_leaves(outputs)
    if not all(
        type(leaf) is DTensor and getattr(leaf, "_keras_mask", None) is None
        for leaf in expected
    ):
        return None
    cotangents = [gradient_comparisons.cotangent(leaf) for leaf in expected]
    try:
        theirs = shard_local_checks.run_copies(
            layer, upstream_call, args, kwargs, None, cotangents
        )
    except Exception:
        # DTensor's backward fails for the layer: it runs on DTensors.
        return None
    try:
        mine = shard_local_checks.run_copies(
            layer,
            upstream_call,
            args,
            kwargs,
            replay,
            [torch_internals.local_tensor(c) for c in cotangents],
        )
    except Exception:
        # A shape made from a global size, or an operator refusing a
        # shard: the layer runs on DTensors.
        return None
    if not all(type(their) is DTensor for their in theirs[0]):
        return None
    if not gradient_comparisons.all_same(
        mine[0], [torch_internals.local_tensor(x) for x in theirs[0]]
    ):
        return None
    if theirs[2].keys() != mine[2].keys():
        return None
    arguments = gradient_comparisons.gradient_specs(theirs[1], mine[1])
    names = list(theirs[2])
    variables = gradient_comparisons.gradient_specs(
        [theirs[2][n] for n in names], [mine[2][n] for n in names]
    )
    if arguments is None or variables is None:
        return None
    return arguments, dict(zip(names, variables))


def _call_locally(layer, upstream_call, args, kwargs, plan):
    """Runs the layer on local tensors with gradients, as its plan says,
    and lays its outputs out as its first call's."""
    specs = iter(plan.arguments)

    def local(value):
        spec = next(specs)
        if spec is None or not value.requires_grad:
            return torch_internals.local_tensor(value).detach()
        return value.to_local(grad_placements=spec.placements)

    def view(variable, value):
        if id(variable) not in plan.variables:
            raise RuntimeError(
                f"{local_variables.describe(layer)} runs on local shards "
                f"but read variable '{variable.path}', which its first "
                "call did not read."
            )
        spec = plan.variables[id(variable)]
        if spec is None or not value.requires_grad:
            return torch_internals.local_tensor(value).detach()
        # Its gradient laid out as the check found it.
        return local_views.LocalView.apply(value, spec)

    args, kwargs = local_calls.map_tensors((args, kwargs), local)
    with (
        shard_local_checks.local_run(plan.replay),
        shard_local_checks.VariableReads(layer, view),
    ):
        outputs = upstream_call(layer, *args, **kwargs)
    return local_calls.as_dtensors(layer, outputs, plan.outputs)
