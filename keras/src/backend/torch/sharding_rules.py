"""Sharding rules that older torch releases lack, added where they refuse.

DTensor decides how each aten op maps input placements to output
placements. Some torch releases refuse cases that later releases handle,
and the refusal surfaces deep inside an ordinary Keras op. The rules here
fill such gaps without changing what a torch release already handles:
each one runs torch's own rule first and steps in only where that rule
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
"""

import torch
from torch.distributed.tensor import DTensor

# View ops whose rule refuses to flatten a sharded inner dimension.
_VIEW_OPS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
_FLATTEN_REFUSAL = "Attempted to flatten multiple dimensions"


def register():
    """Installs the rules; idempotent. Called by `distribution_lib`."""
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
    """A `view` rule that takes `reshape`'s where `view`'s refuses to flatten.

    `view` and `reshape` take the same arguments (tensor, sizes), and torch
    derives the same dimension map from them for both; the rules differ
    only in that `reshape`'s may redistribute its input. Any other refusal
    of `view_rule` is raised as it is.
    """

    def rule(op_schema):
        try:
            return view_rule(op_schema)
        except RuntimeError as error:
            if _FLATTEN_REFUSAL not in str(error):
                raise
        return reshape_rule(op_schema)

    rule.keras_reshape_fallback = True
    return rule
