"""The private parts of torch's DTensor that the sharding rules touch.

Contract: the sharding-rule modules reach DTensor's sharding propagator
and op dispatcher only through these functions, so that a torch upgrade
that moves them is met here. Each says what it reads or writes.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import OutputSharding


def sharding_propagator():
    """DTensor's sharding propagator (one per process)."""
    return DTensor._op_dispatcher.sharding_propagator


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


def set_propagation_slow_path(dispatcher, slow_path):
    """Makes `slow_path` the dispatcher's propagation slow path: what
    DTensor's C++ dispatch calls where its sharding cache misses."""
    dispatcher._propagate_op_sharding_dispatch_slow_path = slow_path


def is_output_sharding(value):
    """Whether a propagation slow path returned a sharding (rather than
    the op's result, which DTensor returns as it is)."""
    return isinstance(value, OutputSharding)
