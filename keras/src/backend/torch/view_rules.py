"""Rules of view-like ops where torch's refuse a layout Keras steps meet.

Contract: each function wraps one torch rule and returns a rule that
runs torch's first, and steps in only where it refuses or misreads the
input's layout, with a layout DTensor reaches by gathering (exact; the
gather is the cost):
- `view_with_reshape_fallback`: `view` takes `reshape`'s rule where its
  own refuses (a sharded inner dimension merged on torch < 2.12, a
  dimension sharded on a mesh axis of one process, an uneven split, an
  unflattened `_StridedShard`), and sees an uneven split hidden behind an
  axis of one process;
- `unbind_with_gather_fallback`: `unbind` along a split dimension gathers
  it (Keras's RNN loop iterates over the batch).
`sharding_rules.register` installs them; `torch_workarounds` lists the
gaps.
"""

import math

from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import OpSchema
from keras.src.backend.torch.torch_internals import OpSpec
from keras.src.backend.torch.torch_internals import OpStrategy
from keras.src.backend.torch.torch_internals import StridedShard
from keras.src.backend.torch.torch_internals import generate_redistribute_costs


def view_with_reshape_fallback(view_rule, reshape_rule):
    """A `view` rule that takes `reshape`'s where `view`'s refuses.

    `view` and `reshape` take the same arguments (tensor, sizes), and torch
    derives the same dimension map from them for both; the rules differ
    only in that `reshape`'s may redistribute its input. A refusal that
    `reshape`'s rule shares is raised as `view_rule` gave it.

    Torch's rules check a split dimension against the first mesh axis
    that splits it only. A dimension split over an axis of one process
    and then unevenly over another (`(Shard(0), Shard(0))` on a (1, 2)
    mesh, a batch of 3 rows) passes that check and is viewed as if split
    evenly ("shape '[1, 12, 16]' is invalid for input of size 256"). The
    rules see such an input with its `Shard` on the axis of one process
    replaced by `Replicate`, which holds the same local tensor: the
    uneven split is then checked, and gathered.
    """

    def view_or_reshape(op_schema):
        try:
            return view_rule(op_schema)
        except RuntimeError as refusal:
            # Decided by the input's layout and by `reshape`'s rule, not by
            # the refusal's words. A strided input is viewed with its
            # `_StridedShard`s gathered: torch's `reshape` rule gets the
            # local shape of an unflattened `_StridedShard` wrong ("shape
            # '[0, 8, 48]' is invalid").
            input_strategy = op_schema.args_schema[0]
            if _any_placement(input_strategy, _is_strided):
                relaid = _first_input_replicated(op_schema, _is_strided)
                return _with_input_costs(view_rule(relaid), input_strategy)
            try:
                return reshape_rule(op_schema)
            except RuntimeError:
                # `reshape` refuses too: the refusal was not the layout's.
                raise refusal from None

    def rule(op_schema):
        input_strategy = op_schema.args_schema[0]
        if not _any_placement(input_strategy, _hides_an_uneven_split):
            return view_or_reshape(op_schema)
        relaid = _first_input_replicated(op_schema, _hides_an_uneven_split)
        return _with_input_costs(view_or_reshape(relaid), input_strategy)

    rule.keras_reshape_fallback = True
    rule.torch_rule = view_rule
    return rule


def _any_placement(strategy, picked):
    """Whether a placement of a layout of `strategy` is `picked(spec,
    mesh_dim)`."""
    return any(
        picked(s.output_spec, mesh_dim)
        for s in strategy.strategies
        for mesh_dim in range(s.output_spec.mesh.ndim)
    )


def _is_strided(spec, mesh_dim):
    return isinstance(spec.placements[mesh_dim], StridedShard)


def _hides_an_uneven_split(spec, mesh_dim):
    """Whether `spec`'s placement on `mesh_dim`, an axis of one process,
    splits a dimension that other axes split unevenly."""
    placement = spec.placements[mesh_dim]
    mesh = spec.mesh
    if (
        not isinstance(placement, Shard)
        or mesh.size(mesh_dim) != 1
        or spec.tensor_meta is None
    ):
        return False
    splits = [
        mesh.size(i)
        for i, p in enumerate(spec.placements)
        if isinstance(p, Shard) and p.dim == placement.dim
    ]
    return spec.shape[placement.dim] % math.prod(splits) != 0


def unbind_with_gather_fallback(unbind_rule):
    """An `unbind` rule that gathers the unbound dimension where the input
    is split along it, which `unbind_rule` refuses.

    Decided by the input's placements: where no strategy of the input
    splits the unbound dimension, `unbind_rule` decides alone. Otherwise
    the rule is `unbind_rule` applied to the input laid out with every
    `Shard` of that dimension replaced by `Replicate`: its strategy asks
    DTensor for that layout, which DTensor reaches by an all-gather
    before unbinding.
    """

    def rule(op_schema):
        input_strategy = op_schema.args_schema[0]
        dim = op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else 0
        dim = dim % input_strategy.ndim

        def splits_dim(spec, mesh_dim):
            placement = spec.placements[mesh_dim]
            return isinstance(placement, Shard) and placement.dim == dim

        if not any(
            splits_dim(s.output_spec, mesh_dim)
            for s in input_strategy.strategies
            for mesh_dim in range(s.output_spec.mesh.ndim)
        ):
            return unbind_rule(op_schema)
        return _with_input_costs(
            unbind_rule(_first_input_replicated(op_schema, splits_dim)),
            input_strategy,
        )

    rule.keras_gather_fallback = True
    rule.torch_rule = unbind_rule
    return rule


def _first_input_replicated(op_schema, gathered):
    """`op_schema`, each strategy of its first argument with the
    placements `gathered(spec, mesh_dim)` picks (a predicate) replaced by
    `Replicate`."""
    specs = [s.output_spec for s in op_schema.args_schema[0].strategies]
    relaid = OpStrategy(
        [
            OpSpec(
                DTensorSpec(
                    spec.mesh,
                    tuple(
                        Replicate() if gathered(spec, mesh_dim) else p
                        for mesh_dim, p in enumerate(spec.placements)
                    ),
                    tensor_meta=spec.tensor_meta,
                )
            )
            for spec in specs
        ]
    )
    return OpSchema(
        op_schema.op,
        (relaid,) + tuple(op_schema.args_schema[1:]),
        op_schema.kwargs_schema,
        schema_info=op_schema.schema_info,
    )


def _with_input_costs(strategy, input_strategy):
    """`strategy` (of a gathered input) with the costs of redistributing
    `input_strategy` to each of its input layouts."""
    for op_spec in strategy.strategies:
        op_spec.redistribute_cost = [
            generate_redistribute_costs(input_strategy, op_spec.input_specs[0])
        ]
    return strategy
