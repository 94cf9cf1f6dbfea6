"""Sharding rules that DTensor lacks, or that some torch releases refuse.

DTensor decides how each aten op maps input placements to output
placements. Where it has no rule for an op a Keras step runs, or where a
torch release refuses a case that later releases handle, the refusal
surfaces deep inside an ordinary Keras op. The rules here fill such gaps
without changing what a torch release already handles: a rule for an op
that has one runs torch's own rule first and steps in only where it
refuses.

- **Flattening a sharded inner dimension (torch < 2.12).** `torch.matmul`
  on 4-D tensors (attention scores `q @ k^T` with the heads dimension
  sharded) folds the batch and heads dimensions into one with `view`.
  Torch 2.11's `view` rule refuses to merge a sharded dimension into the
  one before it ("Attempted to flatten multiple dimensions, with dimension
  1 being sharded"); torch 2.13 expresses the result as a `_StridedShard`.
  Where the refusal happens, the view takes torch's own `reshape` rule
  instead, which first gathers the merged dimension (replicates it) and
  then views. The values are exact; the gathered dimension costs an
  all-gather and its compute is no longer split.
- **Reshaping a dimension sharded over a mesh axis of size 1.** Such a
  `Shard` holds the whole dimension (JAX would have no axis there), yet
  torch's `view` rule refuses to merge or split it ("would remove or
  reshape sharded dimension"), e.g. `Dense(1)`'s column-sharded output
  viewed as `[1, -1]` by a metric. The view takes the `reshape` rule,
  whose redistribution on a size-1 axis moves nothing.
- **Reshaping a dimension split unevenly.** A global batch that does
  not divide by the processes that split it (a last batch of 35 rows on
  4 processes) is split unevenly, as `torch.chunk` splits it. Torch's
  `view` rule refuses to flatten or unflatten such a dimension ("Cannot
  flatten unevenly sharded tensor"), e.g. `Dense` on `(batch, time,
  features)` folds batch and time into one for its matmul. The view
  takes the `reshape` rule, which gathers the dimension first: exact,
  and an all-gather in the steps whose batch does not divide.
- **An uneven split behind an axis of one process.** Torch's view rules
  check a split dimension against the first mesh axis that splits it
  only. Attention on a (1, 2) mesh can give its output `(Shard(0),
  Shard(0))`: the batch split over the axis of one process, then over
  the other; a last batch of 3 rows is then split unevenly, the check
  passes on the first axis, and the view's local shape is wrong
  ("shape '[1, 12, 16]' is invalid for input of size 256", in
  `EinsumDense`). The view rules see such an input with the `Shard` on
  the axis of one process replaced by `Replicate` (the same local
  tensor), so the uneven split is checked and gathered as above.
- **Unflattening a `_StridedShard` whose split does not fit.** Torch
  2.13's `view` rule refuses to split a dimension laid out as a
  `_StridedShard` (what flattening a sharded inner dimension gives) into
  dimensions its split factor does not match ("Cannot unflatten tensor
  with _StridedShard placement"): keras-nightly's `GRU` flattens its
  time and batch dimensions for one matmul with a column-sharded kernel,
  then splits them again. There the view rule is torch's own, applied
  to the input with its `_StridedShard` placements replicated (torch's
  `reshape` rule gets the local shape of that case wrong: "shape '[0, 8,
  48]' is invalid"); DTensor gathers the input first.
- **CPU flash attention.** DTensor has rules for the CUDA attention
  kernels but not for the one `scaled_dot_product_attention` uses on CPU
  (forward and backward): replicated, split by batch or split by head.
- **CUDA attention with a mask.** Torch's rules for the cuDNN and
  memory-efficient kernels (forward and backward) take a mask (`attn_bias`)
  but lay it out wrongly: torch 2.13's cuDNN forward rule lists no
  placement for it when split ("input_specs(3) != strategies(4: 4 args +
  0 kwargs)", the DataParallel failure of a masked keras-hub model on a
  GPU), and the efficient and cuDNN rules split a mask that broadcasts
  over heads (`[B, 1, T, T]`) along its size-1 head dimension. These
  rules replace them: the same replicated, batch-split and head-split
  strategies, with the mask split like the queries only along a dimension
  it has (else replicated), and its gradient a partial sum where it is
  replicated and the queries are split. The flash kernel takes no mask;
  torch's own rules stay (`sharding_rules_test` checks them for the
  installed torch).
- **Any other op without a usable rule runs replicated.** Where DTensor
  has no rule for an op (`scatter_reduce`, which Keras's segment
  reductions and `AUC` use; `searchsorted`; on torch 2.11, several
  hundred ops torch 2.13 has rules for, `ne.Tensor` among them), or its
  rule lays the result out for a mesh of another size (torch 2.11's
  `constant_pad_nd`: one placement on any mesh), the op runs on
  gathered inputs, each process computing the whole result: exact, at
  the cost of the gathers, logged once per op. Ops that write to their
  inputs or draw random values keep DTensor's error.
- **Padding and pooling on `(batch, channels, *spatial)`.**
  Torch 2.11's DTensor has no rule for pooling; torch 2.13's has rules
  for the pooling ops but not for some of their
  backward ops (average pooling in 2-D and 3-D, max pooling in 3-D,
  adaptive average pooling in 3-D and adaptive max pooling), nor for
  `replicate` and `reflect` padding (Keras pads pooling inputs with
  `replicate` padding where `padding="same"` needs uneven padding, and
  `ops.pad` takes `mode="reflect"` and `"edge"`) forward or backward.
  These ops compute each batch element's channels alone: the rule keeps
  the batch or the channels split, or everything replicated.
- **`fill_` with a tensor value** (Keras's image transforms:
  `RandomRotation`, `RandomZoom`, `RandomTranslation`): none in DTensor
  for a tensor value; the filled tensor keeps any split or replication,
  and the value (one number) is replicated.
- **`squeeze` of several dimensions and `complex` (torch 2.11).** Torch
  2.11's DTensor has no rule for either (`ops.squeeze` with a tuple of
  axes; `ops.istft`): the rules keep a split of the dimensions they keep.
- **Transposing a dimension split over several mesh axes (torch <
  2.12).** A variable laid out `(None, ("model", "fsdp"))` (what
  `merge_layouts` gives a column kernel under tensor parallelism and full
  sharding) is split along one dimension over two mesh axes, the second
  as a `_StridedShard`. Torch 2.11's `t` rule moves each `Shard` to the
  other dimension of a matrix but leaves a `_StridedShard` where it was:
  the transposed kernel that backward multiplies by (`mm`'s gradient)
  was laid out as split along both dimensions, which its local tensor
  is not, and DTensor's planner refused to gather it ("unable to be
  interpreted into a corresponding shard_order"). The rule moves a
  `_StridedShard` with its dimension, as torch 2.13's does.
- **Unbinding a sharded dimension.** Torch's `unbind` rule refuses to
  split a tensor along a dimension it is sharded on ("Attempted to unbind
  along the sharded dimension"). Iterating over a tensor unbinds its
  first dimension: Keras's generic RNN loop (`SimpleRNN`, and `LSTM` or
  `GRU` with a mask) iterates over its first step's output, whose first
  dimension is the batch. Where torch's rule refuses, the rule is torch's
  own, applied to the input with that dimension gathered (replicated):
  the values are exact, and the gather costs an all-gather.

- **`_StridedShard` sizes inside a compiled step** (`strided_shard_sizes`):
  torch 2.13 computes them with tensors, which compile's tracing catches.

`register()` installs every rule; `distribution_lib` calls it when it
creates its first mesh, before any DTensor op runs.
"""

