"""The private parts of torch's DTensor the project uses: one door.

Contract: outside this module and `torch_runtime`, the project names no
private torch module, class, function or attribute
(`torch_internals_test` checks the sources). A torch upgrade that moves,
renames or reshapes one of them is met here. Each name says what it
stands for; the classes are DTensor's own, re-exported under names
without the leading underscore.
"""

import torch
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _dtensor_spec
from torch.distributed.tensor import _op_schema
from torch.distributed.tensor import _utils
from torch.distributed.tensor import placement_types
from torch.distributed.tensor._ops import utils as _ops_utils

# A DTensor's metadata: mesh, placements and global shape, stride, dtype.
DTensorSpec = _dtensor_spec.DTensorSpec
TensorMeta = _dtensor_spec.TensorMeta
# What sharding rules read and return.
OpSchema = _op_schema.OpSchema
OpSpec = _op_schema.OpSpec
OpStrategy = _op_schema.OpStrategy
TupleStrategy = _op_schema.TupleStrategy
OutputSharding = _op_schema.OutputSharding
# Placements DTensor keeps private: a shard of a shard's interleaving,
# and an embedding lookup's partial result masked per process.
StridedShard = placement_types._StridedShard
MaskPartial = placement_types._MaskPartial
# The functional collectives DTensor issues, and their pending results.
# torch 2.13 names the all-gather and reduce-scatter `*_single` and warns
# (FutureWarning) on each eager call of the old `*_tensor` names, which
# are all torch 2.11 has.
all_gather_single = getattr(
    funcol, "all_gather_single", funcol.all_gather_tensor
)
reduce_scatter_single = getattr(
    funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor
)
AsyncCollectiveTensor = funcol.AsyncCollectiveTensor


def waited(tensor):
    """`tensor`, or the result of its pending collective, waited for (a
    pending result is a tensor subclass that, e.g., numpy cannot read)."""
    if isinstance(tensor, AsyncCollectiveTensor):
        return tensor.trigger_wait()
    return tensor


generate_redistribute_costs = _ops_utils.generate_redistribute_costs
compute_local_shape_and_global_offset = (
    _utils.compute_local_shape_and_global_offset
)


def local_tensor(value):
    """A DTensor's local tensor, read without an autograd node (what
    `to_local` returns under `no_grad`)."""
    return value._local_tensor


def spec_of(value):
    """A DTensor's `DTensorSpec`."""
    return value._spec


def make_dtensor(local, spec, requires_grad=False):
    """A DTensor of `local` laid out as `spec`, with no check and no
    autograd node (DTensor's own constructor)."""
    return DTensor.__new__(DTensor, local, spec, requires_grad=requires_grad)


def take_layout(value, other):
    """Gives the DTensor `value`, in place, the local tensor and spec of
    `other`: the same global tensor (shape, stride, dtype, values) laid
    out otherwise. The caller guarantees that nothing else reads
    `value`'s local tensor (a clone made by the call just before)."""
    value._local_tensor = other._local_tensor
    value._spec = other._spec


def placement_chunks(placement, tensor, num_chunks):
    """The local tensors of `tensor` split by `placement` (a `Shard` or
    `StridedShard`) over `num_chunks` processes, by mesh coordinate."""
    return placement._split_tensor(tensor, num_chunks, with_padding=False)[0]


def op_dispatcher():
    """DTensor's op dispatcher (one per process)."""
    return DTensor._op_dispatcher


def custom_op_handlers():
    """The dispatcher's table of ops it hands to a Python handler."""
    return op_dispatcher()._custom_op_handlers


def local_results(dispatcher, op_call, args, op_info):
    """The local results of `op_call` on `args`, once `op_info`'s output
    sharding is propagated (DTensor's Python dispatch path)."""
    return dispatcher._dispatch_get_local_results_slow_path(
        op_call, args, op_info
    )


def op_schema(op):
    """`op`'s function schema."""
    return op._schema


def sharding_propagator():
    """DTensor's sharding propagator (one per process)."""
    return op_dispatcher().sharding_propagator


def rule_tables(propagator=None):
    """The propagator's tables of rules, by op: strategies, rules, and
    (torch >= 2.13) single-dimension strategies."""
    propagator = propagator or sharding_propagator()
    return (
        propagator.op_strategy_funcs,
        propagator.op_to_rules,
        getattr(propagator, "op_single_dim_strategy_funcs", {}),
    )


def has_sharding_rule(op):
    """Whether DTensor has a sharding rule for `op`."""
    return any(op in table for table in rule_tables())


def rule_of(op):
    """DTensor's rule for `op` from whichever table holds it, or None."""
    for table in rule_tables():
        if op in table:
            return table[op]
    return None


def strategy_of(op):
    """DTensor's strategy function for `op`, or None."""
    return sharding_propagator().op_strategy_funcs.get(op)


def set_strategy(op, strategy):
    """Makes `strategy` DTensor's strategy function for `op`, keeping the
    op's schema info, and forgets the placements propagated so far."""
    propagator = sharding_propagator()
    propagator.register_op_strategy(
        op, strategy, propagator.op_to_schema_info.get(op)
    )
    clear_propagation_caches()


def clear_propagation_caches():
    """Forgets propagated placements: DTensor's Python cache, and this
    thread's C++ cache (torch >= 2.13)."""
    sharding_propagator().propagate_op_sharding.cache_clear()
    clear_native = getattr(
        torch._C, "_clear_DTensor_sharding_propagator_cache", None
    )
    if clear_native is not None:
        clear_native()


def propagation_slow_path(dispatcher):
    """The dispatcher's propagation slow path: what DTensor's C++ dispatch
    calls where its sharding cache misses."""
    return dispatcher._propagate_op_sharding_dispatch_slow_path


def set_propagation_slow_path(dispatcher, slow_path):
    """Makes `slow_path` the dispatcher's propagation slow path."""
    dispatcher._propagate_op_sharding_dispatch_slow_path = slow_path


def is_output_sharding(value):
    """Whether a propagation slow path returned a sharding (rather than
    the op's result, which DTensor returns as it is)."""
    return isinstance(value, OutputSharding)


def mesh_pickle_state(mesh):
    """The state `mesh` pickles, less its cached hash (which unpickling
    recomputes)."""
    state = mesh.__getstate__()
    state.pop("_hash", None)
    return state


def wrap_local_redistribution(wrap):
    """Makes `wrap(redistribute_local_tensor)` the function DTensor's
    dispatch, `DTensor.redistribute` and its backward call to move a
    local tensor between placements; once (a wrapped function is marked
    `keras_skips_unit_axes`)."""
    from torch.distributed.tensor import _api
    from torch.distributed.tensor import _dispatch
    from torch.distributed.tensor import _redistribute

    current = _redistribute.redistribute_local_tensor
    if getattr(current, "keras_skips_unit_axes", False):
        return
    wrapped = wrap(current)
    for module in (_redistribute, _dispatch, _api):
        module.redistribute_local_tensor = wrapped
