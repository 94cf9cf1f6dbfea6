"""Ops without a usable DTensor rule run replicated inside Keras steps.

Contract:
- Inside a Keras step on this thread (`created_tensors.in_step_context`),
  an op DTensor has no sharding rule for (`scatter_reduce`, which Keras's
  segment reductions and `AUC` use; `searchsorted`), or whose rule lays
  its result out for a mesh of another size, runs on its inputs gathered:
  each process computes the whole result, returned replicated. The values
  are exact; the gathers and the repeated compute are the cost, logged
  once per op as a WARNING.
- Outside a step, DTensor behaves as torch ships it: the op raises
  DTensor's own error. Nothing is registered in DTensor's tables, and a
  replicated result is returned from DTensor's propagation slow path as
  a value, which DTensor's sharding caches do not keep.
- Ops that write to their inputs or alias them, draw random values, take
  lists of tensors or return anything but tensors keep DTensor's error.
"""

import logging

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import torch_runtime

logger = logging.getLogger(__name__)


def install():
    """Puts the fallback in front of DTensor's propagation slow path;
    idempotent."""
    dispatcher = torch_internals.op_dispatcher()
    slow_path = torch_internals.propagation_slow_path(dispatcher)
    if not isinstance(slow_path, ReplicatedFallback):
        torch_internals.set_propagation_slow_path(
            dispatcher, ReplicatedFallback(slow_path)
        )


class ReplicatedFallback:
    """DTensor's propagation slow path, with the replicated fallback.

    The C++ dispatch calls it where its own sharding cache misses; it
    caches what this returns only when it is a sharding, so a replicated
    result is computed again on each call, and never seen outside a step.

    Attributes:
        slow_path: DTensor's own slow path.
        warned: the ops the fallback has run, each warned about once.
    """

    def __init__(self, slow_path):
        self.slow_path = slow_path
        self.warned = set()

    def __call__(self, op_call, args, kwargs, op_info, try_cache):
        if not created_tensors.in_step_context():
            return self.slow_path(op_call, args, kwargs, op_info, try_cache)
        try:
            sharding = self.slow_path(op_call, args, kwargs, op_info, try_cache)
        except NotImplementedError:
            # Decided by the op, not by the error's words: DTensor raises
            # this where it found no rule to run.
            if torch_internals.has_sharding_rule(op_call):
                raise
            if not runs_replicated(op_call):
                raise
            return self.run_replicated(op_call, args, kwargs)
        if (
            torch_internals.is_output_sharding(sharding)
            and not fits_the_mesh(sharding.output_spec)
            and runs_replicated(op_call)
        ):
            # Torch 2.11's `constant_pad_nd` rule gives one placement on
            # any mesh.
            return self.run_replicated(op_call, args, kwargs)
        return sharding

    def run_replicated(self, op_call, args, kwargs):
        """`op_call` on gathered inputs, its outputs replicated."""
        meshes = {
            x.device_mesh
            for x in torch_runtime.pytree.tree_leaves((args, kwargs))
            if isinstance(x, DTensor)
        }
        if len(meshes) != 1:
            raise NotImplementedError(
                f"{op_call} has no sharding rule, and its DTensor inputs "
                "lie on several meshes: it cannot run replicated."
            )
        (mesh,) = meshes
        self.warn_once(op_call)
        # Gathered in argument order: the same collectives in the same
        # order on every process.
        local_args, local_kwargs = torch_runtime.pytree.tree_map_only(
            DTensor, _gathered, (args, kwargs)
        )
        result = op_call(*local_args, **local_kwargs)
        return torch_runtime.pytree.tree_map_only(
            torch.Tensor, lambda t: _replicated(t, mesh), result
        )

    def warn_once(self, op_call):
        if op_call in self.warned:
            return
        self.warned.add(op_call)
        logger.warning(
            "DTensor has no usable sharding rule for %s: inside Keras steps "
            "it runs replicated, each process all-gathering its sharded "
            "inputs and computing the whole op.",
            op_call,
        )


def _gathered(value):
    """The whole value of DTensor `value`, as a plain tensor."""
    return value.full_tensor()


def _replicated(local, mesh):
    return DTensor.from_local(
        local, mesh, [Replicate()] * mesh.ndim, run_check=False
    )


def runs_replicated(op):
    """Whether `op` can run replicated: it writes to none of its inputs
    and aliases none, draws no random values, takes no list of tensors,
    and returns tensors only."""
    schema = torch_internals.op_schema(op)
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags:
        return False
    if any(_is_tensor_list(argument.type) for argument in schema.arguments):
        return False
    return bool(schema.returns) and all(
        isinstance(value.type, torch.TensorType) and value.alias_info is None
        for value in schema.returns
    )


def _is_tensor_list(value_type):
    """Whether an argument's type is a list of (optional) tensors."""
    if isinstance(value_type, torch.OptionalType):
        value_type = value_type.getElementType()
    return isinstance(value_type, torch.ListType) and "Tensor" in str(
        value_type.getElementType()
    )


def fits_the_mesh(output_spec):
    """Whether every output spec has one placement per mesh axis."""
    if not isinstance(output_spec, (tuple, list)):
        output_spec = [output_spec]
    return all(
        len(spec.placements) == spec.mesh.ndim
        for spec in output_spec
        if spec is not None and hasattr(spec, "placements")
    )
