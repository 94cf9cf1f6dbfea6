"""Sharding rules that DTensor lacks, or that some torch releases refuse.

Contract: `register()` (called by `distribution_lib` when it makes its
first mesh, before any DTensor op runs; once per process) gives DTensor:
- rules for ops this torch's DTensor has none for (`_fallback_rules`:
  padding and pooling on `(batch, channels, *spatial)`, `fill` with a
  tensor value, `squeeze` of several dimensions, `complex`), and the
  attention rules of `attention_rules`;
- wrapped rules for ops whose torch rule refuses, or lays out wrongly, a
  case Keras steps meet (`view`, `unbind`, `stack`, `t`, the CPU
  attention backward): each runs torch's own rule first, and steps in
  only where it refuses;
- the replicated fallback of `replicated_fallback`, for Keras steps only.
A rule never changes a layout a torch release already gives. Which torch
gap each rule answers, the torch versions that need it, the torch issue
and when it can go: `torch_workarounds`.
"""

import functools

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor.experimental import register_sharding

from keras.src.backend.torch import attention_rules
from keras.src.backend.torch import replicated_fallback
from keras.src.backend.torch import strided_shard_sizes
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import unit_axis_redistribution
from keras.src.backend.torch import view_rules
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import OpSchema
from keras.src.backend.torch.torch_internals import StridedShard

_VIEW_OPS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


# The rules `register` added where this torch's DTensor had none, by op.
_ADDED_RULES = {}
# Torch's own rule of each op `register` gives a rule or wraps, as torch
# shipped it (None where it had none): what `torch_workarounds` probes.
TORCH_RULES = {}


@functools.cache
def register():
    """Installs the rules; once, whatever the number of calls."""
    ops = [
        *attention_rules.rules(),
        *_fallback_rules(),
        *_VIEW_OPS,
        *(op for op, _, _ in _wrapped_rules()),
    ]
    TORCH_RULES.update({op: torch_internals.rule_of(op) for op in ops})
    _ADDED_RULES.update(_missing_rules())
    for op, rule in attention_rules.rules().items():
        register_sharding(op)(rule)
    for op, rule in _ADDED_RULES.items():
        register_sharding(op)(rule)
    _register_view_fallbacks()
    _wrap_rules()
    replicated_fallback.install()
    strided_shard_sizes.register()
    unit_axis_redistribution.register()


def _missing_rules():
    """The rules of `_fallback_rules` whose op this torch's DTensor has no
    rule for."""
    return {
        op: rule
        for op, rule in _fallback_rules().items()
        if TORCH_RULES[op] is None
    }


def _fallback_rules():
    """Rules of the ops below, for the torch releases whose DTensor has
    none.

    Spatial ops on `(batch, channels, *spatial)` tensors, by spatial
    rank: padding and pooling, forward and backward (torch 2.11's DTensor
    has no pooling rule at all; 2.13's lacks some backward ops and
    padding); `fill` with a tensor value; and two ops torch 2.11 lacks,
    `squeeze` of several dimensions (`ops.squeeze` with a tuple of axes)
    and `complex` (`ops.istft`).
    """
    aten = torch.ops.aten
    spatial = {
        aten.avg_pool2d.default: 2,
        aten.avg_pool3d.default: 3,
        aten.max_pool2d_with_indices.default: 2,
        aten.max_pool3d_with_indices.default: 3,
        aten._adaptive_avg_pool2d.default: 2,
        aten._adaptive_avg_pool3d.default: 3,
        aten.adaptive_max_pool2d.default: 2,
        aten.adaptive_max_pool3d.default: 3,
        aten.avg_pool2d_backward.default: 2,
        aten.avg_pool3d_backward.default: 3,
        aten.max_pool2d_with_indices_backward.default: 2,
        aten.max_pool3d_with_indices_backward.default: 3,
        aten._adaptive_avg_pool2d_backward.default: 2,
        aten._adaptive_avg_pool3d_backward.default: 3,
        aten.adaptive_max_pool2d_backward.default: 2,
        aten.adaptive_max_pool3d_backward.default: 3,
    }
    for rank in (1, 2, 3):
        for kind in ("replication", "reflection"):
            spatial[getattr(aten, f"{kind}_pad{rank}d").default] = rank
            backward = getattr(aten, f"{kind}_pad{rank}d_backward")
            spatial[backward.default] = rank
    rules = {
        op: _spatial_sharding(rank, len(torch_internals.op_schema(op).returns))
        for op, rank in spatial.items()
    }
    rules[aten.fill_.Tensor] = _fill_sharding
    rules[aten.fill.Tensor] = _fill_sharding
    rules[aten.squeeze.dims] = _squeeze_dims_sharding
    rules[aten.complex.default] = _complex_sharding
    return rules


def _spatial_sharding(spatial_rank, num_outputs):
    """The rule of an op that computes each batch element's channels
    alone, on tensors laid out `(batch, channels, *spatial)` (or
    `(channels, *spatial)` unbatched): every tensor, in and out (there are
    `num_outputs`: max pooling also returns its indices), split along the
    batch, or along the channels, or replicated."""

    def rule(*args, **kwargs):
        values = (*args, *kwargs.values())
        tensors = [v for v in values if isinstance(v, DTensorSpec)]
        placements = [Replicate(), Shard(0)]
        if tensors[0].ndim >= spatial_rank + 2:
            placements.append(Shard(1))
        return [
            (
                [p] * num_outputs,
                [p if isinstance(v, DTensorSpec) else None for v in values],
            )
            for p in placements
        ]

    return rule


