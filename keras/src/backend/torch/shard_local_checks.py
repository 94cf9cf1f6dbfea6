"""The check that a layer call may run on local shards, without gradients
(`inference_local_calls`) or with them (`training_local_calls`).

The first call of a layer with a signature runs on DTensors, noting what
a local run must replay (`local_replays`). It may be local where it left
`Before` unchanged: no collective but its sublayers' verdicts and the
all-reduces at layer ends, no draw, no effect, no added loss, no DTensor
attribute. The check then runs the layer twice more on copies of its
arguments (`run_copies`): on DTensors, and on their local tensors with
the step's mode suspended, replaying the notes; with cotangents, both
backward. In both runs a floating variable of zeros holds the same
quasi-random values (`quasi_random`, in [0.25, 0.75)): zeros hide a
difference (a bias, which a local run adds on every process where
DTensor adds it once to a partial sum; LoRA factors at their start)
that would make a wrong local run pass. The processes
agree on each verdict by one all-reduce of its minimum
(`agreed_everywhere`); a layer's plans are kept per path and signature
(`checked_call`).

Contract: `run_copies` issues the collectives of the DTensor run (its
layer ends, and its backward) or the replayed all-reduces of the local
run, the same on every process; `agreed_everywhere` one all-reduce over
the default group. Nothing else here communicates.
"""

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import local_call_checks
from keras.src.backend.torch import local_call_state
from keras.src.backend.torch import local_calls
from keras.src.backend.torch import local_replays
from keras.src.backend.torch import local_variables
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import torch_runtime

# The step of the quasi-random values (the golden ratio's fractional
# part): no two neighbours equal, no symmetry to hide a transposed
# operand.
_STEP = 0.6180339887498949