import logging
import math

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor._op_schema import OpSpec
from torch.distributed.tensor._op_schema import OpStrategy
from torch.distributed.tensor._ops.utils import generate_redistribute_costs
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.placement_types import _StridedShard

from keras.src.backend.torch import strided_shard_sizes

# View ops whose rule refuses to flatten or reshape a sharded dimension.
_VIEW_OPS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
# What torch's `view` rule says where `reshape`'s would redistribute.
_VIEW_REFUSALS = (
    "Attempted to flatten multiple dimensions",
    "would remove or reshape sharded dimension",
    "Cannot flatten unevenly sharded tensor",
    "Cannot unflatten unevenly sharded tensor",
    # Torch 2.11's words for the uneven cases.
    "Attempted to flatten unevenly sharded dimension",
    "Attempted to split the sharded dimension",
)
# What torch's `view` rule says where it cannot split a `_StridedShard`.
_STRIDED_UNFLATTEN_REFUSAL = (
    "Cannot unflatten tensor with _StridedShard placement"
)
# What torch's `unbind` rule says where the unbound dimension is sharded.
_UNBIND_REFUSAL = "Attempted to unbind along the sharded dimension"
# Whether `register` ran.
_REGISTERED = False
# The rules `register` added where this torch's DTensor had none, by op.
_ADDED_RULES = {}
# What DTensor says where it has no rule for an op.
_NO_RULE = "does not have a sharding strategy registered"
# The ops found with no usable rule, which run replicated
# (`_register_replicated_fallback`).
_REPLICATED_OPS = set()

