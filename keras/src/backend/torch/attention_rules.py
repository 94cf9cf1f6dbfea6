"""Sharding rules of the attention kernels.

Contract: `rules()` maps each attention op to its rule, which
`sharding_rules.register` installs. Every rule offers the same three
layouts: replicated, split by batch (dimension 0) or split by head
(dimension 1), every tensor argument and output alike.
- The CPU flash kernel (`scaled_dot_product_attention` on CPU), forward
  and backward: DTensor has no rule for it.
- The cuDNN and memory-efficient CUDA kernels, forward and backward,
  which take a mask (`attn_bias`): torch's rules lay it out wrongly
  (torch 2.13's cuDNN forward rule lists no placement for a split mask;
  the rules split a mask that broadcasts over heads, `[B, 1, T, T]`,
  along its size-1 head dimension). Here the mask is split like the
  queries only along a dimension it has, else replicated, and its
  gradient is a partial sum where it is replicated and the queries split.
  The flash kernel takes no mask: torch's own rules stay.
- `backward_in_query_layout` wraps torch's CPU backward rule where one
  is installed, so that the backward runs in its forward's layout.
"""

import torch
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import OpSpec
from keras.src.backend.torch.torch_internals import OpStrategy
from keras.src.backend.torch.torch_internals import generate_redistribute_costs


def rules():
    """The attention kernels' rules, by op: the CPU flash kernel's, which
    DTensor lacks, and the CUDA kernels' that take a mask, which it lays
    out wrongly."""
    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention_for_cpu.default: (
            _cpu_attention_sharding
        ),
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (
            _cpu_attention_backward_sharding
        ),
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