def checked_call(layer, key, check, run_locally, on_dtensors):
    """A call on a path whose first call per `key` is checked.

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


def runs_locally(layer, path):
    """Whether a call of `layer` on `path` ("inference" or "training")
    was proven local (for tests and reports)."""
    return any(
        plan is not None
        for key, plan in local_call_state.caches().plans.get(layer, {}).items()
        if type(key) is tuple and key[:1] == (path,)
    )


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


def agreed_everywhere(exact, mesh):
    """Whether `exact` holds on every process: one all-reduce of its
    minimum over the default group, on every process alike."""
    with plain():
        verdict = torch.tensor([int(exact)], device=mesh.device_type)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    local_call_state.step_state().verdicts += 1
    return bool(verdict.item())


def plain():
    """A context where torch functions make plain tensors: the step's
    mode suspended, where it is the innermost one."""
    if created_tensors.current_mode() is None:
        return contextlib.nullcontext()
    return created_tensors.suspended()


def quasi_random(spec, placements, low):
    """A DTensor of `spec`'s global shape and dtype holding quasi-random
    values in [low, low + 1), laid out as `placements`. Cut from a
    replicated tensor made on every process alike: no collective."""
    meta = spec.tensor_meta
    with plain():
        count = 1
        for size in meta.shape:
            count *= size
        values = torch.arange(count, dtype=torch.float64) * _STEP % 1.0
        values = (values + low).to(meta.dtype).reshape(meta.shape)
        whole = DTensor.from_local(
            values.to(spec.mesh.device_type),
            spec.mesh,
            [Replicate()] * spec.mesh.ndim,
            run_check=False,
        )
        # Replicate to Shard takes this process's chunk, locally.
        return whole.redistribute(spec.mesh, placements)


def run_copies(layer, upstream_call, args, kwargs, replay, cotangents=None):
    """Calls the layer on copies of its tensor arguments, its variables
    holding check values, and takes it backward from `cotangents` (a
    list per tensor output, or None: no backward).

    Args:
        replay: None for the run on DTensors (its sublayers on DTensors
            too, `step_state().dtensor_checks`); for the run on local
            tensors, the `local_replays.ReplayPlan` it replays.

    Returns:
        The outputs' tensors, the gradients of the arguments (in
        flattening order) and the gradients of the variables read (by
        id; None where none flows): the local tensors' in a local run.
    """
    local = replay is not None
    arguments = []

    def copy(value):
        copied = torch_internals.local_tensor(value) if local else value
        copied = copied.detach()
        if cotangents is not None and copied.is_floating_point():
            copied.requires_grad_()
        arguments.append(copied)
        return copied

    args, kwargs = local_calls.map_tensors((args, kwargs), copy)
    context = _LocalRun(replay) if local else _DTensorRun()
    scope = VariableReads(
        layer, lambda variable, value: _check_value(value, local, cotangents)
    )
    with context, scope:
        outputs = local_call_checks.tensor_leaves(
            upstream_call(layer, *args, **kwargs)
        )
    if cotangents is None:
        return [output.detach() for output in outputs], [], {}
    sources = arguments + list(scope.state_mapping.values())
    found = _gradients(outputs, cotangents, sources)
    count = len(arguments)
    return (
        [output.detach() for output in outputs],
        found[:count],
        dict(zip(scope.state_mapping, found[count:])),
    )


def _gradients(outputs, cotangents, sources):
    """The gradients of `sources` from `outputs` and `cotangents`, None
    where a source takes none."""
    pairs = [
        (output, cotangent)
        for output, cotangent in zip(outputs, cotangents)
        if output.requires_grad
    ]
    wanted = [source for source in sources if source.requires_grad]
    grads = iter(())
    if pairs and wanted:
        grads = iter(
            torch.autograd.grad(
                [output for output, _ in pairs],
                wanted,
                [cotangent for _, cotangent in pairs],
                allow_unused=True,
            )
        )
    return [next(grads) if s.requires_grad else None for s in sources]


def _check_value(value, local, gradients):
    """A variable's value in a check run: a floating value of zeros gets
    quasi-random values laid out as it is (their local tensor in a local
    run); a gradient leaf where gradients are taken and the value takes
    them."""
    if (
        value.is_floating_point()
        and not torch_internals.local_tensor(value).any()
    ):
        spec = torch_internals.spec_of(value)
        offset = quasi_random(spec, spec.placements, 0.25)
        with plain():
            copied = torch_internals.local_tensor(value) + (
                torch_internals.local_tensor(offset)
            )
        if not local:
            copied = DTensor.from_local(
                copied,
                spec.mesh,
                spec.placements,
                run_check=False,
                shape=spec.tensor_meta.shape,
                stride=spec.tensor_meta.stride,
            )
    else:
        copied = torch_internals.local_tensor(value) if local else value
        copied = copied.detach()
    if gradients is not None and value.requires_grad:
        copied.requires_grad_()
    return copied


class _DTensorRun:
    """The context of a check's run on DTensors: its sublayers run on
    DTensors too (`batch_local.local_calls_allowed`), reading the
    variables the check gives them, not their local views."""

    def __enter__(self):
        local_call_state.step_state().dtensor_checks += 1
        return self

    def __exit__(self, *exc_info):
        local_call_state.step_state().dtensor_checks -= 1
        return False


class _LocalRun:
    """The context of a local run: the step's mode suspended, the replay
    on, counted as a local call."""

    def __init__(self, replay):
        self.plain = plain()
        self.replaying = local_replays.replaying(local_replays.Replay(replay))

    def __enter__(self):
        local_call_state.step_state().local_calls += 1
        self.plain.__enter__()
        self.replaying.__enter__()
        return self

    def __exit__(self, *exc_info):
        try:
            self.replaying.__exit__(*exc_info)
            self.plain.__exit__(*exc_info)
        finally:
            local_call_state.step_state().local_calls -= 1
        return False


def local_run(replay):
    """The context of a local call replaying `replay` (a
    `local_replays.ReplayPlan`)."""
    return _LocalRun(replay)


class VariableReads(StatelessScope):
    """Reads each DTensor variable as `read(variable, value)` gives it,
    once per scope (`state_mapping`, by id(variable), in reading order);
    refuses assignments, which a local call cannot make (a check's run
    then fails)."""

    def __init__(self, layer, read):
        super().__init__(initialize_variables=False)
        self.layer = layer
        self.read = read

    def get_current_value(self, variable):
        view = self.state_mapping.get(id(variable))
        if view is not None:
            return view
        value = variable._value
        if not isinstance(value, DTensor):
            return value
        view = self.read(variable, value)
        self.state_mapping[id(variable)] = view
        return view

    def add_update(self, update):
        variable, _ = update
        raise RuntimeError(
            f"{local_variables.describe(self.layer)} runs on local shards "
            f"but assigned variable '{variable.path}'."
        )