logger = logging.getLogger(__name__)


def register():
    """Installs the rules; idempotent. Called by `distribution_lib`."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    _ADDED_RULES.update(_missing_rules())
    register_sharding(
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    )(_cpu_attention_sharding)
    register_sharding(
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    )(_cpu_attention_backward_sharding)
    for op, rule in _cuda_attention_rules().items():
        register_sharding(op)(rule)
    for op, rule in _ADDED_RULES.items():
        register_sharding(op)(rule)
    _register_view_fallbacks()
    _wrap_rules()
    _register_replicated_fallback()
    strided_shard_sizes.register()


def _cuda_attention_rules():
    """The CUDA attention kernels that take a mask, and their rules."""
    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_cudnn_attention.default: (
            _cudnn_attention_sharding
        ),
        aten._scaled_dot_product_cudnn_attention_backward.default: (
            _cudnn_attention_backward_sharding
        ),
        aten._scaled_dot_product_efficient_attention.default: (
            _efficient_attention_sharding
        ),
        aten._scaled_dot_product_efficient_attention_backward.default: (
            _efficient_attention_backward_sharding
        ),
    }


def _missing_rules():
    """The rules of `_fallback_rules` whose op this torch's DTensor has no
    rule for."""
    return {
        op: rule for op, rule in _fallback_rules().items() if not _has_rule(op)
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
        op: _spatial_sharding(rank, len(op._schema.returns))
        for op, rank in spatial.items()
    }
    rules[aten.fill_.Tensor] = _fill_sharding
    rules[aten.fill.Tensor] = _fill_sharding
    rules[aten.squeeze.dims] = _squeeze_dims_sharding
    rules[aten.complex.default] = _complex_sharding
    return rules


def _has_rule(op):
    """Whether DTensor has a sharding rule for `op`."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    return any(
        op in table
        for table in (
            propagator.op_strategy_funcs,
            propagator.op_to_rules,
            getattr(propagator, "op_single_dim_strategy_funcs", {}),
        )
    )


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
    propagator = DTensor._op_dispatcher.sharding_propagator
    reshape_rule = propagator.op_strategy_funcs[torch.ops.aten.reshape.default]
    for op in _VIEW_OPS:
        view_rule = propagator.op_strategy_funcs[op]
        if not getattr(view_rule, "keras_reshape_fallback", False):
            propagator.register_op_strategy(
                op, view_with_reshape_fallback(view_rule, reshape_rule)
            )
    propagator.propagate_op_sharding.cache_clear()


