"""Probes of torch's gaps, for the workaround registry.

Contract: each probe returns whether the installed torch still has the
gap that one entry of `torch_workarounds.WORKAROUNDS` answers. It runs
torch's own rule (as `sharding_rules.TORCH_RULES` recorded it before the
project changed any) on a case the gap shows in, in this process, with
no collective: rules are functions of shapes and placements, and meshes
one process cannot build are stood in for by `FakeMesh`.
`sharding_rules.register()` must have run.
"""

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src.backend.torch import sharding_rules
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import torch_runtime
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import OpSchema
from keras.src.backend.torch.torch_internals import OpSpec
from keras.src.backend.torch.torch_internals import OpStrategy
from keras.src.backend.torch.torch_internals import StridedShard
from keras.src.backend.torch.torch_internals import TensorMeta
from keras.src.backend.torch.torch_internals import TupleStrategy
from keras.src.distribution import distribution_lib

aten = torch.ops.aten


class FakeMesh:
    """The parts of a `DeviceMesh` the rules read, for mesh shapes one
    process cannot build."""

    def __init__(self, shape):
        self.shape = shape
        self.ndim = len(shape)

    def size(self, mesh_dim=None):
        return self.shape[mesh_dim]


def _strategy(mesh, placements, shape, dtype=torch.float32):
    """An argument laid out as `placements` on `mesh`, of `shape`."""
    meta = TensorMeta(torch.Size(shape), torch.empty(shape).stride(), dtype)
    return OpStrategy(
        [OpSpec(DTensorSpec(mesh, tuple(placements), tensor_meta=meta))]
    )


def _one_process_mesh(shape):
    """A torch mesh of this one process, of `shape` (all ones)."""
    names = ("batch", "model")[: len(shape)]
    return distribution_lib.DeviceMesh(shape, names, ["cpu:0"]).backend_mesh


def _torch_rule(op):
    return sharding_rules.TORCH_RULES[op]


def _refuses(rule, schema):
    """Whether `rule` raises on `schema`."""
    try:
        rule(schema)
    except (RuntimeError, AssertionError, ValueError):
        return True
    return False


def _output_placements(strategy):
    return [s.output_spec.placements for s in strategy.strategies]


def _has_no_rule(*ops):
    return all(_torch_rule(op) is None for op in ops)


def cpu_flash_attention_has_no_rule():
    return _has_no_rule(
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    )


def cudnn_forward_rule_drops_the_mask():
    """Torch's cuDNN forward rule, queries split by head, with a mask:
    a strategy without a placement for the mask."""
    op = aten._scaled_dot_product_cudnn_attention.default
    rule = _torch_rule(op)
    if rule is None:
        return False
    mesh = _one_process_mesh((1,))
    query = _strategy(mesh, [Shard(1)], (2, 4, 8, 16), torch.bfloat16)
    mask = _strategy(mesh, [Shard(1)], (2, 4, 8, 8), torch.bfloat16)
    schema = OpSchema(op, (query, query, query, mask, True, 0.0, False), {})
    try:
        strategy = rule(schema)
    except (RuntimeError, AssertionError, ValueError, IndexError):
        return True
    return any(
        len(s.input_specs) < 4 or s.input_specs[3] is None
        for s in strategy.strategies
    )


def _view(placements, mesh, shape, new_shape):
    rule = _torch_rule(aten.view.default)
    schema = OpSchema(
        aten.view.default,
        (_strategy(mesh, placements, shape), list(new_shape)),
        {},
    )
    return rule, schema


def view_refuses_to_flatten_a_sharded_inner_dimension():
    return _refuses(*_view([Shard(1)], FakeMesh((2,)), (2, 4, 8), (8, 8)))


def view_refuses_a_shard_on_an_axis_of_one_process():
    mesh = FakeMesh((1, 1))
    return _refuses(*_view([Shard(0), Shard(1)], mesh, (16, 1), (1, 16)))