def _fill_sharding(self, value):
    """Rule of `fill` with a tensor value: the filled tensor keeps any
    split or replication; the value, one number, is replicated."""
    placements = [Replicate()] + [Shard(dim) for dim in range(self.ndim)]
    return [([p], [p, Replicate()]) for p in placements]


def _squeeze_dims_sharding(self, dims):
    """Rule of `squeeze` of several dimensions: replicated, or split along
    a dimension it keeps (renumbered without the removed ones).

    Only dimensions of size 1 are removed; `squeeze` keeps the others.
    """
    removed = {d % self.ndim for d in dims if self.shape[d] == 1}
    kept = [d for d in range(self.ndim) if d not in removed]
    strategies = [([Replicate()], [Replicate(), None])]
    for new_dim, dim in enumerate(kept):
        strategies.append(([Shard(new_dim)], [Shard(dim), None]))
    return strategies


def _complex_sharding(real, imag):
    """Rule of `complex`, elementwise: both parts and the result
    replicated, or split along the same dimension."""
    placements = [Replicate()] + [Shard(dim) for dim in range(real.ndim)]
    return [([p], [p, p]) for p in placements]


def _register_view_fallbacks():
    """`view` rules that take `reshape`'s where torch's refuse."""
    reshape_rule = torch_internals.strategy_of(torch.ops.aten.reshape.default)
    for op in _VIEW_OPS:
        view_rule = torch_internals.strategy_of(op)
        if not getattr(view_rule, "keras_reshape_fallback", False):
            torch_internals.set_strategy(
                op,
                view_rules.view_with_reshape_fallback(view_rule, reshape_rule),
            )


def _wrap_rule(op, wrap, marker):
    """Replaces DTensor's rule for `op` by `wrap(rule)`, once.

    `marker` is the attribute `wrap` sets on the rules it returns; a rule
    that has it is wrapped already. The rule keeps the op's schema info.
    Nothing happens for an op DTensor has no rule for.
    """
    rule = torch_internals.strategy_of(op)
    if rule is not None and not getattr(rule, marker, False):
        torch_internals.set_strategy(op, wrap(rule))


def _wrapped_rules():
    """`(op, wrap, marker)` of each DTensor rule `_wrap_rules` wraps."""
    aten = torch.ops.aten
    return (
        (
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            attention_rules.backward_in_query_layout,
            "keras_query_layout",
        ),
        (
            aten.unbind.int,
            view_rules.unbind_with_gather_fallback,
            "keras_gather_fallback",
        ),
        (aten.stack.default, stack_with_dim_normalized, "keras_dim_normalized"),
        (
            aten.t.default,
            transpose_moves_strided_shards,
            "keras_strided_shards_moved",
        ),
    )


def _wrap_rules():
    """Wraps each rule of `_wrapped_rules` (`_wrap_rule`): once, whatever
    the number of calls."""
    for op, wrap, marker in _wrapped_rules():
        _wrap_rule(op, wrap, marker)


def stack_with_dim_normalized(rule):
    """A `stack` rule given its dimension counted from the front.

    Torch 2.11's rule counts a negative dimension in the inputs' rank
    instead of the output's, one less: `stack(..., dim=-2)` of tensors
    split along dimension 2 of 4 was laid out as split along dimension 3,
    giving wrong values or shape errors (keras-hub's rotary embedding,
    `ops.stack(..., axis=-2)`, on queries split by head). The local op
    runs with its own arguments; only the rule sees the dimension made
    non-negative, which every release reads the same.
    """

    def strategy(op_schema):
        args = op_schema.args_schema
        if len(args) > 1 and isinstance(args[1], int) and args[1] < 0:
            inputs = args[0].children
            ndim = inputs[0].strategies[0].output_spec.ndim
            op_schema = OpSchema(
                op_schema.op,
                (args[0], args[1] + ndim + 1, *args[2:]),
                op_schema.kwargs_schema,
                schema_info=op_schema.schema_info,
            )
        return rule(op_schema)

    strategy.keras_dim_normalized = True
    strategy.torch_rule = rule
    return strategy


def transpose_moves_strided_shards(rule):
    """A `t` rule whose output moves a matrix's `_StridedShard`.

    Where `rule` left a `_StridedShard` of a 2-D input on its dimension
    (torch 2.11), the output has it on the other dimension, with the same
    split factor; a `Shard` is `rule`'s to move, and an output that moved
    it already (torch 2.13) is left as it is.
    """

    def strategy(op_schema):
        result = rule(op_schema)
        for spec in result.strategies:
            source = spec.input_specs[0]
            if source.ndim != 2:
                continue
            placements = list(spec.output_spec.placements)
            for mesh_dim, placement in enumerate(source.placements):
                if (
                    isinstance(placement, StridedShard)
                    and placements[mesh_dim] == placement
                ):
                    placements[mesh_dim] = StridedShard(
                        1 - placement.dim, split_factor=placement.split_factor
                    )
            if tuple(placements) != spec.output_spec.placements:
                spec.output_specs = DTensorSpec(
                    spec.output_spec.mesh, tuple(placements)
                )
        return result

    strategy.keras_strided_shards_moved = True
    strategy.torch_rule = rule
    return strategy