def view_with_reshape_fallback(view_rule, reshape_rule):
    """A `view` rule that takes `reshape`'s where `view`'s refuses.

    `view` and `reshape` take the same arguments (tensor, sizes), and torch
    derives the same dimension map from them for both; the rules differ
    only in that `reshape`'s may redistribute its input. Any other refusal
    of `view_rule` is raised as it is.

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
        except RuntimeError as error:
            message = str(error)
            if _STRIDED_UNFLATTEN_REFUSAL in message:
                return _with_input_costs(
                    view_rule(_first_input_replicated(op_schema, _is_strided)),
                    op_schema.args_schema[0],
                )
            if not any(refusal in message for refusal in _VIEW_REFUSALS):
                raise
        return reshape_rule(op_schema)

    def rule(op_schema):
        input_strategy = op_schema.args_schema[0]
        if not any(
            _hides_an_uneven_split(s.output_spec, mesh_dim)
            for s in input_strategy.strategies
            for mesh_dim in range(s.output_spec.mesh.ndim)
        ):
            return view_or_reshape(op_schema)
        relaid = _first_input_replicated(op_schema, _hides_an_uneven_split)
        return _with_input_costs(view_or_reshape(relaid), input_strategy)

    rule.keras_reshape_fallback = True
    return rule


def _is_strided(spec, mesh_dim):
    return isinstance(spec.placements[mesh_dim], _StridedShard)


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


def _wrap_rule(op, wrap, marker):
    """Replaces DTensor's rule for `op` by `wrap(rule)`, once.

    `marker` is the attribute `wrap` sets on the rules it returns; a rule
    that has it is wrapped already. The rule keeps the op's schema info.
    Nothing happens for an op DTensor has no rule for.
    """
    propagator = DTensor._op_dispatcher.sharding_propagator
    rule = propagator.op_strategy_funcs.get(op)
    if rule is not None and not getattr(rule, marker, False):
        propagator.register_op_strategy(
            op, wrap(rule), propagator.op_to_schema_info.get(op)
        )
    propagator.propagate_op_sharding.cache_clear()


def _wrapped_rules():
    """`(op, wrap, marker)` of each DTensor rule `_wrap_rules` wraps."""
    aten = torch.ops.aten
    return (
        (
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            backward_in_query_layout,
            "keras_query_layout",
        ),
        (aten.unbind.int, unbind_with_gather_fallback, "keras_gather_fallback"),
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


def unbind_with_gather_fallback(unbind_rule):
    """An `unbind` rule that gathers the unbound dimension where
    `unbind_rule` refuses to unbind a sharded dimension.

    The fallback is `unbind_rule` itself, applied to the input laid out
    with every `Shard` of the unbound dimension replaced by `Replicate`:
    its strategy asks DTensor for that layout, which DTensor reaches by
    an all-gather before unbinding. Any other refusal of `unbind_rule` is
    raised as it is.
    """

    def rule(op_schema):
        try:
            return unbind_rule(op_schema)
        except RuntimeError as error:
            if _UNBIND_REFUSAL not in str(error):
                raise
        input_strategy = op_schema.args_schema[0]
        dim = op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else 0
        dim = dim % input_strategy.ndim
        return _with_input_costs(
            unbind_rule(
                _first_input_replicated(
                    op_schema,
                    lambda spec, mesh_dim: (
                        isinstance(spec.placements[mesh_dim], Shard)
                        and spec.placements[mesh_dim].dim == dim
                    ),
                )
            ),
            input_strategy,
        )

    rule.keras_gather_fallback = True
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


def _cpu_attention_sharding(query, key, value, *args, **kwargs):
    """Sharding rules of the CPU flash-attention forward.

    DTensor has rules for the CUDA attention kernels but not for the one
    `scaled_dot_product_attention` uses on CPU. Like its CUDA counterparts,
    it runs replicated, or split by batch (dim 0) or by head (dim 1), with
    query, key, value, output and log-sum-exp split the same way.
    """
    return _attention_strategies(2, 3, args, kwargs)


def _cpu_attention_backward_sharding(
    grad_out, query, key, value, out, logsumexp, *args, **kwargs
):
    """Sharding rules of the CPU flash-attention backward.

    As for the forward: replicated, or every tensor split by batch or by
    head alike.
    """
    return _attention_strategies(3, 6, args, kwargs)


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
                    isinstance(placement, _StridedShard)
                    and placements[mesh_dim] == placement
                ):
                    placements[mesh_dim] = _StridedShard(
                        1 - placement.dim, split_factor=placement.split_factor
                    )
            if tuple(placements) != spec.output_spec.placements:
                spec.output_specs = DTensorSpec(
                    spec.output_spec.mesh, tuple(placements)
                )
        return result

    strategy.keras_strided_shards_moved = True
    return strategy


def backward_in_query_layout(rule):
    """A CPU flash-attention backward strategy: the forward's layout.

    The backward's saved tensors (query, key, value, output, log-sum-exp)
    hold the layout the forward ran in, and its mask (`attn_mask=`, which
    DTensor does not redistribute) the layout it was aligned to for it. The
    strategies of `rule` are per mesh axis; its cheapest for an incoming
    gradient that is a partial sum (a reduce-scatter to a split) may split
    the saved tensors otherwise, and cannot tell an axis of one process
    from the others: it ran keras-hub's Llama on a (1, 2) mesh with the
    mask whole and the queries split (torch 2.11: "shape '[1, 1, 8, 8]' is
    invalid for input of size 256"), or with gradients split on the axis
    of one process as well, which later views could not read. The one
    strategy here takes the query's placements on every axis (`Replicate`
    where the query holds one attention cannot run on: not a batch or head
    split) for every tensor argument and output; only the incoming
    gradient moves. `rule` is used where an argument's strategy is not
    one layout.
    """

    def strategy(op_schema):
        tensors = op_schema.args_schema[:6]
        if not all(
            isinstance(t, OpStrategy) and len(t.strategies) == 1
            for t in tensors
        ):
            return rule(op_schema)
        query = tensors[1].strategies[0].output_spec
        placements = tuple(
            p if p in _ATTENTION_PLACEMENTS else Replicate()
            for p in query.placements
        )
        inputs = [
            DTensorSpec(
                query.mesh,
                placements,
                tensor_meta=t.strategies[0].output_spec.tensor_meta,
            )
            for t in tensors
        ]
        return OpStrategy(
            [
                OpSpec(
                    output_specs=tuple(
                        DTensorSpec(query.mesh, placements) for _ in range(3)
                    ),
                    input_specs=tuple(inputs),
                    redistribute_cost=[
                        generate_redistribute_costs(t, spec)
                        for t, spec in zip(tensors, inputs)
                    ],
                )
            ]
        )

    strategy.keras_query_layout = True
    return strategy


def _attention_strategies(num_outputs, num_inputs, args, kwargs):
    """Replicated, batch-split and head-split attention strategies.

    DTensor does not redistribute keyword arguments, so an attention mask
    (`attn_mask=`) must already be laid out as a strategy needs: split like
    the queries where it has a batch or head dimension of its own,
    replicated where it broadcasts. `_align_attention_mask` lays the inputs
    out so that the strategy DTensor picks (the one needing no
    redistribution) is the one the mask was laid out for.
    """
    mask = kwargs.get("attn_mask")
    strategies = []
    for placement in _ATTENTION_PLACEMENTS:
        others = [None] * len(args) + [
            mask_placement(mask, placement)
            if isinstance(v, DTensorSpec)
            else None
            for v in kwargs.values()
        ]
        strategies.append(
            ([placement] * num_outputs, [placement] * num_inputs + others)
        )
    return strategies


# Placements of queries, keys and values under which attention runs on
# each process alone: replicated, split by batch, split by head.
_ATTENTION_PLACEMENTS = (Replicate(), Shard(0), Shard(1))


def mask_placement(mask, placement):
    """Where the queries are laid out as `placement`, the mask's placement.

    A mask is split like the queries along a batch or head dimension of its
    own, and replicated where it broadcasts there (size 1, or absent).
    """
    if mask is None:
        return None
    if placement.is_shard() and _mask_splits(mask.shape, placement.dim):
        return placement
    return Replicate()


def _mask_grad_placement(mask, placement):
    """The placement of a mask's gradient, for `mask_placement`'s layout.

    A mask replicated while the queries are split gets a gradient that
    sums over the processes' parts: a partial sum.
    """
    placement_of_mask = mask_placement(mask, placement)
    if placement_of_mask is None:
        return None
    if placement.is_shard() and not placement_of_mask.is_shard():
        return Partial()
    return placement_of_mask


def _cudnn_attention_sharding(
    query, key, value, attn_bias, compute_log_sumexp, *args, **kwargs
):
    """Rules of the cuDNN attention forward, with or without a mask.

    Outputs: output, log-sum-exp, cumulative sequence lengths (2), maximum
    lengths (2), dropout seed and offset, debug mask. Torch 2.13's own rule
    has no placement for a mask when split (see the module docstring).
    """
    return_debug_mask = len(args) > 2 and args[2]
    strategies = []
    for p in _ATTENTION_PLACEMENTS:
        outputs = [p, p if compute_log_sumexp else Replicate()]
        outputs += [None] * 6 + [p if return_debug_mask else None]
        inputs = [p, p, p, mask_placement(attn_bias, p), None]
        strategies.append((outputs, inputs + _nones(args, kwargs)))
    return strategies


def _cudnn_attention_backward_sharding(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    seed,
    offset,
    attn_bias,
    *args,
    **kwargs,
):
    """Rules of the cuDNN attention backward: gradients of q, k and v.

    Every tensor of the forward is laid out as there; the dropout seed and
    offset are replicated.
    """
    strategies = []
    for p in _ATTENTION_PLACEMENTS:
        inputs = [p] * 6 + [Replicate(), Replicate()]
        inputs.append(mask_placement(attn_bias, p))
        strategies.append(([p] * 3, inputs + _nones(args, kwargs)))
    return strategies


def _efficient_attention_sharding(
    query, key, value, attn_bias, compute_log_sumexp, *args, **kwargs
):
    """Rules of the memory-efficient attention forward.

    Outputs: output, log-sum-exp, dropout seed and offset. Torch's own rule
    splits a mask that broadcasts over heads along its size-1 dimension.
    """
    strategies = []
    for p in _ATTENTION_PLACEMENTS:
        outputs = [p, p if compute_log_sumexp else Replicate(), None, None]
        inputs = [p, p, p, mask_placement(attn_bias, p), None]
        strategies.append((outputs, inputs + _nones(args, kwargs)))
    return strategies


def _efficient_attention_backward_sharding(
    grad_out,
    query,
    key,
    value,
    attn_bias,
    out,
    logsumexp,
    seed,
    offset,
    *args,
    **kwargs,
):
    """Rules of the memory-efficient attention backward.

    Outputs: gradients of q, k, v and the mask (see
    `_mask_grad_placement`). The kernel computes the mask's gradient only
    where the fourth flag of `grad_input_mask` (the second argument after
    `offset`) asks for it, as for a mask that needs a gradient; a mask
    made from a padding mask needs none, and its gradient is then no
    tensor, whose placement must be none.
    """
    grad_input_mask = _argument(args, kwargs, 1, "grad_input_mask")
    wants_mask_grad = grad_input_mask is None or grad_input_mask[3]
    strategies = []
    for p in _ATTENTION_PLACEMENTS:
        mask_grad = _mask_grad_placement(attn_bias, p)
        outputs = [p, p, p, mask_grad if wants_mask_grad else None]
        inputs = [p, p, p, p, mask_placement(attn_bias, p), p, p]
        inputs += [Replicate(), Replicate()]
        strategies.append((outputs, inputs + _nones(args, kwargs)))
    return strategies


def _argument(args, kwargs, index, name):
    """The argument at `index` of `args`, or keyword `name`, or None."""
    if len(args) > index:
        return args[index]
    return kwargs.get(name)


def _nones(args, kwargs):
    """No placement for each of the non-tensor arguments."""
    return [None] * (len(args) + len(kwargs))


def _mask_splits(mask_shape, dim):
    """Whether an attention mask has dimension `dim` (batch or head)."""
    return len(mask_shape) == 4 and mask_shape[dim] > 1


def _register_replicated_fallback():
    """Sharding propagation that runs replicated an op with no usable rule.

    Where DTensor has no rule for an op ("does not have a sharding
    strategy registered"), or its rule gives placements that do not fit
    the mesh (torch 2.11's `constant_pad_nd` gives one placement on any
    mesh), the op gets a rule that replicates every input and output: each
    process computes the whole op on gathered inputs. The values are
    exact; the inputs' gathers are the cost, logged once per op. Ops that
    write to their inputs, draw random values, take lists of tensors or
    return anything but tensors keep DTensor's error.
    """
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagate = propagator.propagate_op_sharding_non_cached
    if getattr(propagate, "keras_replicated_fallback", False):
        return

    def propagate_or_replicate(op_schema):
        op = op_schema.op
        try:
            sharding = propagate(op_schema)
        except NotImplementedError as error:
            if _NO_RULE not in str(error) or not _runs_replicated(op):
                raise
        else:
            fits = _fits_the_mesh(sharding.output_spec)
            if fits or not _runs_replicated(op):
                return sharding
        _replicate(op)
        return propagate(op_schema)

    propagate_or_replicate.keras_replicated_fallback = True
    propagator.propagate_op_sharding_non_cached = propagate_or_replicate
    propagator.propagate_op_sharding = type(propagator.propagate_op_sharding)(
        propagate_or_replicate
    )


def _replicate(op):
    """Gives `op` the all-replicated rule, in place of any other, and
    says so once."""
    logger.info(
        "DTensor has no usable sharding rule for %s: it runs replicated, "
        "its inputs gathered on every process.",
        op,
    )
    _REPLICATED_OPS.add(op)
    propagator = DTensor._op_dispatcher.sharding_propagator
    getattr(propagator, "op_single_dim_strategy_funcs", {}).pop(op, None)
    register_sharding(op)(_replicated_sharding(len(op._schema.returns)))
    propagator.propagate_op_sharding.cache_clear()


def _replicated_sharding(num_outputs):
    """The rule of an op whose tensors, in and out, are all replicated."""

    def rule(*args, **kwargs):
        values = (*args, *kwargs.values())
        specs = [
            Replicate() if isinstance(v, DTensorSpec) else None for v in values
        ]
        return [([Replicate()] * num_outputs, specs)]

    return rule


def _runs_replicated(op):
    """Whether `op` can run replicated: it writes to none of its inputs,
    draws no random values, takes no list of tensors, and returns tensors
    only."""
    schema = op._schema
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags:
        return False
    if any(_is_tensor_list(argument.type) for argument in schema.arguments):
        return False
    return bool(schema.returns) and all(
        isinstance(value.type, torch.TensorType) for value in schema.returns
    )


def _is_tensor_list(value_type):
    """Whether an argument's type is a list of (optional) tensors."""
    if isinstance(value_type, torch.OptionalType):
        value_type = value_type.getElementType()
    return isinstance(value_type, torch.ListType) and "Tensor" in str(
        value_type.getElementType()
    )


def _fits_the_mesh(output_spec):
    """Whether every output spec has one placement per mesh axis."""
    if not isinstance(output_spec, (tuple, list)):
        output_spec = [output_spec]
    return all(
        len(spec.placements) == spec.mesh.ndim
        for spec in output_spec
        if isinstance(spec, DTensorSpec)
    )