def view_refuses_an_uneven_split():
    return _refuses(*_view([Shard(0)], FakeMesh((2,)), (9, 4), (36,)))


def view_accepts_an_uneven_split_behind_an_axis_of_one():
    """3 rows split over a (1, 2) mesh, as (Shard(0), Shard(0)): torch's
    rule views them as if they were split evenly."""
    rule, schema = _view(
        [Shard(0), Shard(0)], FakeMesh((1, 2)), (3, 8, 16), (24, 16)
    )
    try:
        strategy = rule(schema)
    except RuntimeError:
        return False
    return (Shard(0), Shard(0)) in _output_placements(strategy)


def unbind_refuses_a_sharded_dimension():
    rule = _torch_rule(aten.unbind.int)
    schema = OpSchema(
        aten.unbind.int,
        (_strategy(FakeMesh((2,)), [Shard(0)], (4, 3)), 0),
        {},
    )
    return _refuses(rule, schema)


def stack_misplaces_a_negative_dimension():
    """Two 4-D tensors split along dimension 2, stacked at -2: the result
    keeps the split on dimension 2."""
    rule = _torch_rule(aten.stack.default)
    inputs = _strategy(FakeMesh((2,)), [Shard(2)], (2, 3, 4, 5))
    schema = OpSchema(
        aten.stack.default, (TupleStrategy([inputs, inputs]), -2), {}
    )
    return (Shard(2),) not in _output_placements(rule(schema))


def transpose_leaves_a_strided_shard():
    rule = _torch_rule(aten.t.default)
    placements = [Shard(1), StridedShard(1, split_factor=2)]
    schema = OpSchema(
        aten.t.default,
        (_strategy(FakeMesh((2, 2)), placements, (4, 8)),),
        {},
    )
    return any(
        p == StridedShard(1, split_factor=2)
        for placements in _output_placements(rule(schema))
        for p in placements
    )


def pooling_backward_has_no_rule():
    return _has_no_rule(
        aten.avg_pool2d_backward.default,
        aten.max_pool3d_with_indices_backward.default,
        aten.adaptive_max_pool2d_backward.default,
    )


def padding_has_no_rule():
    return _has_no_rule(
        aten.replication_pad2d.default,
        aten.reflection_pad2d.default,
        aten.reflection_pad2d_backward.default,
    )


def fill_with_a_tensor_has_no_rule():
    return _has_no_rule(aten.fill_.Tensor)


def squeeze_dims_has_no_rule():
    return _has_no_rule(aten.squeeze.dims)


def complex_has_no_rule():
    return _has_no_rule(aten.complex.default)


def scatter_reduce_has_no_rule():
    return not any(
        torch_internals.has_sharding_rule(op)
        for op in (aten.scatter_reduce.two, aten.searchsorted.Tensor)
    )


def constant_pad_rule_is_blind_to_the_mesh():
    """Torch's `constant_pad_nd` rule on a 2-D mesh: one placement."""
    mesh = _one_process_mesh((1, 1))
    value = torch.empty(4, 4)
    meta = TensorMeta(value.shape, value.stride(), value.dtype)
    spec = DTensorSpec(mesh, (Shard(0), Replicate()), tensor_meta=meta)
    schema = OpSchema(aten.constant_pad_nd.default, (spec, [1, 2]), {})
    propagator = torch_internals.sharding_propagator()
    sharding = propagator.propagate_op_sharding_non_cached(schema)
    return len(sharding.output_spec.placements) != mesh.ndim


def chunk_cat_misreads_a_negative_dimension():
    """Two gathered rows of shape (1, 4), along the last dimension."""
    rows = torch.arange(8.0).reshape(2, 1, 4)
    expected = torch.cat(torch.chunk(rows, 2, dim=0), dim=-1)
    try:
        got = torch_runtime.chunk_cat(rows, 2, -1)
    except RuntimeError:
        return True
    return got.shape != expected.shape or not torch.equal(got, expected)
